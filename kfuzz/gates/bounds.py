"""The gates that judge output values within the error bound: G01-G04.

G01 reference (the nominal shape, fresh seeds, every dtype, and inputs from a seed the
kernel cannot see), G02 distributions, G03 shapes, G04 layouts. Each builds its cases from
the target's contract and a seed and judges the kernel's outputs by the error bound of
``kfuzz.compare`` against the float64 oracle (``kfuzz.execute.judge``). Here too are what
every value gate shares: the one call of a case, with none where its inputs leave the
reference's domain (``kernel_outputs``), and the cases drawn from one distribution
(``distribution_cases``). The tolerance-free value gates are ``kfuzz.gates.nonfinite``
(G05, G06) and ``kfuzz.gates.accumulation`` (G07).

Refuses nothing itself: a case that breaks the contract is a ``CaseError``.
"""
from __future__ import annotations

import secrets

from kfuzz.case import ArgCase, Case, Dist, Layout
from kfuzz.compare import BOUND_C
from kfuzz.errors import CaseError
from kfuzz.execute import judge
from kfuzz.executor import executor_for
from kfuzz.gates.base import Gate, fit_dims, float_args, gate_seed, make_case, nominal_dims
from kfuzz.programs import Program, called
from kfuzz.tensors import case_from_tensors, lay_out, logical_values, materialize
from kfuzz.verdict import Verdict

SEEDS_PER_DTYPE = 4
# G03: 1, small primes, neighbours of powers of two (tails of block sizes), the contract's ends
EDGE_SIZES = (1, 2, 3, 5, 7, 13, 17, 31, 33, 63, 65, 97, 100, 127, 129, 257, 1000)
SHAPE_CAP = 1024      # G03/G07 sizes stop here: the Triton interpreter is slow on the CPU
# uniform01: the range of torch.rand, where a kernel may special-case the inputs a test draws
WIDE = Dist("scaled", (("factor", 100.0),))   # G02's widest draw; G04's second draw of a layout
G02_DISTS = (WIDE, Dist("scaled", (("factor", 0.01),)),
             Dist("shifted", (("shift", 5.0),)), Dist("heavytailed"), Dist("ones"), Dist("uniform01"))


def outside_domain(target, case, inputs) -> Verdict | None:
    """A pass saying so when the case's inputs (as laid out and injected) leave what the
    reference's inputs promise beyond their values (``options["outside_domain"]``: a function of
    the inputs and dims giving why, or None): an expanded layout that repeats one row of a
    triangular or symmetric matrix, a NaN where the matrix is always zero. None otherwise."""
    check = target.options.get("outside_domain")
    why = check(inputs, case.dim) if check is not None else None
    return None if why is None else Verdict(target.name, "pass", detail=f"outside the reference's domain: {why}")


def _all_float(target, dtype, argcase: ArgCase) -> dict:
    return {name: argcase for name in float_args(target, dtype)}


def kernel_outputs(target, case, executor, inputs=None):
    """(kfuzz's inputs, the kernel's outputs on them or None, the verdict that ends the case):
    the case materialized here (on the CPU) unless ``inputs`` are given, then one call; no call
    where the inputs leave the reference's domain (``outside_domain``'s pass ends the case: an
    injection, a layout or a draw of any gate)."""
    inputs = materialize(case, target) if inputs is None else inputs
    outside = outside_domain(target, case, inputs)
    if outside is not None:
        return inputs, None, outside
    outputs, verdict = called(executor, target, case, inputs)
    return inputs, outputs, verdict


def bound_check(target, case, executor, c, device="cpu") -> Verdict:
    """One call, judged with the oracle and the trusted implementation run on ``device``, where
    the kernel ran (``execute.judge``; its comparison where ``execute.comparison_device`` says)."""
    inputs, outputs, verdict = kernel_outputs(target, case, executor)
    return verdict if verdict is not None else judge(case, target, inputs, outputs, device, c)


