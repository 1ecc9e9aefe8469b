"""KernelBench pairs: the standard test that accepted them, and the same pair as a kfuzz target.

A KernelBench problem is a reference file (``Model``, ``get_inputs``,
``get_init_inputs`` and module-level size constants such as ``batch_size =
16``); a generated solution is a file defining ``ModelNew``, a drop-in
replacement for ``Model``. ``load_pair`` checks both sources' shape (without
running them), ``standard_test`` runs the check that accepted the solution
(same-seed models, 5 trials of fresh ``get_inputs()`` at the fixed shape, a
shape check, ``allclose(atol=1e-2, rtol=1e-2)``, both models in one process,
as the original harness ran them) and ``as_target`` makes the pair a target
that kfuzz's gates judge:

- the kernel is ``ModelNew``, the oracle the reference ``Model`` in float64
  and the trusted implementation the reference in float32, all three with
  the same weights: ``Model``'s, loaded into ``ModelNew`` strictly (a
  parameter missing or extra is a contract failure; renamed parameters of
  identical shapes in the same order are loaded by position), in the mode
  the accepting harness used (``eval_mode``: CUDA-L1's calls ``.eval()``,
  KernelBench's does not);
- the symbolic dims are the reference's integer size constants that size an
  input directly (found by parsing the source with ``ast``, and told apart by
  re-running ``get_inputs`` on the meta device with one constant changed at a
  time); each admits 1 up to its fixed value. A constant that sizes an input
  only through arithmetic stays fixed, and so do constants that size no input
  (they reach ``get_init_inputs`` only, and a kernel call cannot name them);
- inputs come from kfuzz's cases (distributions, special values, layouts),
  kept in the reference's domain where ``get_inputs`` shows one: positions
  that are always zero stay zero (triangular matrices), symmetric inputs stay
  symmetric, and integer inputs (indices, class labels) are drawn by
  ``get_inputs`` itself at the case's dims. Value ranges are not kept: that
  KernelBench draws ``torch.rand`` in [0, 1) is the weakness the gates probe.

Generated code is untrusted: nothing here runs ``custom_code`` except the
kernel half and ``standard_test``, which callers run in a sandboxed worker.
A worker finds a pair by its target name, ``kb:<corpus file>:<row>``
(``resolve``; ``kfuzz.target.get_target`` calls it for names starting ``kb:``).

Refuses (``KernelBenchError``): sources that do not parse or lack ``Model``,
``get_inputs``, ``get_init_inputs`` or ``ModelNew``; references whose inputs are
not tensors, or floating point other than float32.
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import hashlib
import inspect
import linecache
import math
import sys
import time
import types
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import torch

from kfuzz.contract import NamespaceSnapshot, current_hooks, restore_hooks
from kfuzz.errors import KfuzzError
from kfuzz.target import Arg, Dim, Output, Target

SEED = 42                 # the standard test's seed; the models' weights come from it
ATOL = RTOL = 1e-2
TRIALS = 5
PREFIX = "kb:"
MODEL_SETS = 2            # sets of models (distinct init inputs) kept per pair


class KernelBenchError(KfuzzError):
    """A KernelBench source the adapter cannot use; the message says which and why."""


class WeightsContractError(RuntimeError):
    """``ModelNew``'s parameters and buffers do not match ``Model``'s (raised in the kernel's call)."""


@dataclass(frozen=True)
class KernelBenchPair:
    """A reference and a generated solution, with where they came from."""

    name: str
    ref_code: str
    custom_code: str
    level: int | None = None
    problem: int | None = None
    model: str = ""              # the generating model
    source: str = ""             # "<corpus file>:<row>", how a worker finds the pair again
    eval_mode: bool = False      # the accepting harness put both models in eval mode (CUDA-L1 does,
                                 # KernelBench does not): BatchNorm's running statistics, no dropout

    @property
    def sha(self) -> str:
        return hashlib.sha256(f"{self.ref_code}\0{self.custom_code}".encode()).hexdigest()[:16]

    @property
    def custom_sha(self) -> str:
        """The solution's own hash: the compile cache's key."""
        return hashlib.sha256(self.custom_code.encode()).hexdigest()[:16]

    @property
    def target_name(self) -> str:
        return PREFIX + (self.source or self.name)


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _parse(code: str, what: str, name: str, needs: tuple[str, ...]) -> ast.Module:
    if not isinstance(code, str) or not code.strip():
        raise KernelBenchError(f"{name}: {what} is empty")
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        raise KernelBenchError(f"{name}: {what} does not parse (line {e.lineno}: {e.msg})") from None
    missing = [n for n in needs if n not in _top_level_names(tree)]
    if missing:
        raise KernelBenchError(f"{name}: {what} defines no {', '.join(missing)}")
    return tree


def load_pair(ref_code: str, custom_code: str, name: str, **meta) -> KernelBenchPair:
    """A pair from its two sources (checked by parsing only; nothing is run)."""
    _parse(ref_code, "the reference", name, ("Model", "get_inputs", "get_init_inputs"))
    _parse(custom_code, "the solution", name, ("ModelNew",))
    return KernelBenchPair(name=name, ref_code=ref_code, custom_code=custom_code, **meta)


def size_constants(ref_code: str) -> dict[str, int]:
    """The reference's module-level ``NAME = <positive int>`` assignments, in source order."""
    out = {}
    for node in ast.parse(ref_code).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            value = node.value
        else:
            continue
        name = node.targets[0].id if isinstance(node, ast.Assign) else node.target.id
        if isinstance(value, ast.Constant) and type(value.value) is int and value.value > 0:
            out[name] = value.value
        else:
            out.pop(name, None)      # reassigned to something else: not a size constant
    return out


# running the sources -------------------------------------------------------------------------

_MODULES: dict[tuple[str, str], types.ModuleType] = {}


def pair_module(pair: KernelBenchPair, role: str) -> types.ModuleType:
    """The reference (``role="ref"``) or the solution (``"new"``) executed as a module, once
    per process. Its filename, ``kb_<role>_<sha>.py``, names it in tracebacks and signatures."""
    key = (pair.sha, role)
    if key not in _MODULES:
        code = pair.ref_code if role == "ref" else pair.custom_code
        modname = f"kfuzz_kb_{role}_{pair.sha}"
        filename = f"kb_{role}_{pair.sha}.py"
        mod = types.ModuleType(modname)
        mod.__file__ = filename
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        sys.modules[modname] = mod       # dataclasses, pickling and inspect look a module up by name
        try:
            exec(compile(code, filename, "exec"), mod.__dict__)
        except BaseException:
            sys.modules.pop(modname, None)
            raise
        _MODULES[key] = mod
    return _MODULES[key]


@contextmanager
def sized(mod: types.ModuleType, values: dict[str, int]):
    """The module's size constants set to ``values`` for the duration."""
    old = {k: mod.__dict__[k] for k in values}
    mod.__dict__.update(values)
    try:
        yield
    finally:
        mod.__dict__.update(old)


def set_seed(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)


def _outputs(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


# the standard test ----------------------------------------------------------------------------

@dataclass(frozen=True)
class StandardVerdict:
    """The standard test's verdict: ``reason`` is ``pass`` or compile, init, runtime, shape,
    mismatch, with the detail after a colon."""

    passed: bool
    reason: str
    max_abs_diff: float | None = None    # NaN where an output holds NaN (allclose then fails)
    trials: int = 0
    seconds: float = 0.0
    undone: tuple[str, ...] = ()         # what the solution replaced in torch & co., restored after

    def to_json(self) -> dict:
        diff = self.max_abs_diff
        if diff is not None and not math.isfinite(diff):
            diff = str(diff)              # "nan", "inf": a bare NaN token is not JSON
        return {"passed": self.passed, "reason": self.reason[:500], "max_abs_diff": diff,
                "trials": self.trials, "seconds": round(self.seconds, 3), "undone": list(self.undone)}


def _max_abs_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest elementwise |got - expected|, NaN if either holds NaN where the other does
    not match it (Python's ``max`` would keep an earlier number over a NaN); equal infinities
    differ by 0, as ``allclose`` sees them."""
    g, e = got.detach().double(), expected.detach().double().to(got.device)
    diff = torch.where(g == e, 0.0, (g - e).abs())
    return float(diff.max()) if diff.numel() else 0.0


def _worse(a: float, b: float) -> float:
    return b if math.isnan(b) or b > a else a


def standard_test(pair: KernelBenchPair, device: str = "cpu", trials: int = TRIALS, atol: float = ATOL,
                  rtol: float = RTOL, seed: int = SEED) -> StandardVerdict:
    """The check that accepted the corpora's kernels, run in this process (untrusted code!).
    Its verdict is the original harness's, fooled as it would be by a solution that patches
    ``torch.allclose``; what the solution replaced in the watched namespaces (and any trace,
    profile or signal hook it left) is put back before returning, so later judgements in this
    process see the real torch, and ``undone`` names it."""
    namespaces, hooks = NamespaceSnapshot(), current_hooks()
    try:
        verdict = _standard_test(pair, device, trials, atol, rtol, seed)
    finally:
        undone = tuple(namespaces.undo() + restore_hooks(hooks))
    return dataclasses.replace(verdict, undone=undone)


def _standard_test(pair: KernelBenchPair, device: str, trials: int, atol: float, rtol: float,
                   seed: int) -> StandardVerdict:
    start = time.monotonic()

    def verdict(passed, reason, diff=None, n=0):
        return StandardVerdict(passed, reason, diff, n, time.monotonic() - start)
    try:
        ref, new = pair_module(pair, "ref"), pair_module(pair, "new")
    except Exception as e:
        return verdict(False, f"compile: {type(e).__name__}: {e}")
    try:
        with torch.no_grad():
            set_seed(seed)
            init = ref.get_init_inputs()
            set_seed(seed)
            model = ref.Model(*init).to(device).train(not pair.eval_mode)
            set_seed(seed)
            model_new = new.ModelNew(*init).to(device).train(not pair.eval_mode)
            set_seed(seed)
            trial_seeds = [int(torch.randint(0, 2**32 - 1, (1,)).item()) for _ in range(trials)]
    except Exception as e:
        return verdict(False, f"init: {type(e).__name__}: {e}")
    worst = 0.0
    for n, trial_seed in enumerate(trial_seeds):
        with torch.no_grad():
            set_seed(trial_seed)
            inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in ref.get_inputs()]
            set_seed(trial_seed)
            expected = _outputs(model(*inputs))
            try:
                set_seed(trial_seed)
                got = _outputs(model_new(*inputs))
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
            except Exception as e:
                return verdict(False, f"runtime: {type(e).__name__}: {e}", None, n + 1)
        if len(got) != len(expected) or any(
                not isinstance(g, torch.Tensor) or g.shape != e.shape for g, e in zip(got, expected)):
            return verdict(False, "shape: the outputs' shapes differ from the reference's", None, n + 1)
        for g, e in zip(got, expected):
            worst = _worse(worst, _max_abs_diff(g, e))
            # the verdict is exactly the original harness's: torch.allclose as it is bound now
            if not torch.allclose(g, e.to(g.device, g.dtype), atol=atol, rtol=rtol):
                return verdict(False, f"mismatch: max abs diff {worst:.3g} in trial {n + 1}", worst, n + 1)
    return verdict(True, "pass", worst, len(trial_seeds))


# the pair as a target ----------------------------------------------------------------------------

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


def infer_contract(pair: KernelBenchPair) -> Contract:
    """Probe the reference (on the meta device) for its inputs' symbolic shapes."""
    ref = pair_module(pair, "ref")
    base_values = size_constants(pair.ref_code)
    try:
        base = _meta_inputs(ref, {})
    except Exception as e:
        raise KernelBenchError(f"{pair.name}: get_inputs() fails on the meta device ({type(e).__name__}: {e})") from None
    for i, x in enumerate(base):
        if not isinstance(x, torch.Tensor):
            raise KernelBenchError(f"{pair.name}: get_inputs() item {i} is a {type(x).__name__}, not a tensor")
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
            shapes = [tuple(x.shape) for x in _meta_inputs(ref, {const: probe})]
        except Exception:
            fixed.add(const)
            continue
        for i, (x, s) in enumerate(zip(base, shapes)):
            for axis, (a, b) in enumerate(zip(x.shape, s)):
                if a == b:
                    continue
                if a == value and b == probe and (i, axis) not in owner:
                    owner[(i, axis)] = const
                else:
                    fixed.add(const)
            if len(s) != x.dim():
                fixed.add(const)
    owner = {k: c for k, c in owner.items() if c not in fixed}
    free = {c: base_values[c] for c in base_values if c in set(owner.values())}
    shapes = tuple(tuple(owner.get((i, a), n) for a, n in enumerate(x.shape)) for i, x in enumerate(base))
    dtypes = tuple("case" if x.dtype.is_floating_point else str(x.dtype).removeprefix("torch.") for x in base)
    return Contract(tuple(names), shapes, dtypes, free, tuple(sorted(set(base_values) - set(free))))


class Bench:
    """One pair's models at each shape, in this process: the reference (float32 and float64) and,
    on first use, the solution, all with the reference's weights."""

    def __init__(self, pair: KernelBenchPair, contract: Contract, weights: str = "strict", device: str = "cpu"):
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
            self.inits[d] = (repr(init), init)
        key, init = self.inits[d]
        keys = list(dict.fromkeys(k[0] for k in self.models))
        if key not in keys and len(keys) >= MODEL_SETS:
            for k in [k for k in self.models if k[0] == keys[0]]:
                del self.models[k]
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return key, init

    def _ref_cpu(self, dims: dict) -> torch.nn.Module:
        key, init = self._init(dims)
        if (key, "ref") not in self.models:
            set_seed(SEED)
            self.models[(key, "ref")] = pair_module(self.pair, "ref").Model(*init).train(not self.pair.eval_mode)
        return self.models[(key, "ref")]

    def reference_model(self, dims: dict, dtype: torch.dtype, device) -> torch.nn.Module:
        key = (self._init(dims)[0], "ref", dtype, str(device))
        if key not in self.models:
            model = copy.deepcopy(self._ref_cpu(dims)).to(device=device, dtype=dtype)
            for m in model.modules():     # plain tensor attributes (an LSTM's h0) too
                for k, v in list(vars(m).items()):
                    if isinstance(v, torch.Tensor) and v.is_floating_point():
                        setattr(m, k, v.to(device=device, dtype=dtype))
            self.models[key] = model
        return self.models[key]

    def solution_model(self, dims: dict, device) -> torch.nn.Module:
        init_key, init = self._init(dims)
        key = (init_key, "new", str(device))
        if key not in self.models:
            ref_model = self._ref_cpu(dims)
            set_seed(SEED)
            model = pair_module(self.pair, "new").ModelNew(*init)
            self.weights_status = load_weights(model, ref_model, strict=self.weights == "strict")
            self.models[key] = model.to(device).train(not self.pair.eval_mode)
        return self.models[key]

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
                if self.contract.arg_dtypes[i] != "case":
                    continue
                zero = (a == 0) & (b == 0)
                sym = (a.dim() >= 2 and a.shape[-1] == a.shape[-2] and a.shape[-1] > 1
                       and torch.equal(a, a.transpose(-1, -2)) and torch.equal(b, b.transpose(-1, -2)))
                if zero.any() or sym:
                    out[n] = (zero if zero.any() else None, sym)
            self.cache[key] = out
        return self.cache[key]

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
                outs = _outputs(model(*ref.get_inputs()))
    except Exception:
        pass
    if outs is None:
        with sized(ref, d), torch.no_grad():
            set_seed(SEED)
            model = bench.reference_model(d, torch.float32, bench.device)
            outs = _outputs(model(*[x.to(bench.device) for x in ref.get_inputs()]))
    return tuple((tuple(o.shape), str(o.dtype).removeprefix("torch.")) for o in outs)


def load_weights(model: torch.nn.Module, reference: torch.nn.Module, strict: bool = True) -> str:
    """Load ``reference``'s parameters and buffers into ``model``: ``exact`` (same names), ``by
    position`` (renamed, same shapes in order), or, when ``strict`` is False, ``seed only`` (the
    same-seed construction stays). A parameter missing or extra raises WeightsContractError."""
    want, have = reference.state_dict(), model.state_dict()
    detail = None
    try:
        if set(want) == set(have) and all(want[k].shape == have[k].shape for k in want):
            model.load_state_dict(want, strict=True)
            return "exact"
        if [v.shape for v in want.values()] == [v.shape for v in have.values()]:
            model.load_state_dict(dict(zip(have, want.values())), strict=True)
            return "by position"
    except RuntimeError as e:       # a custom load_state_dict hook that refuses
        detail = f"ModelNew refuses Model's state_dict ({str(e)[:300]})"
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    detail = detail or (f"ModelNew's state_dict does not match Model's: missing {missing[:6]}, extra {extra[:6]}"
                        if missing or extra else "ModelNew's state_dict has the same names with other shapes")
    if strict:
        raise WeightsContractError(detail)
    return f"seed only ({detail})"


class KernelBenchTarget(Target):
    """A target whose output shapes are the reference's at the case's dims (``@i`` = output i)."""

    def shape_of(self, symbolic, dims):
        if len(symbolic) == 1 and isinstance(symbolic[0], str) and symbolic[0].startswith("@"):
            return self.options["bench"].output_shapes(dims)[int(symbolic[0][1:])]
        return super().shape_of(symbolic, dims)


def as_target(pair: KernelBenchPair, device: str = "cpu", weights: str = "strict") -> KernelBenchTarget:
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
        model = bench.solution_model(bench.dims_of(inputs), next(iter(inputs.values())).device)
        with torch.no_grad():
            return _outputs(model(*[inputs[n] for n in names]))

    def run_reference(inputs, dtype, where):
        model = bench.reference_model(bench.dims_of(inputs), dtype, where)
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)     # tensors made inside forward take the oracle's precision
        try:
            with torch.no_grad():
                return _outputs(model(*[inputs[n].to(where) for n in names]))
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
        options={"bench": bench, "device": device, "fixed": contract.fixed})
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


# finding a pair by name ---------------------------------------------------------------------------

def resolve(name: str) -> Target:
    """The target named ``kb:<corpus file>:<row>`` (how a sandboxed worker finds its pair)."""
    from kfuzz.audit import read_row
    if not name.startswith(PREFIX) or ":" not in name[len(PREFIX):]:
        raise KernelBenchError(f"{name!r}: a KernelBench target is named kb:<corpus file>:<row>")
    path, row = name[len(PREFIX):].rsplit(":", 1)
    entry = read_row(path, row)
    if entry.pair is None:
        raise KernelBenchError(f"{name!r}: {entry.skip}")
    return as_target(entry.pair)
