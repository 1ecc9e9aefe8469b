"""A KernelBench pair as a kfuzz target, which the gates judge.

- the kernel is ``ModelNew``, the oracle the reference ``Model`` in float64
  and the trusted implementation the reference in float32, all three with
  the same weights: ``Model``'s, loaded into ``ModelNew`` strictly (a
  parameter missing or extra is a contract failure; renamed parameters of
  identical shapes in the same order are loaded by position), in the mode
  the accepting harness used (``eval_mode``: CUDA-L1's calls ``.eval()``,
  KernelBench's does not);
- the symbolic dims are the reference's integer size constants that size an
  input directly (``source.size_constants``, told apart by re-running
  ``get_inputs`` on the meta device with one constant changed at a time);
  each admits 1 up to its fixed value. A constant that sizes an input only
  through arithmetic stays fixed, and so do constants that size no input
  (they reach ``get_init_inputs`` only, and a kernel call cannot name them);
- inputs come from kfuzz's cases (distributions, special values, layouts),
  kept in the reference's domain where ``get_inputs`` shows one: positions
  that are always zero stay zero (triangular matrices), symmetric inputs stay
  symmetric, and integer inputs (indices, class labels) are drawn by
  ``get_inputs`` itself at the case's dims. Value ranges are not kept: that
  KernelBench draws ``torch.rand`` in [0, 1) is the weakness the gates probe.
  A Python float in ``get_inputs`` (a matrix times a scalar) is a 0-d float
  argument in the cases, fuzzed as any input (distributions, special values)
  and passed to ``forward`` as a Python float again (``Contract.scalars``).
- G07 (exact accumulation) is n/a for a reference with float weights
  (``float_weights``: parameters, buffers, tensor attributes), through
  ``options["no_exact_answers"]``: the case sets the inputs, not the weights, so
  no output is exact by construction, and a correct kernel that sums in another
  order (a tiled loop, another library algorithm) loses what one order got
  exactly by chance (``harnesses/kernelbench_controls/correct_linear_blocked.py``).
- G06 (range) excuses positions where the reference in float32 is non-finite too
  (``options["reference_limited"]``): float32 itself cannot do better there.

``as_target`` runs the reference to learn its contract; ``custom_code`` runs
only when the kernel is first called (in a sandboxed worker). ``resolve``
builds the target named ``kb:<corpus file>:<row>``.

Refuses (``KernelBenchError``): references whose inputs are neither tensors nor
Python floats, are floating point other than float32, or that do not run at
their own sizes.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import types
import zlib
from dataclasses import dataclass
from functools import lru_cache

import torch

from kfuzz.kernelbench.build import compiles, prebuilt_only
from kfuzz.kernelbench.corpus import read_row
from kfuzz.kernelbench.source import (PRECISION, PREFIX, SEED, KernelBenchError, KernelBenchPair, outputs_of,
                                      own_constants, pair_module, precision, reads_names, set_seed, size_constants,
                                      sized)
from kfuzz.kernelbench.weights import (FLOAT_WEIGHTS, RELOAD_SEED, WEIGHTS, float_weights, load_shared,
                                       load_weights, trained)
from kfuzz.target import Arg, Dim, Output, Target

MODEL_SETS = 2            # sets of models (distinct init inputs) kept per pair


class OracleDtype(torch.overrides.TorchFunctionMode):
    """Every floating tensor of a lower precision that an op takes or makes becomes ``dtype``
    (float64): the oracle's precision reaches tensors a reference makes inside ``forward`` with
    an explicit dtype (``torch.arange(n, dtype=torch.float32)``, ``.float()``), which the default
    dtype does not, and which would otherwise meet float64 weights in one op."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def _lift(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.dtype:
            return x.to(self.dtype)
        if isinstance(x, torch.dtype) and x.is_floating_point and x != self.dtype:
            return self.dtype
        return x

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map
        args, kwargs = tree_map(self._lift, (args, kwargs or {}))
        return tree_map(self._lift, func(*args, **kwargs))


def _meta_inputs(ref: types.ModuleType, values: dict[str, int]) -> list:
    with sized(ref, values), torch.device("meta"):
        return list(ref.get_inputs())


