"""Judging an audit record: its violations, whether the kernel is broken, and how the record
ends against what its corpus expected.

``judge_record`` reads a record as the audit wrote it (or as an older kfuzz did) for its
violations: each gate failed, the weights contract (``W``: ``weights_failures``), a finding of
the build or the standard test, a kernel process that died, a standard test that did not end in
time. A failure of a kind that no threshold explains (``TOLERANCE_FREE_KINDS``) or past
``BROKEN_RATIO`` times the bound is ``broken``. A kernel that ran out of a GPU's memory shared
with other kernels, or met that GPU busy (``shares_memory``, ``ended_by_gpu_state``), is
``incomplete``, not judged on that failure; so is a gate's failure out of a GPU's memory that
no second run confirmed (``unconfirmed_memory_failures``). ``first_failure`` says a record's
first failure in words, ``outcome`` how it ends against its expectation; ``excused_class``
classes a passing case that excuses a difference.

Judges records only: it runs no kernel and reads no results file.
"""
from __future__ import annotations

from kfuzz.devices import shares_memory


# error/bound beyond which no plausible tolerance explains a bound failure
BROKEN_RATIO = 1e3
# failure kinds that no threshold explains away, whatever gate met them
TOLERANCE_FREE_KINDS = ("exception", "crash", "timeout", "contract", "nonfinite", "nondeterminism",
                        "mutation", "stale")


# cases a gate passes though the kernel differs from the oracle, because the reference itself
# cannot do better or the inputs leave its domain (the detail's start -> the class): arguable
EXCUSED = (("outside the contract", "shared-exception"), ("outside the reference's domain", "outside-domain"),
           ("reference-limited", "reference-limited"))


def excused_class(verdict) -> str | None:
    """The class of a passing verdict that excuses a difference (``EXCUSED``; a NaN the reference
    spreads through exact zeros is ``zero-spread``), else None."""
    if not verdict.passed or not verdict.detail:
        return None
    if "do not depend on the injected value" in verdict.detail:
        return "zero-spread"
    return next((cls for start, cls in EXCUSED if verdict.detail.startswith(start)), None)


def ended_by_gpu_state(record: dict) -> bool:
    """Whether the kernel's standard test, the adapter's run of its reference at its own sizes,
    its weights contract, a gate or its whole run (``error``) ended for a state of the GPU that
    other processes make: its memory taken (``resource-memory``) or the GPU busy or unavailable
    (``resource-device-busy``)."""
    from kfuzz import sandbox
    parts = [record.get("standard"), record.get("adapter"), record.get("weights"), record.get("error"),
             *record.get("gates", {}).values()]
    return any(isinstance(p, dict) and bool({sandbox.MEMORY, sandbox.BUSY} & {p.get("exc_type"), p.get("finding")})
               for p in parts)


def unconfirmed_memory_failures(record: dict) -> list[str]:
    """The gates of a GPU's record whose first failure is the kernel out of the GPU's memory
    without a second run to confirm it (``Gate.judge_case``'s ``memory_rerun``): the memory was
    shared with kfuzz's own processes, so the failure is not the kernel's finding; the gate is
    judged without it and the record is incomplete."""
    from kfuzz import sandbox
    from kfuzz.gates.base import MEMORY_RERUN
    if not shares_memory(record.get("device") or ""):
        return []
    return [gid for gid, g in sorted(record.get("gates", {}).items())
            if g.get("status") == "fail" and g.get("exc_type") == sandbox.MEMORY
            and not ((g.get("verdict") or {}).get("metrics") or {}).get(MEMORY_RERUN)]


def kfuzz_errors(record: dict) -> list[str]:
    """kfuzz's own errors in a record, in words: an error that ended the kernel's run, then each
    gate that could not run (``G05: <reason>``). A record with one was not audited to its end."""
    ended = record.get("error")
    return ([str(ended.get("error", ""))] if isinstance(ended, dict) else []) + [
        f"{gid}: {g.get('reason', '')}" for gid, g in sorted(record.get("gates", {}).items())
        if g.get("status") == "error"]


def _old_standard_end(record: dict) -> str | None:
    """Records made before the standard test's end was a finding: ``ended`` "<kind> (...) in the
    standard test"."""
    ended = record.get("ended") or ""
    return ended.split()[0] if "standard" not in record and ended.endswith("in the standard test") else None


WEIGHTS_CHECKS = ("contract", "derived", "reload", "lenient")


def weights_failures(record: dict) -> list[str]:
    """What of the weights contract (``W``) the record fails: ``contract`` (``Model``'s
    state_dict does not load, or the check could not run), ``derived`` (a parameter derived in
    ``__init__`` does not follow a loaded checkpoint), ``reload`` (weights copied before a
    checkpoint was loaded: stale), see ``weights_checks``; ``lenient`` (names of the solution's
    own hold copies of the weights that a ``strict=False`` load leaves stale), see ``lenient_check``."""
    w = record.get("weights") or {}
    out = ["contract"] if w.get("status") in ("fail", "error") else []
    return out + [k for k in WEIGHTS_CHECKS[1:] if ((w.get("checks") or {}).get(k) or {}).get("status") == "fail"]


