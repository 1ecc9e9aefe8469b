"""The audit's results file, ``<out>/results.jsonl``: one signed record a kernel.

Records are appended by the supervising process only (``append_record``), one line a kernel,
written with one ``write`` on an ``O_APPEND`` descriptor. Each line carries an HMAC-SHA256
(``hmac``) under a key kept outside the results folder (``results_key``: ``$KFUZZ_AUDIT_KEY``,
else ``~/.config/kfuzz/audit.key``, made on first use, mode 0600) that no kernel process is
handed. A rerun skips the keys already there (``done_keys``; a torn last line is ignored and
redone) and, with a retry, redoes those whose run did not finish (``needs_retry``).

Refuses: a line whose HMAC fails, or that has none unless ``trust_unsigned``, is left out of
what ``read_results`` returns and said (``Results.refused``); a key file that is not a key, or
a missing one where it may not be made, is a ``KfuzzError``.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from kfuzz.audit.verdicts import judge_record, kfuzz_errors
from kfuzz.errors import KfuzzError

if TYPE_CHECKING:
    from kfuzz.kernelbench.corpus import CorpusEntry


RESULTS = "results.jsonl"


KEY_ENV = "KFUZZ_AUDIT_KEY"


def key_path() -> Path:
    """Where the results' key lives: ``$KFUZZ_AUDIT_KEY``, else ``$XDG_CONFIG_HOME/kfuzz/audit.key``
    (``~/.config/kfuzz/audit.key``)."""
    if os.environ.get(KEY_ENV):
        return Path(os.environ[KEY_ENV])
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "kfuzz" / "audit.key"


def results_key(path: str | Path | None = None, create: bool = True) -> bytes:
    """The key that signs results (``key_path`` unless ``path``): made on first use (32 random
    bytes in hex, mode 0600, in a folder of mode 0700) if ``create``. Refuses (``KfuzzError``) a
    missing key when not ``create``, and a file that is not a key."""
    p = Path(path) if path is not None else key_path()
    if not p.exists():
        if not create:
            raise KfuzzError(f"{p}: no audit key (results are verified with the key that signed them)")
        p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:     # another audit made it first
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(os.urandom(32).hex() + "\n")
    for _ in range(50):             # another audit may be writing it this instant
        try:
            text = p.read_text().strip()
        except OSError as e:
            raise KfuzzError(f"{p}: cannot read the audit key ({e.strerror})") from None
        if text:
            break
        time.sleep(0.01)
    if len(text) < 32:
        raise KfuzzError(f"{p}: not an audit key (want at least 32 characters of secret, got {len(text)})")
    return text.encode()


def _mac(key: bytes, record: dict) -> str:
    body = json.dumps({k: v for k, v in record.items() if k != "hmac"}, sort_keys=True, default=str)
    return hmac.new(key, b"kfuzz-audit-record\0" + body.encode(), hashlib.sha256).hexdigest()


class Results(dict):
    """Records by key, the last valid line of a key winning (a retried kernel appends a new one),
    except that a line without an HMAC never replaces a signed record;
    ``refused``: (line number, why) for each line that is not a valid signed record (a torn line,
    no HMAC, an HMAC that fails); ``unsigned``: lines taken without an HMAC (``trust_unsigned``);
    ``unsigned_keys``: the keys whose record taken is such a line."""

    def __init__(self):
        super().__init__()
        self.refused: list[tuple[int, str]] = []
        self.unsigned = 0
        self.unsigned_keys: set[str] = set()


def read_results(path: str | Path, key: bytes | None = None, trust_unsigned: bool = False) -> Results:
    """The records of a results file by key (``Results``), each checked against its HMAC under
    ``key`` (by default ``results_key()``; with no key, every signed line is refused). Lines
    without an HMAC are refused unless ``trust_unsigned`` (records made before results were
    signed), and never after a signed line of the same key (which a kernel could append); a line
    whose HMAC fails is always refused."""
    if key is None:
        try:
            key = results_key(create=False)
        except KfuzzError:
            key = None
    out = Results()
    path = Path(path)
    if not path.is_file():
        return out
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            name = rec["key"]
            if not isinstance(name, str):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            out.refused.append((n, "not a record (a torn or foreign line)"))
            continue
        mac = rec.pop("hmac", None)
        if mac is None:
            if not trust_unsigned:
                out.refused.append((n, f"{name}: no HMAC (not written by kfuzz audit under a key)"))
                continue
            if name in out and name not in out.unsigned_keys:
                out.refused.append((n, f"{name}: no HMAC, after a signed record of the key"))
                continue
            out.unsigned += 1
            out.unsigned_keys.add(name)
        elif key is None or not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(key, rec)):
            out.refused.append((n, f"{name}: the HMAC does not match (forged or altered, or another key's)"))
            continue
        else:
            out.unsigned_keys.discard(name)
        out[name] = rec
    return out


def needs_retry(record: dict, entry: CorpusEntry | None = None) -> bool:
    """A record of a run that did not finish (``judge_record``'s ``incomplete``: killed for time,
    or out of a shared GPU's memory or the GPU busy, the adapter's run of the reference
    included; a gate that could not run, or an error that ended the kernel's run), or one made
    before the audit kept the accepting harness's train/eval mode, of a reference that the mode
    changes."""
    return judge_record(record)["incomplete"] or bool(kfuzz_errors(record)) or (
        "mode" not in record and entry is not None and entry.mode_sensitive)


def done_keys(out: str | Path, retry: bool = False, entries: Iterable[CorpusEntry] = (), key: bytes | None = None,
              trust_unsigned: bool = False, redo_unsigned: bool = False, results: Results | None = None) -> set[str]:
    """Keys validly recorded in ``out``'s results (``results``, where already read); with
    ``retry``, less those ``needs_retry``; with ``redo_unsigned``, less those whose record carries
    no HMAC."""
    by_key = {e.key: e for e in entries}
    if results is None:
        results = read_results(Path(out) / RESULTS, key, trust_unsigned)
    return {k for k, r in results.items() if not (retry and needs_retry(r, by_key.get(k)))
            and not (redo_unsigned and k in results.unsigned_keys)}


def signed_lines(path: Path) -> int:
    """How many lines of a results file carry an HMAC (read as text: a torn line counts if it does)."""
    if not path.is_file():
        return 0
    with open(path, errors="replace") as f:
        return sum('"hmac":' in line for line in f)


def append_record(out: str | Path, record: dict, key: bytes | None = None) -> None:
    """Append ``record`` to ``out``'s results, signed with ``key`` (by default ``results_key()``)."""
    key = key if key is not None else results_key()
    Path(out).mkdir(parents=True, exist_ok=True)
    line = (json.dumps({**record, "hmac": _mac(key, record)}, sort_keys=True, default=str) + "\n").encode()
    path = Path(out) / RESULTS
    if path.is_file() and path.stat().st_size:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                line = b"\n" + line      # a write cut short before: end its torn line first
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
