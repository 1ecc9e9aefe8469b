"""Errors that mean bad input or bad usage (the CLI's exit code 2), never a kernel failure.

A kernel that misbehaves is not an error: it gets a verdict (``kfuzz.verdict``).
"""


class KfuzzError(Exception):
    """Bad usage or bad input; the message names what is wrong and where."""


class CaseError(KfuzzError):
    """A case (or a case file) that is malformed or breaks its target's contract."""


class TargetError(KfuzzError):
    """An unknown target, or a target definition that is inconsistent."""
