"""The gates that judge output values: G01-G07.

G01-G04 (reference, distributions, shapes, layouts) judge by the error bound of
``kfuzz.compare`` (``kfuzz.execute.judge``); G05-G07 are tolerance-free:
nonfinite sets exact, finiteness where the oracle is finite, exact answers bit
for bit. Each builds its cases from the target's contract and a seed. G05 and
G06 put one special value into one argument at a time (``kfuzz.gates.specials``);
G07 adds totals past fp16's integer range where the contract admits them.

Refuses nothing itself: a case that breaks the contract is a ``CaseError``.
"""
from __future__ import annotations

import secrets

import torch

from kfuzz.case import ArgCase, Case, Dist, Layout
from kfuzz.compare import BOUND_C, all_finite, compare, kinds
from kfuzz.dtypes import special_value_table, torch_dtype, widen_float8
from kfuzz.errors import CaseError
from kfuzz.execute import comparison_device, flush_subnormals, judge, oracle_outputs, trusted_outputs
from kfuzz.executor import executor_for
from kfuzz.gates.base import (Gate, fit_dims, float_args, gate_seed, inner_dims, make_case,
                              nominal_dims)
from kfuzz.gates.specials import (SINGLE_CASES, describe_injection, extreme_value, nonfinite_value,
                                  single_case_args, single_injections)
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
G07_DISTS = (Dist("ones"), Dist("binary01"), Dist("smallint"))
FP16_INTEGERS = 2048  # fp16 holds every integer up to 2^11 and not all beyond
LONG_CAP = 4095       # G07's long totals: up to the largest odd size below 4096
ROW_STARTS = 64       # G07: rows whose first element is raised, per argument


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
            try:
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
            except Exception as e:
                if not target.options.get("reference_limited"):
                    raise
                # the reference itself refuses this layout (a .view() of a permuted input): the
                # case is outside the contract its reference defines, not a failure of kfuzz
                return Verdict(target.name, "pass", detail=f"outside the contract: the reference raises "
                                                           f"{type(e).__name__} on this layout ({str(e)[:200]})")
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