@dataclass(frozen=True)
class Contract:
    """What the reference admits: its inputs' symbolic shapes and dtypes, and its free dims."""

    arg_names: tuple[str, ...]
    arg_shapes: tuple[tuple, ...]
    arg_dtypes: tuple[str, ...]
    dims: dict                       # free constant -> its fixed value
    fixed: tuple[str, ...]           # size constants held at their value
    scalars: tuple[str, ...] = ()    # inputs get_inputs gives as Python floats (0-d in the cases)

    def passed(self, inputs: dict) -> list:
        """The arguments of ``forward`` from a case's ``inputs``, in order: each a tensor, or
        for a ``scalars`` input, the Python float of its 0-d tensor, as ``get_inputs`` gives it."""
        return [float(inputs[n]) if n in self.scalars else inputs[n] for n in self.arg_names]


def _is_scalar(x) -> bool:
    return isinstance(x, float)


def _shape(x) -> tuple:
    return () if _is_scalar(x) else tuple(x.shape)


def infer_contract(pair: KernelBenchPair) -> Contract:
    """Probe the reference (on the meta device) for its inputs' symbolic shapes."""
    ref = pair_module(pair, "ref")
    base_values = size_constants(pair.ref_code)
    try:
        base = _meta_inputs(ref, {})
    except Exception as e:
        raise KernelBenchError(f"{pair.name}: get_inputs() fails on the meta device ({type(e).__name__}: {e})") from None
    for i, x in enumerate(base):
        if _is_scalar(x):
            continue
        if not isinstance(x, torch.Tensor):
            raise KernelBenchError(f"{pair.name}: get_inputs() item {i} is a {type(x).__name__}, "
                                   f"not a tensor or a float")
        if x.dtype.is_floating_point and x.dtype != torch.float32:
            raise KernelBenchError(f"{pair.name}: input {i} is {x.dtype}; the adapter takes float32 references")
    params = [p for p in inspect.signature(ref.Model.forward).parameters.values() if p.name != "self"]
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(names) < len(base):
        names += [f"x{i}" for i in range(len(names), len(base))]
    names = names[:len(base)]
    owner: dict[tuple[int, int], str] = {}      # (input, axis) -> the constant that sizes it
    fixed = set()
    for const, value in base_values.items():
        probe = value + 1 if value > 1 else 2
        try:
            shapes = [_shape(x) for x in _meta_inputs(ref, {const: probe})]
        except Exception:
            fixed.add(const)
            continue
        for i, (x, s) in enumerate(zip(base, shapes)):
            for axis, (a, b) in enumerate(zip(_shape(x), s)):
                if a == b:
                    continue
                if a == value and b == probe and (i, axis) not in owner:
                    owner[(i, axis)] = const
                else:
                    fixed.add(const)
            if len(s) != len(_shape(x)):
                fixed.add(const)
    owner = {k: c for k, c in owner.items() if c not in fixed}
    free = {c: base_values[c] for c in base_values if c in set(owner.values())}
    shapes = tuple(tuple(owner.get((i, a), n) for a, n in enumerate(_shape(x))) for i, x in enumerate(base))
    dtypes = tuple("case" if _is_scalar(x) or x.dtype.is_floating_point else str(x.dtype).removeprefix("torch.")
                   for x in base)
    scalars = tuple(n for n, x in zip(names, base) if _is_scalar(x))
    return Contract(tuple(names), shapes, dtypes, free, tuple(sorted(set(base_values) - set(free))), scalars)