def hidden_seed_check(target, case, executor, c, device="cpu"):
    """``case``'s shape and dtype, with values drawn from a seed that exists nowhere the kernel
    could look: made from the OS's randomness, used once to materialize and dropped before
    the call. A kernel that finds the case it is called for (through the call stack or the
    garbage collector) and predicts its inputs from the seed, so as to be right only on the
    inputs a test would draw, is wrong here. A failure comes back as (case, verdict), the
    case's payload holding these inputs, so it can be saved and replayed."""
    inputs = materialize(case.with_(seed=secrets.randbits(32)), target)
    inputs, outputs, verdict = kernel_outputs(target, case, executor, inputs)
    if verdict is None:
        verdict = judge(case, target, inputs, outputs, device, c)
    if verdict.passed:
        return verdict
    try:
        found = case_from_tensors(target, {k: v.cpu() for k, v in inputs.items()}, "hidden-seed inputs")
        detail = f"on inputs from a seed hidden from the kernel (the case's payload holds them): {verdict.detail}"
    except CaseError as e:      # a contract no payload can describe: the verdict stands, unreplayable
        found = case
        detail = f"on inputs from a seed hidden from the kernel (not saved: {e}): {verdict.detail}"
    return found, Verdict(verdict.target, verdict.kind, verdict.output, detail, verdict.exc_type, verdict.frame,
                          verdict.ratio, verdict.metrics)


class Reference(Gate):
    id, name, tolerance_free = "G01", "reference", False
    property = ("within the bound at the nominal shape, over fresh seeds, in every dtype, and on inputs "
                "from a seed the kernel cannot see")

    def __init__(self):
        self.hidden: set[Case] = set()    # the cases that stand for inputs from a hidden seed

    def cases(self, target, seed):
        dims = nominal_dims(target)
        for j, dtype in enumerate(target.dtypes):
            for i in range(SEEDS_PER_DTYPE):
                yield make_case(target, dtype, gate_seed(seed, self.id, j * 100 + i), dims)
        if type(self) is Reference:
            for j, dtype in enumerate(target.dtypes):
                case = make_case(target, dtype, gate_seed(seed, self.id + "-hidden", j), dims)
                self.hidden.add(case)
                yield case

    def check(self, target, case, device="cpu", c=BOUND_C, executor=None):
        executor = executor_for(target, device, executor)
        if case in self.hidden:
            return hidden_seed_check(target, case, executor, c, device)
        return bound_check(target, case, executor, c, device)


def distribution_cases(target, seed, gate_id, dims, dists):
    """One case per dtype and distribution, every float argument drawn from it."""
    i = 0
    for dtype in target.dtypes:
        for dist in dists:
            yield make_case(target, dtype, gate_seed(seed, gate_id, i), dims,
                            _all_float(target, dtype, ArgCase(dist=dist)))
            i += 1


class Distributions(Reference):
    id, name = "G02", "distributions"
    property = ("within the bound under scaled x1e2 and x1e-2, shifted +5, heavy-tailed, all-equal and "
                "uniform [0, 1) values")

    def cases(self, target, seed):
        return distribution_cases(target, seed, self.id, nominal_dims(target), G02_DISTS)


def shape_sweep(target) -> list[dict[str, int]]:
    """One dim at a time over the edge sizes (others nominal), then every dim at its
    smallest and every dim at an odd prime; never the nominal shape itself."""
    nominal = nominal_dims(target)
    shapes, seen = [], {tuple(sorted(nominal.items()))}
    def add(wanted):
        dims = fit_dims(target, wanted)
        if dims is not None and tuple(sorted(dims.items())) not in seen:
            seen.add(tuple(sorted(dims.items())))
            shapes.append(dims)
    for name, d in target.dims.items():
        for n in sorted(set(EDGE_SIZES) | {d.lo, min(d.hi, SHAPE_CAP)}):
            if n <= min(d.hi, SHAPE_CAP) and d.admits(n):
                add({**nominal, name: n})
    add({name: d.lo for name, d in target.dims.items()})
    add({name: 13 for name in target.dims})
    return shapes


