"""Errors that mean bad input or bad usage (the CLI's exit code 2), never a kernel failure,
and the error of a machine that cannot run a kernel's worker (exit 2 too).

A kernel that misbehaves is not an error: it gets a verdict (``kfuzz.verdict``).
"""


class KfuzzError(Exception):
    """Bad usage or bad input; the message names what is wrong and where."""


class CaseError(KfuzzError):
    """A case (or a case file) that is malformed or breaks its target's contract."""


class TargetError(KfuzzError):
    """An unknown target, or a target definition that is inconsistent."""


class WorkerStartError(RuntimeError):
    """A sandboxed worker did not start: its target's import failed, it died or hung while
    starting, or its GPU stayed busy or full (other processes' state) past the waits
    (``kfuzz.workers.DEVICE_WAITS``). Not bad input, so not a ``KfuzzError``: a caller that
    refuses a case on a ``KfuzzError`` must not take it for one."""