class Bench:
    """One pair's models at each shape, in this process: the reference (float32 and float64) and,
    on first use, the solution, all with the reference's weights."""

    def __init__(self, pair: KernelBenchPair, contract: Contract, weights: str = "strict", device: str = "cpu"):
        if weights not in WEIGHTS:
            raise KernelBenchError(f"{pair.name}: weights {weights!r} is not one of {', '.join(WEIGHTS)}")
        self.pair, self.contract, self.weights, self.device = pair, contract, weights, device
        self.where = {}
        for i, shape in enumerate(contract.arg_shapes):
            for axis, sym in enumerate(shape):
                if isinstance(sym, str):
                    self.where.setdefault(sym, (contract.arg_names[i], axis))
        self.models: dict = {}          # (init key, role, ...) -> module, for MODEL_SETS init keys
        self.inits: dict = {}           # dims -> (init key, get_init_inputs() there)
        self.cache: dict = {}           # per-dims facts (structure)
        self.weights_status: str | None = None
        self.init_error: str | None = None      # what ModelNew(*get_init_inputs()) raised, where it did
        self.flags_changed: set[str] = set()    # precision flags the solution set (then put back)
        # a reference whose Model reads a size constant: the problem's models are built under the
        # case's values (the solution's from its own module's copies of the constants), so they
        # depend on the dims, not only on get_init_inputs(); the solution's calls are not: a
        # forward that reads a constant at call time is hard-coded to the fixed shape
        self.dims_in_models = bool(contract.dims) and reads_names(pair.ref_code, "Model", contract.dims)

    def dims_of(self, inputs: dict) -> dict[str, int]:
        return {d: int(inputs[name].shape[axis]) for d, (name, axis) in self.where.items()}

    def _init(self, dims: dict) -> tuple[str, list]:
        """``get_init_inputs()`` at ``dims`` and its key: models are built once per distinct init
        inputs (a batch or image size changes no weight), and at most MODEL_SETS sets are kept,
        so a level-3 network does not fill the GPU with one float64 copy per shape."""
        d = tuple(sorted(dims.items()))
        if d not in self.inits:
            ref = pair_module(self.pair, "ref")
            with sized(ref, dims):
                set_seed(SEED)
                init = ref.get_init_inputs()
            self.inits[d] = (repr(init) + (repr(d) if self.dims_in_models else ""), init)
        key, init = self.inits[d]
        keys = list(dict.fromkeys(k[0] for k in self.models))
        if key not in keys and len(keys) >= MODEL_SETS:
            for k in [k for k in self.models if k[0] == keys[0]]:
                del self.models[k]
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return key, init

    def _ref_cpu(self, dims: dict, seed: int | None = None) -> torch.nn.Module:
        """The reference ``Model`` at ``dims`` on the CPU, its weights from ``seed`` (by default
        the checkpoint the target judges with: ``SEED``, ``RELOAD_SEED`` for ``weights="reload"``
        and ``"lenient"``)."""
        seed = (RELOAD_SEED if self.weights in ("reload", "lenient") else SEED) if seed is None else seed
        key, init = self._init(dims)
        if (key, "ref", seed) not in self.models:
            model = self._new_ref(dims, init, seed)
            if seed == RELOAD_SEED:
                trained(model, seed)
            self.models[(key, "ref", seed)] = model
        return self.models[(key, "ref", seed)]

    def _new_ref(self, dims: dict, init: list, seed: int = SEED) -> torch.nn.Module:
        """A reference ``Model`` made now at ``dims`` on the CPU, after ``set_seed(seed)``."""
        ref = pair_module(self.pair, "ref")
        with sized(ref, dims):
            set_seed(seed)
            return ref.Model(*init).train(not self.pair.eval_mode)

    def reference_model(self, dims: dict, dtype: torch.dtype, device) -> torch.nn.Module:
        """The reference at ``dims`` in ``dtype`` on ``device``, with the values of the checkpoint
        the target judges with (``_ref_cpu``). It is a ``Model`` made anew with that checkpoint
        loaded, not a copy: a copy's forward may still call the original's modules, where it
        keeps them in a closure (minGPT's ``self.mlpf = lambda x: m.c_proj(...)``), which stay
        on the CPU in float32. A model whose state does not load so is copied. What a state_dict
        does not hold (plain tensor attributes, an LSTM's random ``h0``) stays the model's own, made
        after ``set_seed(SEED)`` as the solution is: loading a checkpoint of another seed
        (``weights="reload"``) moves it in neither."""
        init_key, init = self._init(dims)
        key = (init_key, "ref", dtype, str(device))
        if key not in self.models:
            checkpoint = self._ref_cpu(dims)
            model = self._new_ref(dims, init)
            mods, originals = list(model.modules()), list(checkpoint.modules())
            try:
                if len(mods) != len(originals) or any(type(m) is not type(c) for m, c in zip(mods, originals)):
                    raise RuntimeError("the module trees differ")
                model.load_state_dict(checkpoint.state_dict())
            except RuntimeError:
                model = copy.deepcopy(checkpoint)
            for m in model.modules():
                for k, v in list(vars(m).items()):   # plain tensor attributes, which .to() leaves
                    if isinstance(v, torch.Tensor) and v.is_floating_point():
                        setattr(m, k, v.to(device=device, dtype=dtype))
            model = model.to(device=device, dtype=dtype)
            self.models[key] = model
        return self.models[key]

    def solution_model(self, dims: dict, device) -> torch.nn.Module:
        init_key, init = self._init(dims)
        key = (init_key, "new", str(device))
        if key not in self.models:
            ref_model = self._ref_cpu(dims)
            new = pair_module(self.pair, "new")
            with sized(new, own_constants(new, dims) if self.dims_in_models else {}), \
                    precision(PRECISION, self.flags_changed):
                set_seed(SEED)
                try:
                    model = new.ModelNew(*init)
                except Exception as e:
                    self.init_error = f"{type(e).__name__}: {e}"[:500]
                    raise
            if self.weights == "none":
                self.weights_status = "same seed"
                model = model.to(device).train(not self.pair.eval_mode)
            elif self.weights in ("reload", "lenient"):
                model = self._reloaded(model, dims, device, ref_model)
            else:
                self.weights_status = load_weights(model, ref_model, strict=self.weights == "strict")
                model = model.to(device).train(not self.pair.eval_mode)
            self.models[key] = model
        return self.models[key]

    def _reloaded(self, model: torch.nn.Module, dims: dict, device, checkpoint: torch.nn.Module) -> torch.nn.Module:
        """``weights="reload"``: the solution as the gates see it (``Model``'s weights of ``SEED``
        loaded), one forward at ``dims``, then ``checkpoint`` (``Model`` of ``RELOAD_SEED``) loaded
        into it, as a user loads a trained model into a module already in use; ``"lenient"``: the
        same, each load with ``strict=False`` (``load_shared``)."""
        def load(into, reference):
            return load_shared(into, reference) if self.weights == "lenient" else \
                load_weights(into, reference, strict=False)
        load(model, self._ref_cpu(dims, SEED))
        model = model.to(device).train(not self.pair.eval_mode)
        ref = pair_module(self.pair, "ref")
        with sized(ref, dims):
            set_seed(SEED)
            xs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in ref.get_inputs()]
        with torch.no_grad(), precision(PRECISION, self.flags_changed):
            model(*xs)
        self.weights_status = load(model, checkpoint)
        return model

    def structure(self, dims: dict) -> dict[str, tuple]:
        """What the reference's float inputs promise at ``dims`` beyond their values, seen in
        two draws of ``get_inputs``: positions always zero (a triangular matrix) and symmetry
        in the last two dims. Cases keep both, so a kernel may rely on them."""
        key = tuple(sorted(dims.items()))
        if key not in self.cache:
            ref = pair_module(self.pair, "ref")
            draws = []
            with sized(ref, dims):
                for s in (1, 2):
                    set_seed(s)
                    draws.append(ref.get_inputs())
            out = {}
            for i, n in enumerate(self.contract.arg_names):
                a, b = draws[0][i], draws[1][i]
                if self.contract.arg_dtypes[i] != "case" or n in self.contract.scalars:
                    continue
                zero = (a == 0) & (b == 0)
                sym = (a.dim() >= 2 and a.shape[-1] == a.shape[-2] and a.shape[-1] > 1
                       and torch.equal(a, a.transpose(-1, -2)) and torch.equal(b, b.transpose(-1, -2)))
                if zero.any() or sym:
                    out[n] = (zero if zero.any() else None, sym)
            self.cache[key] = out
        return self.cache[key]

    def outside(self, inputs: dict, dims: dict) -> str | None:
        """Why ``inputs`` (as a case lays them out) break the structure the reference's inputs
        promise (``structure``): a position always zero that is not, a symmetric input that is
        not; None where they keep it."""
        for n, (zero, sym) in self.structure(dims).items():
            x = inputs[n].detach().cpu().double()
            if zero is not None and bool((x[zero] != 0).any()):
                return f"{n!r} is nonzero where the reference's inputs are always zero (triangular)"
            if sym and not torch.equal(x, x.transpose(-1, -2)):
                return f"{n!r} is not symmetric, as the reference's inputs always are"
        return None

    def domain(self, drawn: dict, dims: dict, int_args: list[str]) -> dict:
        """kfuzz's draws kept in the reference's domain: its structure (``structure``), and
        integer inputs (indices, labels) as ``get_inputs`` draws them, seeded by the case's draw."""
        out = {}
        for n, (zero, sym) in self.structure(dims).items():
            x = drawn[n]
            if sym:
                x = (x + x.transpose(-1, -2)) / 2
            if zero is not None:
                x = x.masked_fill(zero, 0.0)
            out[n] = x
        if int_args:
            names = self.contract.arg_names
            seed = zlib.crc32(b"".join(drawn[n].numpy().tobytes()[:256] for n in names if n in drawn))
            ref = pair_module(self.pair, "ref")
            with sized(ref, dims):
                set_seed(seed)
                xs = ref.get_inputs()
            out.update({n: xs[names.index(n)].double() for n in int_args})
        return out

    def output_shapes(self, dims: dict) -> tuple[tuple, ...]:
        return tuple(s for s, _ in _output_specs(self, tuple(sorted(dims.items()))))

    def output_dtypes(self, dims: dict) -> tuple[str, ...]:
        return tuple(d for _, d in _output_specs(self, tuple(sorted(dims.items()))))


