"""The random engine: samples valid cases from a target's contract.

Sizes lean toward the edges that break kernels (1, primes, powers of two and
their neighbours, the contract's bounds) and toward small sizes, where bugs live and
cases are cheap to judge: the largest admitted size is drawn rarely, and sizes over the
whole range log-uniformly (a size in [8, 16) as often as one in [4096, 8192)). Layouts,
distributions and special values are drawn with fixed probabilities. Every proposed case
passes ``Target.validate``.

Drawn so, a target whose oracle's work is a product of its dims (the GDN recurrence's
B*T*H*K*V) spends most of a campaign's judging on a few percent of its cases. Such a target
declares ``options["keep"]`` (``dims -> chance in (0, 1]``), and fresh dims are kept with that
chance (``Target.keep_chance``), else drawn again: e.g. ``min(1, budget / work)``, which
draws a case of twice the budget's work half as often, so the largest sizes stay in the
campaign, rarely.
"""
from __future__ import annotations

import math
import random

from kfuzz.case import DISTRIBUTIONS, ArgCase, Case, Dist, Layout
from kfuzz.target import Target

EDGE_SIZES = (1, 2, 3, 5, 7, 8, 13, 15, 16, 17, 31, 32, 33, 63, 64, 65, 97, 127, 128, 129,
              255, 256, 257, 511, 512, 513, 1000, 1023, 1024, 1025, 2047, 2048, 4095, 4096)
P_LAYOUT, P_DIST, P_INJECT = 0.3, 0.4, 0.3


def sample_size(rng: random.Random, lo: int, hi: int, multiple_of: int = 1) -> int:
    for _ in range(64):
        r = rng.random()
        if r < 0.5:
            n = rng.choice([s for s in EDGE_SIZES if lo <= s <= hi] or [lo])
        elif r < 0.56:
            n = lo
        elif r < 0.58:
            n = hi
        elif r < 0.83:
            n = rng.randint(lo, min(hi, max(lo, 64)))
        else:   # log-uniform over the range
            n = min(hi, int(math.exp(rng.uniform(math.log(max(lo, 1)), math.log(hi + 1)))))
        n -= n % multiple_of
        if lo <= n <= hi and n % multiple_of == 0:
            return n
    return lo + (-lo) % multiple_of


def sample_layout(rng: random.Random, rank: int, allowed: tuple[str, ...]) -> Layout:
    kinds = [k for k in allowed if k != "contiguous"] if rank else []
    if not kinds or rng.random() >= P_LAYOUT:
        return Layout()
    kind = rng.choice(kinds)
    if kind == "permuted":
        perm = list(range(rank))
        rng.shuffle(perm)
        return Layout("permuted", perm=tuple(perm)) if perm != sorted(perm) else Layout()
    if kind == "strided":
        return Layout("strided", step=tuple(rng.choice((1, 1, 2, 3)) for _ in range(rank)))
    if kind == "offset":
        return Layout("offset", offset=rng.randint(1, 17))
    return Layout("expanded", dims=(rng.randrange(rank),))


def sample_dist(rng: random.Random) -> Dist:
    if rng.random() >= P_DIST:
        return Dist()
    kind = rng.choice(DISTRIBUTIONS)
    if kind == "scaled":
        return Dist(kind, (("factor", rng.choice((1e-2, 1e2, 1e4))),))
    if kind == "shifted":
        return Dist(kind, (("shift", rng.choice((5.0, -5.0, 100.0))),))
    return Dist(kind)


def sample_injections(rng: random.Random, numel: int, names: list[str]) -> tuple:
    if numel == 0 or rng.random() >= P_INJECT:
        return ()
    if not names:
        return ()
    picks = {rng.randrange(numel): rng.choice(names) for _ in range(rng.randint(1, 3))}
    return tuple(sorted(picks.items()))


def sample_dim(rng: random.Random, dim) -> int:
    """A value of ``dim`` (a ``Dim``) over its search range."""
    return sample_size(rng, dim.lo, dim.search_hi, dim.multiple_of)


def sample_case(target: Target, rng: random.Random, like: Case | None = None) -> Case:
    """A case for ``target``; with ``like``, one of its dims and dtype (everything else drawn).
    Dims drawn afresh are kept with the chance the target gives them (``Target.keep_chance``)."""
    for _ in range(100 if like is None else 0):
        dims = {name: sample_dim(rng, d) for name, d in target.dims.items()}
        if target.constraint is not None and target.constraint(dims):
            continue
        chance = target.keep_chance(dims)
        if chance >= 1.0 or rng.random() < chance:
            break
    if like is not None:
        dims = like.dim
    dtype = rng.choice(target.dtypes) if like is None else like.dtype
    args = {}
    for name, arg in target.args.items():
        args[name] = ArgCase(layout=sample_layout(rng, len(arg.shape), arg.layouts), dist=sample_dist(rng),
                             inject=sample_injections(rng, target.numel(name, dims), target.special_names(name, dtype)))
    case = Case.make(target.name, dtype, rng.getrandbits(32), dims, args)
    target.validate(case)
    return case


class RandomEngine:
    name = "random"

    def __init__(self, target: Target, seed: int = 0):
        self.target = target
        self.rng = random.Random(seed)

    def next_case(self) -> Case:
        return sample_case(self.target, self.rng)

    def draw_dim(self, name: str) -> int:
        """A fresh value of dim ``name``, drawn as a whole case's would be."""
        return sample_dim(self.rng, self.target.dims[name])

    def redraw(self, like: Case) -> Case:
        """A case in place of the last one drawn, of ``like``'s dims and dtype (so of a JIT
        specialization already compiled: ``kfuzz.schedule``)."""
        return sample_case(self.target, self.rng, like)

    def feedback(self, case: Case, verdict) -> None:
        """The random engine learns nothing."""