class Shapes(Reference):
    id, name = "G03", "shapes"
    property = "within the bound at 1, primes, non-multiples of block sizes, tails and the contract's ends"

    def cases(self, target, seed):
        for i, dims in enumerate(shape_sweep(target)):
            dtype = target.dtypes[i % len(target.dtypes)]
            yield make_case(target, dtype, gate_seed(seed, self.id, i), dims)


def layout_variants(shape: tuple[int, ...]) -> list[Layout]:
    rank = len(shape)
    if rank == 0:
        return []
    out = [Layout("strided", step=(2,) * rank), Layout("offset", offset=3),
           Layout("expanded", dims=(0,))]
    if rank >= 2:
        out.insert(0, Layout("permuted", perm=tuple(reversed(range(rank)))))
    return out


class Layouts(Reference):
    id, name = "G04", "layouts"
    property = ("non-contiguous, transposed, offset and expanded inputs the contract admits are within "
                "the bound; layouts it refuses raise a clear error")

    def cases(self, target, seed):
        dims = nominal_dims(target)
        i = 0
        for name, arg in target.args.items():
            shape = target.shape_of(arg.shape, dims)
            variants = layout_variants(shape)
            for layout in variants:
                dtype = target.dtypes[i % len(target.dtypes)]
                case = Case.make(target.name, dtype, gate_seed(seed, self.id, i), dims,
                                 {name: ArgCase(layout=layout)})
                i += 1
                if layout.kind in arg.layouts:
                    target.validate(case)
                yield case
            # the first admitted layout again, every float argument drawn at 100 times the
            # spread: outputs that the nominal draw leaves nearly constant (a ReLU after a
            # negative bias) show where a kernel reads the layout wrong
            admitted = [v for v in variants if v.kind in arg.layouts and v.kind != "expanded"]
            dtype = target.dtypes[i % len(target.dtypes)]
            if admitted and name in float_args(target, dtype):
                spread = {n: ArgCase(dist=WIDE) for n in float_args(target, dtype)}
                spread[name] = ArgCase(layout=admitted[0], dist=WIDE)
                yield make_case(target, dtype, gate_seed(seed, self.id, i), dims, spread)
                i += 1

    def not_applicable(self, target, executor=None):
        dims = nominal_dims(target)
        if not any(layout_variants(target.shape_of(a.shape, dims)) for a in target.args.values()):
            return "no argument has a dimension, so there is no layout to vary"
        return None

    def check(self, target, case, device="cpu", c=BOUND_C, executor=None):
        executor = executor_for(target, device, executor)
        refused = [(n, a.layout.kind) for n, a in case.args if a.layout.kind not in target.args[n].layouts]
        if not refused:
            inputs, outputs, verdict = kernel_outputs(target, case, executor)
            if verdict is not None:
                return verdict
            verdict = judge(case, target, inputs, outputs, device, c)
            if not verdict.passed and any(a.dist == WIDE for _, a in case.args):
                # a wide draw judges the layout, not the values: the same values laid out
                # contiguously must pass for the failure to be the layout's (else G02's)
                flat = case.with_(args={n: ArgCase(dist=a.dist, inject=a.inject) for n, a in case.args})
                twin = bound_check(target, flat, executor, c, device)
                if not twin.passed:
                    return Verdict(target.name, "pass", detail=(
                        f"outside the layouts: the same values laid out contiguously fail too "
                        f"({twin.kind}: {(twin.detail or '')[:160]}), a finding of the values' gate (G02)"))
            return verdict
        # a refused layout: build the tensors by hand (materialize would refuse) and demand an error
        values = logical_values(case, target)
        inputs = {n: lay_out(v, case.arg(n).layout) for n, v in values.items()}
        r = executor.run(Program("call", case, {"case": inputs}))
        verdict = r.verdict
        if verdict is not None and verdict.kind == "exception":
            return Verdict(target.name, "pass", detail=f"refused layout raised {verdict.detail[:200]}")
        if verdict is not None:
            return verdict
        name, kind = refused[0]
        return Verdict(target.name, "contract", output=name,
                       detail=f"accepted a {kind} layout for {name!r} that its contract refuses, without an error")