@lru_cache(maxsize=4096)
def _output_specs(bench: Bench, dims: tuple) -> tuple[tuple, ...]:
    """The reference's (shape, dtype) per output at ``dims`` (meta device; the CPU where meta
    is not enough)."""
    ref, d = pair_module(bench.pair, "ref"), dict(dims)
    outs = None
    try:
        with sized(ref, d), torch.device("meta"), torch.no_grad():
            set_seed(SEED)
            model = ref.Model(*ref.get_init_inputs()).train(not bench.pair.eval_mode)
            # recurrent layers decompose step by step on the meta device: a minute at 512 steps
            if not any(isinstance(m, torch.nn.RNNBase) for m in model.modules()):
                outs = outputs_of(model(*ref.get_inputs()))
    except Exception:
        pass
    if outs is None:
        with sized(ref, d), torch.no_grad():
            set_seed(SEED)
            model = bench.reference_model(d, torch.float32, bench.device)
            outs = outputs_of(model(*[x.to(bench.device) for x in ref.get_inputs()]))
    return tuple((tuple(o.shape), str(o.dtype).removeprefix("torch.")) for o in outs)


class KernelBenchTarget(Target):
    """A target whose output shapes are the reference's at the case's dims (``@i`` = output i)."""

    def shape_of(self, symbolic, dims):
        if len(symbolic) == 1 and isinstance(symbolic[0], str) and symbolic[0].startswith("@"):
            return self.options["bench"].output_shapes(dims)[int(symbolic[0][1:])]
        return super().shape_of(symbolic, dims)