class Nonfinite(Gate):
    id, name = "G05", "nonfinite"
    property = ("one NaN, +Inf or -Inf in one argument at a time (first, middle and last index of every dim), "
                "and every special in every argument at once: the kernel's NaN set and Inf sets equal the "
                "oracle's exactly")

    def cases(self, target, seed):
        dims = nominal_dims(target)
        i = 0
        for dtype in target.dtypes:
            names = float_args(target, dtype)
            for name, flat, value in single_injections(target, dtype, dims, names, ("nan", "inf", "-inf"),
                                                       lambda table, v, dt: nonfinite_value(table, v)):
                yield make_case(target, dtype, gate_seed(seed, self.id, i), dims, single_case_args(name, flat, value))
                i += 1
            # every special in every argument at once
            specials = [s for s in ("nan", "inf", "-inf") if special_value_table(dtype)[s] is not None]
            args = {}
            for name in names:
                table = special_value_table(target.arg_dtype(name, dtype))
                values = [s for s in specials if table[s] is not None]
                size = target.numel(name, dims)
                step = max(1, size // (len(values) + 1))
                args[name] = ArgCase(inject=tuple(((k + 1) * step % size, v) for k, v in enumerate(values)))
            yield make_case(target, dtype, gate_seed(seed, self.id, i), dims, args)
            i += 1

    def check(self, target, case, device="cpu", c=BOUND_C, executor=None):
        inputs, outputs, verdict = kernel_outputs(target, case, executor_for(target, device, executor))
        if verdict is not None:
            return verdict
        oracle = oracle_outputs(target, inputs, device)
        where = comparison_device(oracle, device)
        excused = limited = 0
        for name, out in outputs.items():
            dtype, bound = target.output_dtype(name, case.dtype), c * target.bound_scale
            f = compare(out, oracle[name], None, dtype, bound, values=False, device=where)
            without = None
            if f.kind == "nonfinite" and target.options.get("reference_limited"):
                # the reference's own math may spread a NaN through exact zeros (0 x NaN in a dense
                # product): positions whose oracle value does not depend on the injected values are
                # judged on the value they take without them
                without = value_without_injection(target, case, inputs, name, device)
                judged = oracle[name].cpu()
                if without is not None:
                    spread = torch.isnan(judged) & ~torch.isnan(out.detach().cpu().double()) & without[1]
                    if spread.any():
                        judged = torch.where(spread, without[0], judged)
                        f = compare(out, judged, None, dtype, bound, values=False, device=where)
                        excused += int(spread.sum()) if f.kind != "nonfinite" else 0
                if f.kind == "nonfinite":
                    # where the reference in float32 takes the kernel's class (NaN, +Inf, -Inf or
                    # finite) and the float64 oracle another (torch's float32 conv3d on the CPU
                    # turns one Inf into NaN where float64's stays finite), float32 by the
                    # reference's own math does no better: judged against it there
                    # (reference-limited)
                    differ = _class_differences(out, judged, dtype)[2]
                    t = trusted_outputs(target, case, inputs, device)[name].detach().cpu().double()
                    same = differ & (kinds(t) == kinds(out.detach().cpu().double()))
                    if same.any():
                        f = compare(out, torch.where(same, t, judged.double()), None, dtype, bound, values=False,
                                    device=where)
                        limited += int(same.sum()) if f.kind != "nonfinite" else 0
            if f.kind == "nonfinite":
                facts = {"kinds_only": float(kinds_only(out, oracle[name], dtype))}
                if without is not None:
                    facts["where_ignored"] = float(nonfinite_where_ignored(out, oracle[name], dtype, without[1]))
                return Verdict(target.name, "nonfinite", output=name, ratio=f.ratio,
                               detail=f"{describe_injection(target, case)}: {f.detail}", metrics=facts)
        if limited:
            return Verdict(target.name, "pass", detail=(
                f"reference-limited: {limited} position(s) where the kernel's NaN/Inf set differs from the "
                f"oracle's and the reference in float32 takes the kernel's class"
                + (f"; {excused} more where the oracle's NaN does not depend on the injected value" if excused else "")))
        if excused:
            return Verdict(target.name, "pass", detail=(
                f"{excused} position(s) where the oracle is NaN and the kernel finite do not depend on the "
                f"injected value (the reference spreads it through exact zeros or an op whose finite result ignores it): judged without it"))
        return Verdict(target.name, "pass")


def _class_differences(out, oracle, dtype: str):
    """(the kernel's ``out``, the ``oracle`` rounded to ``dtype``, both float64 on the CPU, and
    where their NaN/+Inf/-Inf sets differ)."""
    k = out.detach().cpu().double()
    o = oracle.detach().cpu().to(torch_dtype(dtype)).double()
    return k, o, kinds(k) != kinds(o)


def kinds_only(out, oracle, dtype: str) -> bool:
    """Whether the kernel's ``out`` and the ``oracle`` (rounded to ``dtype``) differ only in the
    kind of non-finite value: both non-finite wherever their NaN/+Inf/-Inf sets differ (an
    algebraic rewrite, x sum(W) for sum(x W^T), gives an Inf where the reference's inf - inf
    gives NaN). The audit's report counts such kernels as a class of their own."""
    k, o, differ = _class_differences(out, oracle, dtype)
    return bool(differ.any()) and bool((~torch.isfinite(k[differ]) & ~torch.isfinite(o[differ])).all())


def nonfinite_where_ignored(out, oracle, dtype: str, ignored) -> bool:
    """Whether the kernel's ``out`` differs from the finite ``oracle`` only by non-finite values
    at positions whose oracle value ignores the injected specials (``ignored``, from
    ``value_without_injection``): a kernel that relies on the inputs' structure instead of the
    reference's mask (a NaN on the diagonal of a triangular input reaching the positions
    ``triu`` sets to 0) spreads it there. The audit's report counts such kernels as a class of
    their own."""
    k, o, differ = _class_differences(out, oracle, dtype)
    return bool(differ.any()) and bool((ignored.cpu()[differ] & ~torch.isfinite(k[differ])
                                        & torch.isfinite(o[differ])).all())


# rule of G05 on reference-limited targets: injected specials replaced by these to see what an
# output depends on (large and of both signs, so that a max, a sort or a clamp shows it too)
FINITE_STANDINS = (1000.0, -1000.0)


def value_without_injection(target, case, inputs, output: str, device="cpu"):
    """The oracle's ``output`` where exact zeros are honoured: at each position, the injected
    specials it does not depend on (an injection ``k`` is a dependence where changing ``k``
    alone between the two ``FINITE_STANDINS``, all others at the first, changes the value) are
    replaced by a finite stand-in and those it depends on kept. Returns (values, mask of the
    positions that depend on fewer injections than the case holds); None when it injects nothing."""
    injected = [(n, flat) for n, a in case.args for flat, _ in a.inject]
    if not injected:
        return None
    first, second = FINITE_STANDINS

    def run(standins: dict) -> torch.Tensor:
        changed = dict(inputs)
        for n in {n for n, _ in standins}:
            x = inputs[n].detach().clone().contiguous()
            for (m, flat), v in standins.items():
                if m == n:
                    x.view(-1)[flat] = v
            changed[n] = x
        return oracle_outputs(target, changed, device)[output].cpu()

    base = run({k: first for k in injected})
    pattern = torch.zeros(base.shape, dtype=torch.int64)
    for i, k in enumerate(injected):
        moved = run({**{j: first for j in injected}, k: second})
        depends = ~((base == moved) & torch.isfinite(base))
        pattern |= depends.to(torch.int64) << i
    values = base.clone()
    for code in pattern.unique().tolist():
        if code:
            kept = {k for i, k in enumerate(injected) if code >> i & 1}
            at = pattern == code
            values[at] = run({k: first for k in injected if k not in kept})[at]
    return values, pattern != (1 << len(injected)) - 1


def _finite_where_oracle_finite(out, oracle, dtype: str):
    """Positions where the oracle, rounded to ``dtype``, is finite (off the overflow edge)
    and the kernel is not; None if there are none."""
    if all_finite(out):
        return None
    dt = torch_dtype(dtype)
    fi = torch.finfo(dt)
    o = oracle.detach().cpu().double()
    edge = o.abs() / float(fi.max)
    at_max = (edge >= 1 - 4 * float(fi.eps)) & (edge <= 1 + 4 * float(fi.eps))
    clear = torch.isfinite(widen_float8(o.to(dt))) & ~at_max
    bad = clear & ~torch.isfinite(out.detach().cpu().double())
    return bad if bad.any() else None


class Range(Gate):
    id, name = "G06", "range"
    property = ("inputs near the dtype's largest and smallest magnitudes (each argument scaled, and one max, tiny "
                "or subnormal in one argument at a time at the first, middle and last index of every dim): "
                "where the oracle is finite, so is the kernel")

    def cases(self, target, seed):
        dims = nominal_dims(target)
        biggest = max(dims.values(), default=1)   # a target without dims (fixed-size inputs)
        i = 0
        for dtype in target.dtypes:
            table = special_value_table(dtype)
            # as large as the dtype allows while a sum over any one dim stays representable
            big = table["max"] / (16 * biggest)
            small = table["tiny"] * 4
            names = float_args(target, dtype)
            plans = []
            for name in names:
                plans += [{name: ArgCase(dist=Dist("scaled", (("factor", big),)))},
                          {name: ArgCase(dist=Dist("scaled", (("factor", small),)))},
                          {name: ArgCase(dist=Dist("subnormal"))}]
            for plan in plans:
                yield make_case(target, dtype, gate_seed(seed, self.id, i), dims, plan)
                i += 1
            # one value at a time in one argument: two extremes whose huge products cancel
            # (max*b - max*c) overflow any honest fp32 total though the exact answer is finite
            for name, flat, value in single_injections(target, dtype, dims, names, ("max", "tiny", "subnormal"),
                                                       extreme_value, max(len(names), SINGLE_CASES + 1 - len(plans))):
                yield make_case(target, dtype, gate_seed(seed, self.id, i), dims, single_case_args(name, flat, value))
                i += 1

    def check(self, target, case, device="cpu", c=BOUND_C, executor=None):
        inputs, outputs, verdict = kernel_outputs(target, case, executor_for(target, device, executor))
        if verdict is not None:
            return verdict
        oracle = oracle_outputs(target, inputs, device)
        flushed = flush_subnormals(inputs)
        limited = 0
        for name, out in outputs.items():
            dtype = target.output_dtype(name, case.dtype)
            bad = _finite_where_oracle_finite(out, oracle[name], dtype)
            if bad is not None and flushed is not None:
                # flush-to-zero is a legitimate mode: judge against the flushed inputs too
                if _finite_where_oracle_finite(out, oracle_outputs(target, flushed, device)[name], dtype) is None:
                    bad = None
            if bad is not None and target.options.get("reference_limited"):
                # a target whose trusted implementation is its reference's own float32 math: where
                # that is non-finite too, float32 itself cannot do better (reference-limited)
                before = int(bad.sum())
                bad = bad & torch.isfinite(trusted_outputs(target, case, inputs, device)[name].detach().cpu())
                limited += before - int(bad.sum())
                bad = bad if bad.any() else None
            if bad is not None:
                idx = int(bad.reshape(-1).nonzero()[0])
                return Verdict(target.name, "nonfinite", output=name, ratio=float("inf"),
                               detail=(f"{describe_injection(target, case)}: "
                                       f"{int(bad.sum())} position(s) nonfinite where the oracle is finite, first at "
                                       f"flat index {idx}: kernel {out.reshape(-1)[idx].item()!r}, "
                                       f"oracle {oracle[name].reshape(-1)[idx].item()!r}"))
        if limited:
            return Verdict(target.name, "pass", detail=(
                f"reference-limited: {limited} position(s) nonfinite where the oracle is finite, and where the "
                f"reference in float32 is nonfinite too"))
        return Verdict(target.name, "pass")


def accumulation_dims(target) -> dict[str, int] | None:
    """Inner dims (where totals run) as large as the contract allows up to SHAPE_CAP, others 4."""
    inner = inner_dims(target)
    return fit_dims(target, {n: min(d.hi, SHAPE_CAP) if n in inner else 4 for n, d in target.dims.items()})


def long_dims(target) -> dict[str, int] | None:
    """Inner dims at the largest odd size up to LONG_CAP the contract admits, others 2; None unless
    an inner dim then runs past FP16_INTEGERS, where an fp16 total or carry loses exact integers."""
    inner = inner_dims(target)
    wanted = {}
    for n, d in target.dims.items():
        k = min(d.search_hi, LONG_CAP) if n in inner else 2
        wanted[n] = k - 1 if n in inner and k % 2 == 0 and d.admits(k - 1) else k
    dims = fit_dims(target, wanted)
    if dims is None or not any(dims[n] > FP16_INTEGERS for n in inner if n in dims):
        return None
    return dims


def row_starts(target, name: str, dims: dict[str, int]) -> tuple[int, ...]:
    """Flat positions of the first element of each innermost row of argument ``name`` (at most
    ROW_STARTS of them)."""
    shape = target.shape_of(target.args[name].shape, dims)
    width = shape[-1] if shape else 1
    return tuple(range(0, target.numel(name, dims), width))[:ROW_STARTS]


def long_cases(target, seed, gate_id, dims):
    """Totals past fp16's integer range: ones, ones with each row's first element 2 (so every
    running total and every carry between blocks of a power-of-two size is odd), 0/1 and small
    integers, per dtype, at ``long_dims``."""
    i = 0
    for dtype in target.dtypes:
        names = float_args(target, dtype)
        plans = [{n: ArgCase(dist=Dist("ones")) for n in names},
                 {n: ArgCase(dist=Dist("ones"), inject=tuple((p, 2.0) for p in row_starts(target, n, dims)))
                  for n in names},
                 {n: ArgCase(dist=Dist("binary01")) for n in names},
                 {n: ArgCase(dist=Dist("smallint")) for n in names}]
        for plan in plans:
            yield make_case(target, dtype, gate_seed(seed, gate_id + "-long", i), dims, plan)
            i += 1


class Accumulation(Gate):
    """G07. Applies where exactness is by construction: every value an output depends on is set
    by the case (exact-answer inputs). A target whose outputs also depend on other floats names
    why in ``options["no_exact_answers"]`` and the gate is n/a there."""

    id, name = "G07", "accumulation"
    property = ("exact-answer inputs (ones, 0/1, small integers) at the largest sizes, and totals past fp16's "
                "integer range where the contract admits them: where the true result is representable and the "
                "trusted implementation gets it exactly, the kernel returns it bit for bit")

    def cases(self, target, seed):
        yield from distribution_cases(target, seed, self.id, accumulation_dims(target), G07_DISTS)
        dims = long_dims(target)
        if dims is not None:
            yield from long_cases(target, seed, self.id, dims)

    def not_applicable(self, target, executor=None):
        # exactness must come from the case: a target whose outputs also depend on values the case
        # does not set (a model's float weights) names why in options["no_exact_answers"], for there
        # an output is exact only by the luck of one summation order, which a correct kernel may not share
        reason = target.options.get("no_exact_answers")
        if reason:
            return reason
        return None if accumulation_dims(target) else "no large shape fits the contract"

    def check(self, target, case, device="cpu", c=BOUND_C, executor=None):
        inputs, outputs, verdict = kernel_outputs(target, case, executor_for(target, device, executor))
        if verdict is not None:
            return verdict
        oracle = oracle_outputs(target, inputs, device)
        trusted = trusted_outputs(target, case, inputs, device)
        checked = 0
        for name, out in outputs.items():
            dt = torch_dtype(target.output_dtype(name, case.dtype))
            o = oracle[name].detach().cpu().double()
            t = trusted[name].detach().cpu().double()
            k = out.detach().cpu().double()
            exact = torch.isfinite(o) & (o.to(dt).double() == o) & (t == o)
            checked += int(exact.sum())
            wrong = exact & (k != o)
            if wrong.any():
                idx = int(wrong.reshape(-1).nonzero()[0])
                return Verdict(target.name, "bound", output=name, ratio=float("inf"),
                               detail=(f"{int(wrong.sum())} of {int(exact.sum())} exact answers lost, first at flat "
                                       f"index {idx}: kernel {k.reshape(-1)[idx].item()!r}, "
                                       f"exact {o.reshape(-1)[idx].item()!r}"))
        return Verdict(target.name, "pass", metrics={"exact_positions": checked})

    def no_evidence(self, target, verdicts):
        if sum(v.metrics.get("exact_positions", 0) for v in verdicts) == 0:
            return "no output of these exact-answer inputs is exactly representable and exact in the trusted implementation"
        return None
