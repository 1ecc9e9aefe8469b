"""JIT compiles in a worker: a kernel's first call at a new specialization compiles it, and
that time is not the kernel's run time.

A Triton kernel meets a new shape, dtype or flag and compiles for seconds (tens of seconds
for a large kernel on a loaded machine); a worker's per-case ``timeout`` would call that a
hang and save it as the kernel's failure. In a worker, ``report_compiles`` installs Triton's
JIT hooks, which send a note when a compile begins and one when it ends (``compiling``);
kfuzz stops the case's clock in between, timed by its own clock (``Credit``).

The notes come from the kernel's process, so they are only the kernel's word: a case's
clock stops for at most ``COMPILE_ALLOWANCE`` seconds in all, after which a hang is a hang
again. Under the Triton interpreter nothing compiles and no note is sent.

A begin note names what compiles: the kernel and a short hash of its JIT key
(``name#hash``: Triton's key holds the argument types, their specialization and the
constexprs), so that a campaign can tell a specialization its scheduler's key does not
name (``kfuzz.schedule.Scheduler.observe``).
"""
from __future__ import annotations

import hashlib
from typing import Callable

COMPILE_ALLOWANCE = 600.0        # seconds a case's clock may stop for compiles, in all
BEGIN, END = b"kfuzz-jit:begin", b"kfuzz-jit:end"
LABEL_MAX = 160                  # bytes of a compile's label kept
LABELS_MAX = 64                  # labels kept a case
_send: Callable[[bytes], None] | None = None


def label(kernel: str, key) -> str:
    """A compile's label: the kernel's name and a short hash of its JIT key."""
    return f"{kernel}#{hashlib.sha256(str(key).encode()).hexdigest()[:10]}"


def compiling(begins: bool, what: str = "") -> None:
    """Tell kfuzz that a JIT compile begins (of ``what``: a ``label``) or has ended, where a
    worker reports them."""
    if _send is None:
        return
    if not begins:
        _send(END)
    else:
        _send(BEGIN + b" " + what.encode(errors="replace")[:LABEL_MAX] if what else BEGIN)


def report_compiles(send: Callable[[bytes], None]) -> None:
    """Send the notes through ``send`` around every Triton JIT compile in this process
    (without Triton, or a Triton without these hooks, compiles count as run time)."""
    global _send
    _send = send
    try:
        from triton import knobs

        def before(**kw) -> bool:
            compiling(True, label(getattr(kw.get("fn"), "name", "?"), kw.get("key")))
            return False             # compile as usual

        knobs.runtime.jit_cache_hook = before
        knobs.runtime.jit_post_compile_hook = lambda **kw: compiling(False)
    except (ImportError, AttributeError):
        pass


class Credit:
    """The time a worker's running case spent compiling by its notes, on kfuzz's clock,
    capped at ``allowance``, and the labels its begin notes gave (``compiled``, in order)."""

    def __init__(self, allowance: float = COMPILE_ALLOWANCE):
        self.allowance, self.earned, self.since = allowance, 0.0, None
        self.compiled: list[str] = []

    def reset(self) -> None:
        """A new case starts: nothing earned, no compile running."""
        self.earned, self.since, self.compiled = 0.0, None, []

    def take(self, msg: bytes, now: float) -> bool:
        """Whether ``msg`` is a compile note (and if so, account for it at ``now``)."""
        if msg == BEGIN or msg.startswith(BEGIN + b" "):
            if self.since is None:
                self.since = now
            what = msg[len(BEGIN) + 1:LABEL_MAX + len(BEGIN) + 1].decode(errors="replace")
            if what and len(self.compiled) < LABELS_MAX:
                self.compiled.append(what)
        elif msg == END:
            self.earned, self.since = self.extension(now), None
        else:
            return False
        return True

    def extension(self, now: float) -> float:
        """Seconds the case's deadline moves on by at ``now``."""
        running = now - self.since if self.since is not None else 0.0
        return min(self.allowance, self.earned + running)


def listen(send: Callable[[bytes], None] | None) -> Callable[[bytes], None] | None:
    """Make ``send`` this process's receiver of compile notes for a while (``None``: nobody);
    returns the receiver it replaces, to be put back (an in-process executor's call)."""
    previous = _send
    if send is None:
        globals()["_send"] = None
    else:
        report_compiles(send)
    return previous
