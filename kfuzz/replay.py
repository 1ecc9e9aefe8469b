"""Replaying saved cases: every case must end as its record says.

A case recorded with ``expect: fail`` must fail again with the same signature
(a known open bug still reproduces); ``expect: pass`` (or no record, as for
seeds) must pass (a fixed bug stays fixed). A file that cannot be read, names a
target that does not exist, breaks its target's contract or storage budget
(checked before anything is materialized: ``kfuzz.corpus.load_checked``), or
whose replay raises, is one ``error`` result naming what is wrong, and the
other files still replay.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from kfuzz.case import encode
from kfuzz.corpus import iter_case_files, load, load_checked, make_record, write_atomic
from kfuzz.errors import KfuzzError
from kfuzz.execute import execute
from kfuzz.verdict import Signature, Verdict


@dataclass(frozen=True)
class ReplayResult:
    path: Path
    status: str                      # "ok", "changed" or "error"
    expect: str | None = None
    verdict: Verdict | None = None
    message: str = ""


def _without_path(e: KfuzzError, path) -> str:
    """The error's text less a leading "<path>: " (a result is shown after its path)."""
    text, prefix = str(e), f"{path}: "
    return text[len(prefix):] if text.startswith(prefix) else text


def replay_file(path: Path, device: str = "cpu") -> ReplayResult:
    """The result of replaying one file; never raises for what is in the file."""
    try:
        case, record, target = load_checked(path)
        verdict = execute(case, target, device=device)
    except KfuzzError as e:
        return ReplayResult(path, "error", message=_without_path(e, path))
    except Exception as e:    # noqa: BLE001 - one file's failure to replay must not stop the others
        return ReplayResult(path, "error", message=f"could not replay it ({type(e).__name__}: {e})"[:2000])
    expect = (record or {}).get("expect", "pass")
    if expect == "fail":
        want = Signature.from_json(record["signature"])
        if verdict.signature == want:
            return ReplayResult(path, "ok", expect, verdict, f"still fails: {want}")
        return ReplayResult(path, "changed", expect, verdict,
                            f"expected {want}, got {verdict.signature if not verdict.passed else 'pass'}")
    if verdict.passed:
        return ReplayResult(path, "ok", expect, verdict, "passes")
    return ReplayResult(path, "changed", expect, verdict, f"expected pass, got {verdict.signature}: {verdict.detail}")


def replay(paths: Iterable[str | Path], device: str = "cpu") -> Iterator[ReplayResult]:
    """Replay every case file under ``paths``; a missing path is one error result."""
    for root in paths:
        try:
            files = list(iter_case_files([root]))
        except KfuzzError as e:
            yield ReplayResult(Path(root), "error", message=_without_path(e, root))
            continue
        for f in files:
            yield replay_file(f, device)


def mark_fixed(result: ReplayResult, device: str = "cpu") -> None:
    """Rewrite a recorded failure that now passes as a ``pass`` case (the bug is fixed); the
    record's other facts (how it was minimized, its gate) stay."""
    case, record = load(result.path)
    old = Verdict.from_json(case.target, record.get("verdict") or record["signature"])
    kept = {k: v for k, v in record.items() if k not in make_record(old) and k != "fixed_from"}
    write_atomic(result.path, encode(case, make_record(old, "pass", device, **kept,
                                                       fixed_from=record["signature"])))
