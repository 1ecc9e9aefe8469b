"""G07 accumulation: exact-answer inputs, whose exact result the kernel returns bit for bit.

Ones, 0/1 and small integers at the largest sizes the contract allows (up to
``kfuzz.gates.bounds.SHAPE_CAP``), and totals past fp16's integer range where the contract
admits them. Tolerance-free: where the float64 oracle's result is representable in the
output dtype and the trusted implementation gets it exactly, the kernel's must equal it.

n/a where no large shape fits the contract, or where a target's outputs also depend on
floats the case does not set (``options["no_exact_answers"]``); refuses nothing else
itself: a case that breaks the contract is a ``CaseError``.
"""
from __future__ import annotations

import torch

from kfuzz.case import ArgCase, Dist
from kfuzz.compare import BOUND_C
from kfuzz.dtypes import torch_dtype
from kfuzz.execute import oracle_outputs, trusted_outputs
from kfuzz.executor import executor_for
from kfuzz.gates.base import Gate, fit_dims, float_args, gate_seed, inner_dims, make_case
from kfuzz.gates.bounds import SHAPE_CAP, distribution_cases, kernel_outputs
from kfuzz.verdict import Verdict

G07_DISTS = (Dist("ones"), Dist("binary01"), Dist("smallint"))
FP16_INTEGERS = 2048  # fp16 holds every integer up to 2^11 and not all beyond
LONG_CAP = 4095       # G07's long totals: up to the largest odd size below 4096
ROW_STARTS = 64       # G07: rows whose first element is raised, per argument


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
