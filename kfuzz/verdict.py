"""Verdicts and failure signatures.

Every run of a case ends in one verdict: ``pass`` or one failure kind. The
signature (target, kind, output, and for exceptions the type and raising frame)
is what the minimizer keeps and what the corpus deduplicates by; it holds no
numbers and no line numbers, so it survives edits and reruns.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

KINDS = ("pass", "exception", "crash", "timeout", "contract", "nonfinite", "bound",
         "nondeterminism", "mutation", "stale")


@dataclass(frozen=True, slots=True)
class Signature:
    target: str
    kind: str
    output: str | None = None
    exc_type: str | None = None
    frame: str | None = None

    @property
    def slug(self) -> str:
        """A directory name: ``kind``, then output or exception type and frame."""
        parts = [self.kind] + [p for p in (self.output, self.exc_type, self.frame) if p]
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(parts))[:120]

    def to_json(self) -> dict:
        return {"target": self.target, "kind": self.kind, "output": self.output,
                "exc_type": self.exc_type, "frame": self.frame}

    @classmethod
    def from_json(cls, d: dict) -> "Signature":
        return cls(d["target"], d["kind"], d.get("output"), d.get("exc_type"), d.get("frame"))

    def __str__(self) -> str:
        return f"{self.target}/{self.slug}"


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of one case: ``kind`` and the evidence.

    ``ratio`` is how close the case came to failing the bound (error over bound,
    the largest over outputs; > 1 fails); engines may use it as feedback.
    """

    target: str
    kind: str
    output: str | None = None
    detail: str = ""
    exc_type: str | None = None
    frame: str | None = None
    ratio: float = 0.0
    metrics: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown verdict kind {self.kind!r}")

    @property
    def passed(self) -> bool:
        return self.kind == "pass"

    @property
    def signature(self) -> Signature:
        return Signature(self.target, self.kind, self.output, self.exc_type, self.frame)

    def to_json(self) -> dict:
        return {"kind": self.kind, "output": self.output, "detail": self.detail,
                "exc_type": self.exc_type, "frame": self.frame, "ratio": _finite(self.ratio),
                "metrics": {k: _finite(v) for k, v in self.metrics.items()}}

    @classmethod
    def from_json(cls, target: str, d: dict) -> "Verdict":
        return cls(target, d["kind"], d.get("output"), d.get("detail", ""), d.get("exc_type"),
                   d.get("frame"), float(d.get("ratio") or 0.0), dict(d.get("metrics") or {}))


def _finite(x):
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return repr(x)
    return x
