"""Compile-aware scheduling: most cases from JIT specializations already compiled.

A Triton kernel compiles again for every new *specialization*: a new dtype, a new
``constexpr`` (block sizes are usually the next power of two of a dimension), an integer
argument that becomes 1 or stops being a multiple of 16. A compile costs seconds (each
worker process compiles, or loads from the disk cache, once per specialization) and the
compiled kernel's call costs milliseconds, so a campaign that draws every case afresh
spends its time compiling.

``specialization(target, case)`` is the key of the kernel a case runs: what the target
declares (``options["specialization"]``: ``(dims, dtype, layouts) -> hashable``, layouts the
kinds of the arguments not contiguous; a Triton kernel's declaration names its constexprs
and, for each integer argument, ``integer_key``: whether it is 1 or a multiple of 16, as
Triton specializes it), else the case's dtype, dims and layout kinds; and, either way, the
arguments whose data starts off a 16-byte boundary (Triton specializes a pointer on its
alignment).

A ``Scheduler`` opens a new key only while (a) fewer than ``max(1, share * workers)`` new
keys are in flight and (b) compiling, the new key's expected compile counted in, stays within
``share`` of the workers' time (``kfuzz.jit`` notes, summed over the workers): ``compiled +
expected <= share * (elapsed + expected) * workers``. The expected compile of a key is 0 where an
earlier campaign ran it on the same JIT cache (``CompileHistory``: its kernels load from the
disk cache), else the longest compile of a key seen, in this campaign or, by the history, in an
earlier one (a warm campaign's first keys load in a fraction of a second, and would otherwise
price a key that compiles for real at that); otherwise a draw of a new key is replaced by
a fresh case of a key already compiled (one at random: its dtype, its dims or those with one
dim from a fresh draw (a step to dims the target keeps by a lower chance,
``Target.keep_chance``, taken with the ratio of the two chances), the rest redrawn until the
key matches, at most ``REDRAWS`` tries,
else its values redrawn), from an engine that can redraw (``redraw(like)``, and
``draw_dim(name)`` for one dim's fresh value: the random engine); other engines' cases pass
unchanged. A key in flight (opened, its first case not
back) is not handed to a second worker either: that worker would compile the same kernels
at the same time, each compile slowing the others, where once the first is back it loads
them from the disk cache. So a campaign that compiles settles at a steady rate, most of its
workers running cases of specializations already compiled. Until a compile is seen (the
CPU, the Triton interpreter: never) every draw passes.

A cold start (``cold=True``: a GPU campaign, whose first case compiles every kernel it
calls) opens with the target's smallest case: the first draw, redrawn at each dim's lower
bound (``smallest``), so the first verdict waits on the cheapest compile (the smallest
tiles) and small sizes, where bugs live, are run first; until that case has come back no other
is drawn (``waiting_first``).

A key can miss a trigger. The compile notes name what compiled (``kfuzz.jit.label``), and
``observe`` returns a kernel compiled at a JIT key that the earlier cases of its
specialization did not compile it at, where they compiled it at another: the campaign counts
and logs these (``specialization_misses``), so that a target's declaration can be corrected
from a GPU campaign's stats.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
from pathlib import Path
from typing import Hashable

from kfuzz.case import Case
from kfuzz.dtypes import torch_dtype
from kfuzz.errors import CaseError
from kfuzz.target import Target


def specialization(target: Target, case: Case) -> Hashable:
    """The JIT specialization ``case`` runs (see the module docstring)."""
    layouts = {name: a.layout.kind for name, a in case.args if a.layout.kind != "contiguous"}
    declared = target.options.get("specialization") if target.options else None
    if declared is not None:
        key = declared(case.dim, case.dtype, layouts)
    else:
        key = (case.dtype, case.dims, tuple(sorted(layouts.items())))
    return key, tuple(name for name, a in case.args if a.layout.kind == "offset"
                      and a.layout.offset * _itemsize(target.arg_dtype(name, case.dtype)) % 16)


def integer_key(n: int) -> tuple[bool, bool]:
    """How Triton specializes an integer argument of a kernel: whether it is 1, and whether it
    is a multiple of 16 (for a target's declared specialization)."""
    return n == 1, n % 16 == 0


def _itemsize(dtype: str) -> int:
    return torch_dtype(dtype).itemsize


def smallest(target: Target, case: Case) -> Case:
    """``case`` with every dim at its lower bound (rounded up to the dim's multiple), or
    ``case`` itself where the target refuses those dims."""
    low = Case.make(case.target, case.dtype, case.seed,
                    {n: d.lo + (-d.lo) % d.multiple_of for n, d in target.dims.items()})
    try:
        target.validate(low)
    except CaseError:
        return case
    return low


REDRAWS = 32
MIX_PROBE = 64
HISTORY = "kfuzz-compiles.json"    # a JIT cache's CompileHistory, a file in the cache's folder
HISTORY_KEYS = 20000               # keys a target's history keeps (the first ones)
HISTORY_BYTES = 16 << 20           # a larger history file is not read (workers may write the cache)


class CompileHistory:
    """What campaigns compiled into one JIT cache, per target: the specialization keys that ran
    (their ``repr``; their kernels are in the cache) and the longest compile of a key. Read from
    ``path`` (a JSON file; missing, unreadable or over ``HISTORY_BYTES``: empty), written back by
    ``save``. Only scheduling reads it: a wrong history costs time, never a verdict."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else None
        self.data: dict = {}
        try:
            big = self.path is not None and self.path.stat().st_size > HISTORY_BYTES
            data = json.loads(self.path.read_text()) if self.path is not None and not big else {}
        except (OSError, ValueError):
            data = {}
        if isinstance(data, dict):
            self.data = {t: e for t, e in data.items() if isinstance(e, dict)}

    def of(self, target: str) -> tuple[frozenset[str], float]:
        """``target``'s keys (reprs) and its longest compile, in seconds."""
        entry = self.data.get(target, {})
        keys = entry.get("keys") if isinstance(entry.get("keys"), list) else []
        cost = entry.get("longest")
        return (frozenset(k for k in keys if isinstance(k, str)),
                float(cost) if isinstance(cost, (int, float)) and cost >= 0 else 0.0)

    def add(self, target: str, schedule: "Scheduler") -> None:
        """The keys ``schedule`` ran and its longest compile, merged into ``target``'s."""
        keys, longest = self.of(target)
        new = [k for k in dict.fromkeys(map(repr, schedule.ran)) if k not in keys]
        self.data[target] = {"keys": (sorted(keys) + new)[:HISTORY_KEYS],
                             "longest": max([longest, *schedule.ran.values()])}

    def save(self) -> None:
        """Write the history to its file (atomically: a reader sees the old or the new one)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".kfuzz-compiles-", dir=self.path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)


class Scheduler:
    """Draws cases from ``engine`` for ``target`` (see the module docstring)."""

    def __init__(self, target: Target, engine, share: float = 0.25, workers: int = 1, seed: int = 0,
                 cold: bool = False, history: tuple[frozenset[str], float] = (frozenset(), 0.0)):
        """``history``: ``CompileHistory.of``'s keys cached before and longest compile."""
        self.target, self.engine, self.share, self.workers = target, engine, share, max(1, workers)
        self.cold = cold
        self.cached, self.longest = history
        self.ran: dict[Hashable, float] = {}   # key -> the longest compile seen for it (0: none)
        self.kernels: dict[Hashable, dict[str, set[str]]] = {}   # key -> kernel -> labels compiled
        self.like: dict[Hashable, Case] = {}   # key -> a case of it (opened: in flight or ran)
        self.opening: set[Hashable] = set()    # keys opened whose first case has not come back
        self.held = 0                          # draws replaced by a case of an opened key
        self.mixes = (0, 0)                    # redraws on mixed dims: tried, in a key
        self.rng = random.Random(seed)

    @property
    def size(self) -> int:
        return len(self.ran)

    @property
    def waiting_first(self) -> bool:
        """A cold start whose first case is out and not back: no other case is to be drawn
        until it is. Its compile fills the JIT cache that other workers then load from, and a
        draw before any compile is seen would open a second specialization (one worker would
        compile both before its first verdict)."""
        return self.cold and not self.ran and bool(self.like)

    def next_case(self, elapsed: float, compile_seconds: float) -> Case:
        """The next case, ``elapsed`` seconds into the campaign, its workers having compiled
        for ``compile_seconds`` in all."""
        case = self.engine.next_case()
        redraw = getattr(self.engine, "redraw", None)
        if self.cold and not self.like and redraw is not None:
            case = redraw(smallest(self.target, case))
        key = specialization(self.target, case)
        if key in self.ran or (key in self.like and compile_seconds <= 0):
            return case
        if key not in self.like:
            # bounded once compiles were seen (a cold campaign's first round is the campaign's)
            expected = self.expected(key)
            may_open = compile_seconds <= 0 or (len(self.opening) < max(1, int(self.share * self.workers))
                                                and compile_seconds + expected
                                                <= self.share * (elapsed + expected) * self.workers)
            if may_open or redraw is None or not self.like:
                self.like[key] = case
                self.opening.add(key)
                return case
        elif redraw is None or not self.ran:    # in flight, and nothing compiled to run instead
            return case
        self.held += 1
        return self._redraw(redraw, list(self.ran or self.like))

    def expected(self, key: Hashable) -> float:
        """The seconds opening ``key`` is expected to compile (see the module docstring)."""
        if repr(key) in self.cached:
            return 0.0
        return max([self.longest, *self.ran.values()])

    def _redraw(self, redraw, keys: list) -> Case:
        """A fresh case of one of ``keys`` (one at random). A redraw keeps the dims and dtype
        it is given and draws the rest; it is first given the dims of the key's case with one
        dim taken from a fresh draw, so that dims a key does not name (the GDN kernels' T, B
        and H) vary too, and for the last four tries the case's own dims. The first try of the
        key is taken, and one on new dims becomes the key's case (the dims walk); after
        ``REDRAWS`` tries, the key's case with a fresh seed (new values). Mixing stops for
        good when its first ``MIX_PROBE`` tries all missed (a key that names every dim)."""
        key = self.rng.choice(keys)
        like = self.like[key]
        mixing = self.mixes[1] > 0 or self.mixes[0] < MIX_PROBE
        for i in range(REDRAWS):
            mixed = mixing and i < REDRAWS - 4
            try:
                case = redraw(self._mixed(like) if mixed else like)
            except CaseError:
                continue
            hit = specialization(self.target, case) == key
            if mixed:
                self.mixes = (self.mixes[0] + 1, self.mixes[1] + hit)
            if hit:
                if mixed and not self._steps(like, case):
                    mixing = False             # the walk stays: the next try is of the key's own dims
                    continue
                if mixed:
                    self.like[key] = case      # the next mix starts here: a walk over the key's dims
                return case
        return dataclasses.replace(like, seed=self.rng.getrandbits(32))

    def _steps(self, here: Case, there: Case) -> bool:
        """Whether the dims walk steps from ``here`` to ``there``: always where ``there`` is
        kept with a chance (``Target.keep_chance``) no lower than ``here``'s, else with the
        ratio of the two (a Metropolis step). The walk's cases then follow the engine's kept
        draws; without it, a walk that takes one dim at a time from fresh draws would reach
        the costliest dims as often as the draws before keeping do."""
        ratio = self.target.keep_chance(there.dim) / max(self.target.keep_chance(here.dim), 1e-300)
        return ratio >= 1.0 or self.rng.random() < ratio

    def _mixed(self, like: Case) -> Case:
        """``like``'s dims, one of them (at random) taken from a fresh draw: of that dim alone
        where the engine draws one (``draw_dim(name)``), else of a whole case."""
        name = self.rng.choice(sorted(like.dim))
        draw_dim = getattr(self.engine, "draw_dim", None)
        dims = {**like.dim, name: draw_dim(name) if draw_dim is not None else self.engine.next_case().dim[name]}
        return Case.make(like.target, like.dtype, like.seed, dims)

    def observe(self, case: Case, compile_seconds: float, compiled: tuple[str, ...] = ()) -> list[str]:
        """``case`` came back, its kernel call having compiled for ``compile_seconds`` what
        ``compiled`` names (``kfuzz.jit.label``: kernel#key). Returns the labels of a kernel
        that an earlier case of the same specialization compiled at other JIT keys only: a
        trigger of a new specialization that the key does not name. Not a miss: a kernel new
        to the key (a code path these inputs took), a label seen before (a load from the cache
        of another worker), or several keys of a kernel within one case (an autotuner's
        configs, a kernel launched with two values of a constexpr)."""
        key = specialization(self.target, case)
        self.ran[key] = max(self.ran.get(key, 0.0), compile_seconds)
        self.like.setdefault(key, case)
        self.opening.discard(key)
        known = self.kernels.setdefault(key, {})
        labels = [(what, what.partition("#")[0]) for what in dict.fromkeys(compiled)]
        misses = [what for what, kernel in labels if known.get(kernel) and what not in known[kernel]]
        for what, kernel in labels:
            known.setdefault(kernel, set()).add(what)
        return misses
