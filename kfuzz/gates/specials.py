"""One special value in one argument: the single-injection cases of G05 (nonfinite) and G06 (range).

A value injected into every argument at once makes almost every output of the
oracle NaN, and a kernel that spreads a NaN to the wrong places hides there.
So each case here puts ONE value into ONE float argument, at a position where
its spread shows: the middle of every dim, each dim at its first and its last
index with the others in the middle, and the first and the last element
(sequence and reduction positions are dims like any other). A causal kernel
whose NaN at position t reaches outputs before t, or a chunked one whose -inf
gate turns its whole chunk NaN, fails such a case.

Values follow the target's domain rules (``Target.domain``, applied before
injection): a value is injected where the domain maps it to a value of the same
kind, and as what the domain makes of it. A log-space gate g = -softplus(x)
maps +inf to -inf (a complete forget), so -inf goes into g; keys normalized
over a dim map an Inf to NaN, so no Inf goes into them; a position the domain
always zeroes (a triangular matrix) gets none. Without domain rules every value
goes everywhere.

When an argument has many such positions, they are taken in the order above
and the values cycled over them, so each argument gets an equal share of the
``SINGLE_CASES`` cases a dtype allows, every position at least one value where
the share allows, and every value several positions.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from kfuzz.case import ArgCase, Case, Dist
from kfuzz.dtypes import special_value_table, torch_dtype
from kfuzz.target import Target
from kfuzz.tensors import draw, rng_for

SINGLE_CASES = 59        # single-injection cases a dtype (a gate adds its other cases to reach ~60)
PROBE_SEED = 0x5EC1A1    # the draw the domain sees around a probed value


def probe_positions(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Index tuples where one value's spread shows: the middle of every dim, then each dim at its
    first and last index (the others in the middle), then the first and the last element."""
    mid = tuple(n // 2 for n in shape)
    out = [mid]
    for d, n in enumerate(shape):
        for i in (0, n - 1):
            out.append(mid[:d] + (i,) + mid[d + 1:])
    out += [tuple(0 for _ in shape), tuple(n - 1 for n in shape)]
    return list(dict.fromkeys(out))


def _probe(target: Target, name: str, dims: dict[str, int], flat: int, value: float) -> float:
    """What ``value`` at flat position ``flat`` of ``name`` becomes through the domain rules."""
    if target.domain is None:
        return value
    drawn = {}
    for n, arg in target.args.items():
        shape = target.shape_of(arg.shape, dims)
        drawn[n] = torch.from_numpy(np.ascontiguousarray(
            draw(Dist(), shape, target.arg_dtype(n, "float32"), rng_for(PROBE_SEED, n)), dtype=np.float64))
    drawn[name].reshape(-1)[flat] = value
    out = target.domain(dict(drawn), dims).get(name, drawn[name])
    return float(out.reshape(-1)[flat])


def nonfinite_value(table: dict, value: float) -> str | None:
    """The special's name for a nonfinite ``value`` (G05's kind of value), else None."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        name = "inf" if value > 0 else "-inf"
        return name if table[name] is not None else None
    return None


def extreme_value(table: dict, value: float, dtype: str):
    """``value`` rounded to ``dtype`` if its magnitude is the dtype's largest, smallest normal or
    smallest subnormal (G06's kind of value): the special's name where it has one, else the number."""
    if not math.isfinite(value):
        return None
    r = float(torch.tensor(value, dtype=torch.float64).to(torch_dtype(dtype)))
    for name in ("max", "-max", "tiny", "subnormal"):
        if table[name] is not None and r == table[name]:
            return name
    if any(table[n] is not None and abs(r) == table[n] for n in ("tiny", "subnormal")):
        return r
    return None


def single_injections(target: Target, dtype: str, dims: dict[str, int], names: list[str], values: tuple[str, ...],
                      keep: Callable[[dict, float, str], object], budget: int = SINGLE_CASES
                      ) -> list[tuple[str, int, object]]:
    """(argument, flat position, value) for up to ``budget`` cases: ``values`` (special names) put
    through the domain and kept as ``keep(table, what the domain made of it, dtype)`` says (None: not
    injected there)."""
    per_arg: list[list[tuple[str, int, object]]] = []
    for name in names:
        adt = target.arg_dtype(name, dtype)
        table = special_value_table(adt)
        shape = target.shape_of(target.args[name].shape, dims)
        chosen = [v for v in values if table.get(v) is not None]
        plans = []
        for pos in probe_positions(shape):
            flat = int(np.ravel_multi_index(pos, shape)) if shape else 0
            legal = list(dict.fromkeys(
                k for k in (keep(table, _probe(target, name, dims, flat, table[v]), adt) for v in chosen)
                if k is not None))
            plans.append((flat, legal))
        ordered = []
        for rnd in range(max((len(v) for _, v in plans), default=0)):
            for i, (flat, legal) in enumerate(plans):
                if rnd < len(legal):
                    ordered.append((name, flat, legal[(i + rnd) % len(legal)]))
        per_arg.append(ordered)
    out, depth = [], 0
    while len(out) < budget and any(depth < len(a) for a in per_arg):
        out += [a[depth] for a in per_arg if depth < len(a)][:budget - len(out)]
        depth += 1
    return out


def single_case_args(name: str, flat: int, value) -> dict[str, ArgCase]:
    return {name: ArgCase(inject=((flat, value),))}


def describe_injection(target: Target, case: Case) -> str:
    """Which argument, value and position a case injects into (for a failure's detail)."""
    injected = [(n, a.inject) for n, a in case.args if a.inject]
    if len(injected) == 1 and len(injected[0][1]) == 1:
        (name, ((flat, value),)), = injected
        shape = target.shape_of(target.args[name].shape, case.dim)
        index = tuple(int(i) for i in np.unravel_index(flat, shape)) if shape else ()
        dims = [str(d) for d in target.args[name].shape]
        return f"{value} in {name!r} at index {index} of [{', '.join(dims)}]"
    if injected:
        return "specials in " + ", ".join(f"{n!r}" for n, _ in injected)
    drawn = [f"{n!r} drawn from {a.dist.to_json()}" for n, a in case.args if a.dist.kind != "normal"]
    return ", ".join(drawn) or "no special value"

