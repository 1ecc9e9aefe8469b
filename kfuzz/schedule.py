"""Compile-aware scheduling: most cases from JIT specializations already compiled.

A Triton kernel compiles again for every new *specialization*: a new dtype, a new
``constexpr`` (block sizes are usually the next power of two of a dimension), an integer
argument that becomes 1 or stops being a multiple of 16. A compile costs seconds and the
compiled kernel's call costs milliseconds, so a campaign that draws every case afresh
spends its time compiling.

``specialization(target, case)`` is the key of the kernel a case runs: what the target
declares (``options["specialization"]``: ``(dims, dtype) -> hashable``), else Triton's
default rules above, per dimension. A ``Scheduler`` learns from each executed case whether
its key compiled (``kfuzz.jit`` notes) and lets the engine's draws through while compiling
has taken at most ``share`` of the campaign's time; past it, a draw of a new key is
replaced by a fresh case of the dims and dtype of a specialization that has run (one at
random), from an engine that can redraw (``redraw(like)``, the random engine); other
engines' cases pass unchanged. Without compiles (the CPU, the Triton interpreter) it never
holds a case back.
"""
from __future__ import annotations

import random
from typing import Hashable

from kfuzz.case import Case
from kfuzz.target import Target


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def specialization(target: Target, case: Case) -> Hashable:
    """The JIT specialization ``case`` runs (see the module docstring)."""
    declared = target.options.get("specialization") if target.options else None
    if declared is not None:
        return declared(case.dim, case.dtype)
    return (case.dtype,) + tuple((name, n == 1, n % 16 == 0, _pow2(n)) for name, n in case.dims)


class Scheduler:
    """Draws cases from ``engine`` for ``target``, preferring compiled specializations once
    compiling has taken ``share`` of the time."""

    def __init__(self, target: Target, engine, share: float = 0.25, seed: int = 0):
        self.target, self.engine, self.share = target, engine, share
        self.ran: dict[Hashable, float] = {}   # key -> seconds its compile took (0: none seen)
        self.like: dict[Hashable, Case] = {}   # key -> a case that ran it
        self.held = 0                          # draws replaced by one of a compiled key
        self.rng = random.Random(seed)

    @property
    def size(self) -> int:
        return len(self.ran)

    def next_case(self, elapsed: float, compile_seconds: float) -> Case:
        case = self.engine.next_case()
        if compile_seconds <= self.share * elapsed or specialization(self.target, case) in self.ran:
            return case
        redraw = getattr(self.engine, "redraw", None)
        if redraw is None or not self.like:
            return case
        self.held += 1
        return redraw(self.like[self.rng.choice(list(self.like))])

    def observe(self, case: Case, compile_seconds: float) -> None:
        key = specialization(self.target, case)
        self.ran[key] = max(self.ran.get(key, 0.0), compile_seconds)
        self.like.setdefault(key, case)
