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
stops the others from loading. Files are created with the user's umask. Saving
a failure holds an exclusive lock on its signature's folder while it checks for
an open failure and writes, so processes saving at once (two campaigns on one
root) keep one case a signature.

A case file may come from outside: ``load`` reads at most a case file's cap
(``kfuzz.limits``) from a regular file and checks the record's fields that
replay and minimize rely on; ``load_checked`` also resolves the case's target and
checks its contract and storage budget, naming the file in every error.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import hashlib
import os
import secrets
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch

from kfuzz.version import __version__
from kfuzz.case import Case, decode, encode
from kfuzz.errors import CaseError, KfuzzError
from kfuzz.limits import CASE_FILE_ENV, describe, max_case_bytes, max_case_file_bytes
from kfuzz.target import Target, check_storage, get_target, load_target
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
    return {"kfuzz": __version__, "torch": torch.__version__, "triton": triton_version, "device": dev}


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder, renamed into
    place; the file gets the user's umask (as ``open`` would give it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".tmp-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
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


@contextlib.contextmanager
def locked(folder: Path):
    """An exclusive lock on ``folder`` (created if missing) for the ``with`` block: the
    processes that take it on one folder take turns."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def make_record(verdict: Verdict, expect: str = "fail", device: str = "cpu", **extra) -> dict:
    return {"verdict": verdict.to_json(), "signature": verdict.signature.to_json(), "expect": expect,
            "versions": versions(device),
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **extra}


_SLACK = 1 << 16     # a zstd frame may be a little larger than what it holds


def load(path: str | Path) -> tuple[Case, dict | None]:
    """The case and record in ``path``; CaseError names the file and what is wrong."""
    p = Path(path)
    try:
        if not p.is_file():
            raise CaseError(f"{p}: no such file" if not p.exists() else f"{p}: not a regular file")
        cap = max_case_file_bytes() + _SLACK
        with p.open("rb") as f:
            data = f.read(cap + 1)
    except OSError as e:
        raise CaseError(f"{p}: cannot read ({e.strerror})") from None
    if len(data) > cap:
        raise CaseError(f"{p}: larger than {describe(cap)}, more than a case file may hold "
                        f"(set {CASE_FILE_ENV} to raise it)")
    case, record = decode(data, str(p))
    if record is not None:
        check_record(record, str(p))
    return case, record


def check_record(record: Mapping, source: str) -> None:
    """The record's fields that replay, minimize and the gates read: ``expect`` is ``pass`` or
    ``fail`` (the default); ``signature`` (which ``fail`` needs) and ``verdict`` parse."""
    expect = record.get("expect", "fail")
    if expect not in ("pass", "fail"):
        raise CaseError(f"{source}: record field 'expect' is {expect!r}; it must be 'pass' or 'fail'")
    if expect == "fail" and "signature" not in record:
        raise CaseError(f"{source}: record expects a failure but names no 'signature'")
    for key, parse in (("signature", Signature.from_json), ("verdict", lambda d: Verdict.from_json("", d))):
        if key in record:
            entry = record[key]
            try:
                if not isinstance(entry, Mapping):
                    raise TypeError(f"a {type(entry).__name__}, not an object")
                parsed = parse(entry)
                fields = (parsed.target, parsed.kind, parsed.output, parsed.exc_type, parsed.frame)
                if not all(f is None or isinstance(f, str) for f in fields):
                    raise TypeError("a name that is not a string")
            except (KeyError, TypeError, ValueError) as e:
                raise CaseError(f"{source}: record field {key!r} is malformed ({type(e).__name__}: {e})") from None


def load_checked(path: str | Path, device: str = "cpu") -> tuple[Case, dict | None, Target]:
    """``load``, then ``checked_target`` (with the record's ``resolve``, on ``device``); every
    error names the file."""
    case, record = load(path)
    return case, record, checked_target(case, path, replay_resolve(record, path), device)


def replay_resolve(record: Mapping | None, source: str | Path) -> dict | None:
    """The record's ``resolve``: what the resolver of a target built on demand (``kb:``) needs to
    build the target the case was judged on (a KernelBench solution's weights), or None."""
    resolve = (record or {}).get("resolve")
    if resolve is None:
        return None
    if not (isinstance(resolve, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in resolve.items())):
        raise CaseError(f"{source}: record field 'resolve' must map names to strings, not {resolve!r}")
    return dict(resolve)


def checked_target(case: Case, source: str | Path, resolve: dict | None = None, device: str = "cpu") -> Target:
    """The target of a case read from ``source``, once the case is checked against its
    contract (``Target.validate``) and the global cap on its storage
    (``kfuzz.target.check_storage``), before anything is materialized. ``resolve``: options for
    the resolver of a name built on demand (``kb:``), from the case's record."""
    try:
        target = load_target(case.target, resolve={**resolve, "device": device}) if resolve else get_target(case.target)
        target.validate(case)
        check_storage(case, target, max_case_bytes())
    except KfuzzError as e:
        raise type(e)(f"{source}: {e}") from None
    return target


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
        (``has_open_failure``); returns the path written. The check and the write hold the
        signature folder's lock (``locked``), so of processes saving one signature at once,
        one saves."""
        if verdict.passed:
            raise ValueError("only failures are saved in crashes/")
        sig = verdict.signature
        data = encode(case, make_record(verdict, expect, device, **extra))
        path = self.failure_path(case, sig)
        with locked(path.parent):
            if self.has_open_failure(sig) and not replace_existing:
                return None
            if replace_existing:
                for old in path.parent.glob(f"*{SUFFIX}"):
                    old.unlink()
            write_atomic(path, data)
        return path

    def save_seed(self, case: Case) -> Path:
        path = self.seed_folder(case.target) / f"{case.hash}{SUFFIX}"
        if not path.exists():
            write_atomic(path, encode(case))
        return path

    def seeds_of(self, target: str) -> list[Case]:
        """The seeds kept for ``target``; a file that is unreadable, another target's, or
        breaks the contract or the storage cap is skipped."""
        out, folder = [], self.seed_folder(target)
        for f in iter_case_files([folder]) if folder.is_dir() else []:
            try:
                case = load(f)[0]
                if case.target != target:   # the case's own field says whose it is, not the folder
                    continue
                checked_target(case, f)
            except KfuzzError:
                continue
            out.append(case)
        return out