def judge_record(record: dict) -> dict:
    """A record's verdicts: ``violations`` (gate ids failed, ``W`` for the weights contract, a
    finding's kind where the build or the standard test ended in a sandbox violation, a limit, a
    crash or a timeout, ``crash`` for a kernel process that died), ``broken`` (a tolerance-free
    failure, or an error over BROKEN_RATIO times the bound), ``standard`` (the standard test
    passed), ``incomplete`` (killed for time in the gates or the build: judged on what finished;
    or out of a GPU's memory, or the GPU busy, beside other kernels, not ``alone``, or a gate out
    of a GPU's memory unconfirmed: judged without those findings).

    G07 counts only where it applies: not on a reference with float weights (the weights
    record's ``params``; records made before G07 was n/a there say ``params`` only if the
    report tool filled it in from the corpus), whose G07 result is ``g07_not_applicable``."""
    from kfuzz import sandbox
    from kfuzz.gates import GATES
    violations, broken = [], False
    # out of a shared GPU's memory, or the GPU busy: perhaps the others' doing, not the kernel's finding
    shared = shares_memory(record.get("device") or "") and not record.get("alone") and ended_by_gpu_state(record)
    states = (sandbox.MEMORY, sandbox.BUSY)
    for where in ("build", "standard"):
        found = (record.get(where) or {}).get("finding")
        if found and not (shared and found in states):
            violations.append(str(found))
            broken = True
    g07_na = record.get("weights", {}).get("params") is True and "G07" in record.get("gates", {})
    unconfirmed = unconfirmed_memory_failures(record)
    for gid, g in sorted(record.get("gates", {}).items()):
        if (g.get("status") != "fail" or (gid == "G07" and g07_na) or (shared and g.get("exc_type") in states)
                or gid in unconfirmed):
            continue
        violations.append(gid)
        ratio = g.get("worst_ratio", 0)
        ratio = float("inf") if ratio == "inf" else float(ratio)
        if GATES[gid].tolerance_free or g.get("kind") in TOLERANCE_FREE_KINDS or ratio >= BROKEN_RATIO:
            broken = True
    if weights_failures(record):
        violations.append("W")
    ended = record.get("ended") or ""
    old = _old_standard_end(record)
    if ended.startswith("crash"):
        violations.append("crash")
        broken = True
    elif old == "timeout" or (ended.startswith("timeout") and record.get("phase") == "standard"
                              and "standard" not in record):
        violations.append("timeout")     # the standard test did not end in time: a finding
        broken = True
    std = record.get("standard")
    # a kernel process killed for time in the gates is incomplete, not judged: slow at the fixed
    # size on a CPU (or a slow oracle) looks the same as a hang from outside
    incomplete = ended.startswith("timeout") and "timeout" not in violations or shared or bool(unconfirmed)
    return {"violations": violations, "broken": broken, "violation": bool(violations),
            "standard": None if std is None or (shared and std.get("finding") in states) else bool(std.get("passed")),
            "incomplete": incomplete, "g07_not_applicable": g07_na,
            "audited": not {"adapter", "unbuilt", "skip"} & set(record) and ("standard" in record or bool(violations))}


def first_failure(record: dict) -> str | None:
    """The record's first failure in words: a build or standard-test finding, else the first
    failing gate (by id) with its kind, else the weights contract, else how the process ended."""
    for where in ("build", "standard"):
        r = record.get(where) or {}
        if r.get("finding"):
            return f"{where} {r['finding']}: {str(r.get('detail', ''))[:100]}"
    j = judge_record(record)
    for gid, g in sorted(record.get("gates", {}).items()):
        if gid in j["violations"]:
            kind = g.get("kind") or "fail"
            if g.get("exc_type"):
                kind += f" ({g['exc_type']})"
            return f"{gid} {kind}: {str(g.get('reason', ''))[:100]}"
    if "W" in j["violations"]:
        return f"W: {str(record['weights'].get('detail', ''))[:100]}"
    if record.get("ended"):
        return f"ended {record['ended']}" + (f" in the {record['phase']}" if record.get("phase") else "")
    return None


def outcome(record: dict) -> str:
    """How a record ends against what was expected of it: ``skipped`` (not audited: no pair, the
    adapter refused the reference, the solution did not build), ``incomplete`` (killed for time in
    the gates or build, or a kfuzz error ended a gate or the run, with no violation in what
    finished), ``expected`` (no violation in a corpus without expectations; a control
    ending as planted), or ``unexpected`` (a violation where none is expected, a planted bug
    missed, a correct control flagged)."""
    j = judge_record(record)
    if not j["audited"]:
        return "skipped"
    if (j["incomplete"] or kfuzz_errors(record)) and not j["violation"]:
        return "incomplete"
    want = record.get("expect")
    wanted_violation = want is not None and want != "none"
    return "expected" if j["violation"] == wanted_violation else "unexpected"
