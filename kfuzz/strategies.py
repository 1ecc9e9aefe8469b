"""The case space of a target as hypothesis strategies, for users' own property tests.

    from hypothesis import given
    from kfuzz import strategies
    from kfuzz.execute import execute
    from kfuzz.target import get_target

    @given(strategies.cases(get_target("rowsum")))
    def test_rowsum_matches_its_oracle(case):
        assert execute(case).passed

Every drawn case passes ``Target.validate``. Sizes lean to the same edges as the random
engine (1, primes, powers of two and their neighbours, the contract's bounds), and
hypothesis shrinks toward the simplest case: small sizes, the first dtype, contiguous
layouts, the normal distribution, no injections.

The atheris engine can drive these strategies through hypothesis's ``fuzz_one_input``
(``AtherisEngine(mode="hypothesis")``); see docs/engines.md for why it does not by default.
"""
from __future__ import annotations

from hypothesis import strategies as st

from kfuzz.case import DISTRIBUTIONS, ArgCase, Case, Dist, Layout
from kfuzz.engines.random import EDGE_SIZES
from kfuzz.target import Dim, Target


def sizes(dim: Dim) -> st.SearchStrategy[int]:
    """Sizes the contract admits, edges first."""
    hi = dim.search_hi if hasattr(dim, "search_hi") else dim.hi
    m = dim.multiple_of
    lo_k, hi_k = -(-dim.lo // m), hi // m
    edges = sorted({s - s % m for s in EDGE_SIZES if dim.lo <= s - s % m <= hi and s - s % m > 0})
    plain = st.integers(lo_k, hi_k).map(lambda k: k * m)
    return st.one_of(st.sampled_from(edges), plain) if edges else plain


def layouts(rank: int, allowed: tuple[str, ...]) -> st.SearchStrategy[Layout]:
    options = [st.just(Layout())]
    if rank and "permuted" in allowed and rank > 1:
        options.append(st.permutations(list(range(rank))).filter(lambda p: p != sorted(p))
                       .map(lambda p: Layout("permuted", perm=tuple(p))))
    if rank and "strided" in allowed:
        options.append(st.lists(st.integers(1, 3), min_size=rank, max_size=rank)
                       .map(lambda s: Layout("strided", step=tuple(s))))
    if rank and "offset" in allowed:
        options.append(st.integers(1, 17).map(lambda o: Layout("offset", offset=o)))
    if rank and "expanded" in allowed:
        options.append(st.integers(0, rank - 1).map(lambda d: Layout("expanded", dims=(d,))))
    return st.one_of(options)


def dists() -> st.SearchStrategy[Dist]:
    plain = st.sampled_from([d for d in DISTRIBUTIONS if d not in ("scaled", "shifted")]).map(Dist)
    scaled = st.sampled_from((1e-2, 1e2, 1e4)).map(lambda f: Dist("scaled", (("factor", f),)))
    shifted = st.sampled_from((5.0, -5.0, 100.0)).map(lambda s: Dist("shifted", (("shift", s),)))
    return st.one_of(st.just(Dist()), plain, scaled, shifted)


def injections(numel: int, names: list[str]) -> st.SearchStrategy[tuple]:
    if numel == 0 or not names:
        return st.just(())
    item = st.tuples(st.integers(0, numel - 1), st.sampled_from(names))
    return st.lists(item, max_size=3, unique_by=lambda x: x[0]).map(lambda xs: tuple(sorted(xs)))


@st.composite
def cases(draw, target: Target) -> Case:
    """A valid case for ``target``."""
    for _ in range(20):
        dims = {name: draw(sizes(d)) for name, d in target.dims.items()}
        if target.constraint is None or not target.constraint(dims):
            break
    else:
        dims = {name: d.lo + (-d.lo) % d.multiple_of for name, d in target.dims.items()}
    dtype = draw(st.sampled_from(target.dtypes))
    args = {}
    for name, arg in target.args.items():
        args[name] = ArgCase(layout=draw(layouts(len(arg.shape), arg.layouts)), dist=draw(dists()),
                             inject=draw(injections(target.numel(name, dims), target.special_names(name, dtype))))
    case = Case.make(target.name, dtype, draw(st.integers(0, 2**32 - 1)), dims, args)
    target.validate(case)
    return case
