"""The twelve gates: fixed, reproducible property checks that a correct kernel passes.

``run_gates(target, gates, seed=, out=)`` runs them and returns one
``GateResult`` per gate: ``pass``, ``fail`` with the evidence (the first
failing case, its verdict, the numbers), or ``n/a`` with the reason. Every
case of a gate runs (a failure does not stop the gate), so ``worst_ratio`` is
the largest error/bound of the gate's cases, which the calibration sweep reads.

Every failing case is saved, one per signature, as a replayable ``.case.zst``:

    <out>/gates/<gate>/crashes/<target>/<signature>/<hash>.case.zst

with ``gate`` and ``gate_seed`` in its record. These are not in the project's
``crashes/``: replaying them needs the gate's check (several calls, poisoned
memory, guard regions), which ``replay_gate_case`` runs.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterable

from kfuzz.case import Case
from kfuzz.compare import BOUND_C
from kfuzz.corpus import Corpus, check_record, load_checked
from kfuzz.errors import KfuzzError
from kfuzz.executor import executor_for
from kfuzz.gates.accumulation import Accumulation
from kfuzz.gates.base import Gate, GateResult, nominal_dims, verdict_of
from kfuzz.gates.bounds import Distributions, Layouts, Reference, Shapes
from kfuzz.gates.calls import CompleteWrites, Containment, Determinism, InputDependence
from kfuzz.gates.gradients import Gradients
from kfuzz.gates.nonfinite import Nonfinite, Range
from kfuzz.target import Target
from kfuzz.verdict import Signature, Verdict

GATES: dict[str, Gate] = {g.id: g for g in (
    Reference(), Distributions(), Shapes(), Layouts(), Nonfinite(), Range(), Accumulation(),
    Determinism(), Containment(), CompleteWrites(), InputDependence(), Gradients())}

__all__ = ["GATES", "Gate", "GateResult", "run_gate", "run_gates", "parse_gates", "gate_check", "replay_gate_case",
           "nominal_dims"]


def parse_gates(spec: str | Iterable[str] | None) -> list[str]:
    """Gate ids from ``"G05,G08"`` (or a list); all twelve when empty. KfuzzError on unknown ids."""
    if not spec:
        return list(GATES)
    ids = [s.strip().upper() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    unknown = [g for g in ids if g not in GATES]
    if unknown:
        raise KfuzzError(f"unknown gate(s) {', '.join(unknown)} (known: {', '.join(GATES)})")
    return ids


def run_gate(gate: Gate, target: Target, seed: int = 0, out: str | Path | None = None,
             device: str = "cpu", c: float = BOUND_C, executor=None,
             on_case: Callable[[str, int, float, Verdict], None] | None = None) -> GateResult:
    """One gate on ``target``; the kernel's side of each case runs in ``executor``
    (``kfuzz.programs``: ``Sandboxed`` or, by default, ``InProcess``).  ``on_case(gate id,
    case index, seconds, verdict)`` after each case (``kfuzz verify --verbose``)."""
    start = time.monotonic()
    executor = executor_for(target, device, executor)
    result = GateResult(gate.id, gate.name, "pass")
    reason = gate.not_applicable(target, executor)
    if reason:
        result.status, result.reason = "n/a", reason
        result.seconds = time.monotonic() - start
        return result
    corpus = Corpus(Path(out) / "gates" / gate.id) if out is not None else None
    verdicts: list[Verdict] = []
    for index, case in enumerate(gate.cases(target, seed)):
        case_start = time.monotonic()
        v = gate.judge_case(target, case, device, c, executor=executor)
        if isinstance(v, tuple):    # the check judged other inputs than the case's own: these fail
            case, v = v
        if on_case is not None:
            on_case(gate.id, index, time.monotonic() - case_start, v)
        verdicts.append(v)
        result.cases += 1
        result.worst_ratio = max(result.worst_ratio, v.ratio)
        if v.passed:
            continue
        result.failures += 1
        if result.first_failure is None:
            result.first_failure = (case, v)
        if corpus is not None:
            path = corpus.save_failure(case, v, device=device, gate=gate.id, gate_seed=seed)
            if path is not None:
                result.saved.append(path)
    if result.failures:
        result.status = "fail"
        case, v = result.first_failure
        result.reason = f"{v.kind}" + (f" in {v.output!r}" if v.output else "") + f": {v.detail}"
    else:
        empty = gate.no_evidence(target, verdicts)
        if empty:
            result.status, result.reason = "n/a", empty
    result.seconds = time.monotonic() - start
    return result


def run_gates(target: Target, gates: Iterable[str] | None = None, seed: int = 0,
              out: str | Path | None = None, device: str = "cpu", c: float = BOUND_C,
              on_result: Callable[[GateResult], None] | None = None, executor=None,
              on_case: Callable[[str, int, float, Verdict], None] | None = None) -> list[GateResult]:
    """Run the named gates (default all twelve) on ``target``; see the module docstring.
    ``executor``: where the kernel's side runs (default in this process); ``on_case`` as
    `run_gate` takes it."""
    results = []
    executor = executor_for(target, device, executor)
    for gid in parse_gates(gates):
        r = run_gate(GATES[gid], target, seed, out, device, c, executor, on_case)
        results.append(r)
        if on_result is not None:
            on_result(r)
    return results


def gate_check(gid: str, target: Target, device: str = "cpu", executor=None) -> Callable[[Case], Verdict]:
    """The verdict gate ``gid`` gives one case (``Gate.judge_case``; where it judged other
    inputs than the case's own, their verdict): how a saved gate case is replayed, and the
    minimizer's predicate for a failure only that gate's rules find."""
    def check(case: Case) -> Verdict:
        return verdict_of(GATES[gid].judge_case(target, case, device, executor=executor))
    return check


def replay_gate_case(path: str | Path, device: str = "cpu",
                     executors: Callable[[Target], object] | None = None) -> tuple[bool, Verdict, str]:
    """Run a saved gate case through its gate again: (ends as recorded, verdict, message).
    ``executors``: the executor for a target (default: in this process)."""
    case, record, target = load_checked(path, device)      # checked before anything is materialized
    gid = (record or {}).get("gate")
    if gid not in GATES:
        raise KfuzzError(f"{path}: not a gate case (its record names no known gate)")
    check_record(record, str(path))
    verdict = gate_check(gid, target, device, executors(target) if executors else None)(case)
    if record.get("expect", "fail") == "fail":
        want = Signature.from_json(record["signature"])
        ok = verdict.signature == want
        return ok, verdict, f"{gid}: " + ("still fails: " if ok else f"expected {want}, got ") + (
            str(verdict.signature) if not verdict.passed else "pass")
    return verdict.passed, verdict, f"{gid}: " + ("passes" if verdict.passed else f"expected pass, got {verdict.signature}")