def as_target(pair: KernelBenchPair, device: str = "cpu", weights: str = "strict",
              solution: bool = True) -> KernelBenchTarget:
    """The pair as a target for kfuzz's gates (see the module docstring). Runs the reference to
    learn its contract; runs ``custom_code`` only when the kernel is first called.
    ``device`` is where the kernel is meant to run (gates pass it on each call)."""
    contract = infer_contract(pair)
    bench = Bench(pair, contract, weights, device)
    names = contract.arg_names
    try:
        out_dtypes = bench.output_dtypes(dict(contract.dims))
    except Exception as e:
        raise KernelBenchError(f"{pair.name}: the reference does not run at its own sizes "
                               f"({type(e).__name__}: {str(e)[:300]})") from None

    def kernel(**inputs):
        if not solution:
            raise KernelBenchError(f"{pair.name}: this process is the oracle's; the solution runs only in "
                                   f"a sandboxed worker (kfuzz.executor.Sandboxed)")
        model = bench.solution_model(bench.dims_of(inputs), next(iter(inputs.values())).device)
        with torch.no_grad(), precision(PRECISION, bench.flags_changed):
            return outputs_of(model(*contract.passed(inputs)))

    def run_reference(inputs, dtype, where):
        dims = bench.dims_of(inputs)
        model = bench.reference_model(dims, dtype, where)
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)     # tensors made inside forward take the oracle's precision
        try:
            with torch.no_grad(), sized(pair_module(pair, "ref"), dims), precision(PRECISION, set()), \
                    (OracleDtype(dtype) if dtype == torch.float64 else contextlib.nullcontext()):
                return outputs_of(model(*contract.passed({n: v.to(where) for n, v in inputs.items()})))
        finally:
            torch.set_default_dtype(old)

    def reference(**inputs):
        first = next(iter(inputs.values()))
        dtype = next((v.dtype for v in inputs.values() if v.is_floating_point()), torch.float32)
        # the float64 oracle runs where the kernel runs: a level-3 network in float64 takes
        # a CPU core minutes; the precision is the same on either device
        where = torch.device(device) if dtype == torch.float64 else first.device
        try:
            outs = run_reference(inputs, dtype, where)
        except (RuntimeError, NotImplementedError):
            if where == first.device:
                raise
            outs = run_reference(inputs, dtype, first.device)   # an op with no float64 GPU kernel
        return tuple(o.to(first.device) for o in outs)

    int_args = [n for n, dt in zip(names, contract.arg_dtypes) if dt != "case"]

    def domain(drawn, dims):
        return bench.domain(drawn, dims, int_args)

    def constraint(dims):
        try:
            bench.output_shapes(dims)
        except Exception as e:
            return f"the reference refuses these sizes ({type(e).__name__}: {str(e)[:200]})"
        return None

    target = KernelBenchTarget(
        name=pair.target_name, kernel=kernel, reference=reference,
        args={n: Arg(shape=s, dtype=dt, differentiable=False)
              for n, s, dt in zip(names, contract.arg_shapes, contract.arg_dtypes)},
        outputs={f"out{i}" if len(out_dtypes) > 1 else "out": Output(shape=(f"@{i}",),
                                                               dtype="case" if dt == "float32" else dt)
                 for i, dt in enumerate(out_dtypes)},
        dims={d: Dim(1, v) for d, v in contract.dims.items()}, dtypes=("float32",),
        domain=domain, constraint=constraint,
        description=f"KernelBench level {pair.level} problem {pair.problem} ({pair.model})",
        options={"bench": bench, "device": device, "fixed": contract.fixed,
                 # what a sandboxed worker's resolver needs to build this target again (its
                 # weights, and the pair's hash, checked): `kfuzz verify` hands it to its workers
                 "resolve": {"weights": weights, "sha": pair.sha},
                 # G09 and G11 also at the reference's own sizes (where its test ran the kernel)
                 "own_dims": dict(contract.dims),
                 # G06: where the reference in float32 (the trusted run) is non-finite too, a
                 # kernel's non-finite output is the reference's limit, not a violation
                 "reference_limited": True,
                 # a layout or an injection that breaks the inputs' structure leaves the domain
                 "outside_domain": bench.outside,
                 # G07 applies where exactness is by construction: not through float weights
                 "no_exact_answers": FLOAT_WEIGHTS if float_weights(pair) else None})
    target.options["nominal"] = nominal(target)
    return target


