"""The tolerance-free gates of special and extreme values: G05 nonfinite and G06 range.

G05 injects NaN, +Inf and -Inf and demands that the kernel's NaN set and Inf sets equal the
oracle's exactly; G06 draws and injects values near the dtype's largest and smallest
magnitudes and demands that the kernel be finite wherever the oracle, rounded to the
output dtype, is finite. Both put one special value into one argument at a time
(``kfuzz.gates.specials``); G05 also every special in every argument at once. Neither
judges finite values against a bound: that is G01-G04's (``kfuzz.gates.bounds``). On a
target whose trusted implementation is its reference's own float32 math
(``options["reference_limited"]``), a difference float32 by the reference's math cannot
avoid passes, saying so.

Refuses nothing itself: a case that breaks the contract is a ``CaseError``.
"""
from __future__ import annotations

import torch

from kfuzz.case import ArgCase, Dist
from kfuzz.compare import BOUND_C, all_finite, compare, kinds
from kfuzz.dtypes import special_value_table, torch_dtype, widen_float8
from kfuzz.execute import comparison_device, flush_subnormals, oracle_outputs, trusted_outputs
from kfuzz.executor import executor_for
from kfuzz.gates.base import Gate, float_args, gate_seed, make_case, nominal_dims
from kfuzz.gates.bounds import kernel_outputs
from kfuzz.gates.specials import (SINGLE_CASES, describe_injection, extreme_value, nonfinite_value,
                                  single_case_args, single_injections)
from kfuzz.verdict import Verdict


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
                # judged on the value they take without them (all of it where the comparison runs)
                judged = oracle[name].to(where)
                kernel = out.detach().to(where).double()
                needed = torch.isnan(judged) & ~torch.isnan(kernel)
                without = value_without_injection(target, case, inputs, name, device, needed=needed)
                if without is not None:
                    spread = needed & without[1].to(where)
                    if spread.any():
                        judged = torch.where(spread, without[0].to(where), judged)
                        f = compare(out, judged, None, dtype, bound, values=False, device=where)
                        excused += int(spread.sum()) if f.kind != "nonfinite" else 0
                if f.kind == "nonfinite":
                    # where the reference in float32 takes the kernel's class (NaN, +Inf, -Inf or
                    # finite) and the float64 oracle another (torch's float32 conv3d on the CPU
                    # turns one Inf into NaN where float64's stays finite), float32 by the
                    # reference's own math does no better: judged against it there
                    # (reference-limited)
                    differ = _class_differences(out, judged, dtype, where)[2]
                    t = trusted_outputs(target, case, inputs, device)[name].detach().to(where).double()
                    same = differ & (kinds(t) == kinds(kernel))
                    if same.any():
                        f = compare(out, torch.where(same, t, judged.double()), None, dtype, bound, values=False,
                                    device=where)
                        limited += int(same.sum()) if f.kind != "nonfinite" else 0
            if f.kind == "nonfinite":
                facts = {"kinds_only": float(kinds_only(out, oracle[name], dtype, where))}
                if without is not None:
                    facts["where_ignored"] = float(nonfinite_where_ignored(out, oracle[name], dtype, without[1], where))
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


def _class_differences(out, oracle, dtype: str, device="cpu"):
    """(the kernel's ``out``, the ``oracle`` rounded to ``dtype``, both float64 on ``device``,
    and where their NaN/+Inf/-Inf sets differ)."""
    k = out.detach().to(device).double()
    o = oracle.detach().to(device).to(torch_dtype(dtype)).double()
    return k, o, kinds(k) != kinds(o)


def kinds_only(out, oracle, dtype: str, device="cpu") -> bool:
    """Whether the kernel's ``out`` and the ``oracle`` (rounded to ``dtype``) differ only in the
    kind of non-finite value: both non-finite wherever their NaN/+Inf/-Inf sets differ (an
    algebraic rewrite, x sum(W) for sum(x W^T), gives an Inf where the reference's inf - inf
    gives NaN). The audit's report counts such kernels as a class of their own. Compared on
    ``device``."""
    k, o, differ = _class_differences(out, oracle, dtype, device)
    return bool(differ.any()) and bool((~torch.isfinite(k[differ]) & ~torch.isfinite(o[differ])).all())


