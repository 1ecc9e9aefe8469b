"""The corpus on disk: seeds and minimized failures, content-addressed and written atomically.

    seeds/<target folder>/<hash>.case.zst
    crashes/<target folder>/<signature>/<hash>.case.zst

``<target folder>`` is the target's name made one safe path component
(``target_folder``): a ``kb:<corpus file>:<row>`` name holds ``/`` and ``:``.
Nothing reads a target back from a folder's name: a case file names its
target in its own ``target`` field, and replay takes it from there.

``<hash>`` is the case's own hash (the record does not enter it), so saving the
same case twice writes one file. A failure file carries a record: the verdict,
its signature, what replay expects of it (``fail``: a known open bug that must
still reproduce; ``pass``: a fixed bug that must stay fixed), the versions of
kfuzz, torch and triton, the device and the time. The corpus keeps one case
per signature: a second failure with a signature already on disk is not saved.

Writes go to a temporary file in the same folder and are renamed into place,
so an interrupted write never leaves a truncated case, and a bad file never
stops the others from loading.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

import torch

import kfuzz
from kfuzz.case import Case, decode, encode
from kfuzz.errors import CaseError
from kfuzz.verdict import Signature, Verdict

SUFFIX = ".case.zst"
FOLDER_MAX = 200          # characters of a target folder's name (file systems allow 255 bytes)
_PLAIN = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")


def target_folder(target: str) -> str:
    """The folder of ``target``'s cases: one path component, the same for the same name and
    different for different names. Letters, digits, ``_ . -`` stay (every name kfuzz's own
    targets use is its own folder); any other character is percent-encoded as its UTF-8
    bytes (``kb%3A%2Fwork...``), and so is a leading dot (``..`` must not climb out). A name
    longer than FOLDER_MAX keeps its start and, after a ``~`` (which encoding never leaves),
    a hash of the whole name."""
    folder = "".join(c if c in _PLAIN else "".join(f"%{b:02X}" for b in c.encode()) for c in target)
    if folder.startswith("."):
        folder = "%2E" + folder[1:]
    if len(folder) > FOLDER_MAX:
        folder = folder[:FOLDER_MAX - 17] + "~" + hashlib.sha256(target.encode()).hexdigest()[:16]
    return folder or "%"


def versions(device: str = "cpu") -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    dev = torch.cuda.get_device_name() if str(device).startswith("cuda") and torch.cuda.is_available() else "cpu"
    return {"kfuzz": kfuzz.__version__, "torch": torch.__version__, "triton": triton_version, "device": dev}


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def make_record(verdict: Verdict, expect: str = "fail", device: str = "cpu", **extra) -> dict:
    return {"verdict": verdict.to_json(), "signature": verdict.signature.to_json(), "expect": expect,
            "versions": versions(device),
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **extra}


def load(path: str | Path) -> tuple[Case, dict | None]:
    """The case and record in ``path``; CaseError names the file and what is wrong."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise CaseError(f"{p}: cannot read ({e.strerror})") from None
    return decode(data, str(p))


def iter_case_files(paths: Iterable[str | Path]) -> Iterator[Path]:
    """Every ``.case.zst`` named or under the folders named, in a stable order."""
    for root in paths:
        p = Path(root)
        if p.is_dir():
            yield from sorted(q for q in p.rglob(f"*{SUFFIX}") if not q.name.startswith(".tmp-"))
        elif p.exists():
            yield p
        else:
            raise CaseError(f"{p}: no such file or folder")


class Corpus:
    """The ``seeds/`` and ``crashes/`` folders of one project root."""

    def __init__(self, root: str | Path = "."):
        self.root = Path(root)
        self.crashes = self.root / "crashes"
        self.seeds = self.root / "seeds"

    def crash_folder(self, target: str) -> Path:
        return self.crashes / target_folder(target)

    def seed_folder(self, target: str) -> Path:
        return self.seeds / target_folder(target)

    def failure_path(self, case: Case, signature: Signature) -> Path:
        return self.crash_folder(case.target) / signature.slug / f"{case.hash}{SUFFIX}"

    def has_open_failure(self, signature: Signature) -> bool:
        """Whether a case kept under ``signature`` is an open failure (recorded ``expect:
        fail``, or unreadable: then it is not known to be fixed).  A folder that holds only
        fixed bugs (``expect: pass``, kept as regression cases) does not count: a failure
        with the same signature now is a new bug, and is saved beside them."""
        folder = self.crash_folder(signature.target) / signature.slug
        for f in sorted(folder.glob(f"*{SUFFIX}")) if folder.is_dir() else []:
            try:
                record = load(f)[1]
            except CaseError:
                return True
            if (record or {}).get("expect", "fail") == "fail":
                return True
        return False

    def save_failure(self, case: Case, verdict: Verdict, expect: str = "fail", device: str = "cpu",
                     replace_existing: bool = False, **extra) -> Path | None:
        """Save a failing case unless its signature already has an open failure kept
        (``has_open_failure``); returns the path written."""
        if verdict.passed:
            raise ValueError("only failures are saved in crashes/")
        sig = verdict.signature
        if self.has_open_failure(sig) and not replace_existing:
            return None
        path = self.failure_path(case, sig)
        if replace_existing:
            for old in path.parent.glob(f"*{SUFFIX}"):
                old.unlink()
        write_atomic(path, encode(case, make_record(verdict, expect, device, **extra)))
        return path

    def save_seed(self, case: Case) -> Path:
        path = self.seed_folder(case.target) / f"{case.hash}{SUFFIX}"
        if not path.exists():
            write_atomic(path, encode(case))
        return path

    def seeds_of(self, target: str) -> list[Case]:
        out, folder = [], self.seed_folder(target)
        for f in iter_case_files([folder]) if folder.is_dir() else []:
            try:
                case = load(f)[0]
            except CaseError:
                continue
            if case.target == target:       # the case's own field says whose it is, not the folder
                out.append(case)
        return out