def nominal(target: KernelBenchTarget) -> dict[str, int]:
    """kfuzz's nominal shape where the reference admits it, else the fixed shape divided by
    8, 4, 2 or 1 (the first the reference admits): a network needs inputs big enough."""
    from kfuzz.gates.base import inner_dims, fit_dims, NOMINAL, OUTER
    inner = inner_dims(target)
    wanted = {n: NOMINAL if n in inner else OUTER for n in target.dims}
    if fit_dims(target, wanted) is not None:
        return wanted
    for k in (8, 4, 2, 1):
        dims = {n: max(1, d.hi // k) for n, d in target.dims.items()}
        if target.constraint(dims) is None:
            return dims
    return {n: d.hi for n, d in target.dims.items()}


def resolve(name: str, weights: str = "strict", device: str = "cpu", standard: bool = False,
            prebuilt: bool = False, sha: str | None = None):
    """The target named ``kb:<corpus file>:<row>`` (how a sandboxed worker finds its pair), with
    ``weights`` as in ``as_target``. With ``standard``, only what the standard test and the build
    step need (``StandardOnly``: the pair, nothing run), so that a reference the adapter refuses
    still gets its standard test. With ``prebuilt``, the solution's extensions are loaded as the
    build step left them, never built here (``build.prebuilt_only``: a worker that may not start
    the compiler). With ``sha`` (a saved case's: the pair it was judged on), a row whose reference
    or solution is not that pair is refused: a corpus of the same name elsewhere may differ."""
    if not name.startswith(PREFIX) or ":" not in name[len(PREFIX):]:
        raise KernelBenchError(f"{name!r}: a KernelBench target is named kb:<corpus file>:<row>")
    path, row = name[len(PREFIX):].rsplit(":", 1)
    entry = read_row(path, row)
    if entry.pair is None:
        raise KernelBenchError(f"{name!r}: {entry.skip}")
    if sha is not None and entry.pair.sha != sha:
        raise KernelBenchError(f"{name!r}: the row's reference or solution is not the pair the case was judged on "
                               f"(hash {entry.pair.sha}, the case's {sha}): another corpus of that name")
    if prebuilt and compiles(entry.pair.custom_code):
        prebuilt_only()
    if standard:
        return StandardOnly(name, {"pair": entry.pair})
    return as_target(entry.pair, device, weights)


@dataclass(frozen=True)
class StandardOnly:
    """A KernelBench pair seen by a worker that runs only its standard test (the ``standard``
    kernel program): a name and the pair, no contract."""

    name: str
    options: dict

    @property
    def kernel(self):
        return None