def nonfinite_where_ignored(out, oracle, dtype: str, ignored, device="cpu") -> bool:
    """Whether the kernel's ``out`` differs from the finite ``oracle`` only by non-finite values
    at positions whose oracle value ignores the injected specials (``ignored``, from
    ``value_without_injection``): a kernel that relies on the inputs' structure instead of the
    reference's mask (a NaN on the diagonal of a triangular input reaching the positions
    ``triu`` sets to 0) spreads it there. The audit's report counts such kernels as a class of
    their own. Compared on ``device``."""
    k, o, differ = _class_differences(out, oracle, dtype, device)
    return bool(differ.any()) and bool((ignored.to(device)[differ] & ~torch.isfinite(k[differ])
                                        & torch.isfinite(o[differ])).all())


# rule of G05 on reference-limited targets: injected specials replaced by these to see what an
# output depends on (large and of both signs, so that a max, a sort or a clamp shows it too)
FINITE_STANDINS = (1000.0, -1000.0)


def value_without_injection(target, case, inputs, output: str, device="cpu", needed=None):
    """The oracle's ``output`` where exact zeros are honoured: at each position, the injected
    specials it does not depend on (an injection ``k`` is a dependence where changing ``k``
    alone between the two ``FINITE_STANDINS``, all others at the first, changes the value) are
    replaced by a finite stand-in and those it depends on kept. ``needed``: the positions whose
    value is wanted (a boolean mask of the output's shape; by default all): the oracle runs once
    for each dependence pattern among them, the others keep the oracle's value with every
    injection at the first stand-in. Returns (values, mask of the positions that depend on fewer
    injections than the case holds), where the oracle ran; None when it injects nothing."""
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
        return oracle_outputs(target, changed, device)[output]

    base = run({k: first for k in injected})
    bits = torch.int32 if len(injected) < 31 else torch.int64    # one bit an injection
    pattern = torch.zeros(base.shape, dtype=bits, device=base.device)
    for i, k in enumerate(injected):
        moved = run({**{j: first for j in injected}, k: second})
        depends = ~((base == moved) & torch.isfinite(base))
        pattern |= depends.to(bits) << i
        del moved, depends
    values = base.clone()     # a reference may return a view that cannot be written in place
    wanted = None if needed is None else needed.to(pattern.device)
    for code in (pattern if wanted is None else pattern[wanted]).unique().tolist():
        if code:
            kept = {k for i, k in enumerate(injected) if code >> i & 1}
            at = pattern == code
            if wanted is not None:
                at &= wanted
            values[at] = run({k: first for k in injected if k not in kept})[at]
    return values, pattern != (1 << len(injected)) - 1


def _finite_where_oracle_finite(out, oracle, dtype: str, device="cpu"):
    """Positions where the oracle, rounded to ``dtype``, is finite (off the overflow edge)
    and the kernel is not, on ``device``; None if there are none."""
    if all_finite(out):
        return None
    dt = torch_dtype(dtype)
    fi = torch.finfo(dt)
    o = oracle.detach().to(device).double()
    edge = o.abs() / float(fi.max)
    at_max = (edge >= 1 - 4 * float(fi.eps)) & (edge <= 1 + 4 * float(fi.eps))
    clear = torch.isfinite(widen_float8(o.to(dt))) & ~at_max
    bad = clear & ~torch.isfinite(out.detach().to(device).double())
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
        where = comparison_device(oracle, device)
        flushed = flush_subnormals(inputs)
        limited = 0
        for name, out in outputs.items():
            dtype = target.output_dtype(name, case.dtype)
            bad = _finite_where_oracle_finite(out, oracle[name], dtype, where)
            if bad is not None and flushed is not None:
                # flush-to-zero is a legitimate mode: judge against the flushed inputs too
                if _finite_where_oracle_finite(out, oracle_outputs(target, flushed, device)[name], dtype,
                                               where) is None:
                    bad = None
            if bad is not None and target.options.get("reference_limited"):
                # a target whose trusted implementation is its reference's own float32 math: where
                # that is non-finite too, float32 itself cannot do better (reference-limited)
                before = int(bad.sum())
                bad = bad & torch.isfinite(trusted_outputs(target, case, inputs, device)[name].detach().to(where))
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
