"""The scalar and vector log gates inside one chunk of the GDN backward, and the scalar gate's gradient.

The cumulative gate G of a chunk and its last row G_C (``_load_gate``); for the scalar
gate the float64 prefix sums kept as hi + lo fp32 (``_gate_sums``) and the decay
factors built from them (``_pair_decay``, ``_end_decay``); and dg as the sum of the
decay terms spanning each step (``_gate_grad``; per key for the vector gate,
``_pair_spans_k`` and ``_gate_grad_of_spans_k``).  Refuses nothing: the flags of
``gdn.bwd_matrix._prep`` send non-finite or too steep gates to the exact path.
"""
from __future__ import annotations

import triton
import triton.language as tl

from gdn.common import GATE_FLOOR, tile

_FLOOR = tl.constexpr(GATE_FLOOR)   # a constexpr: jit functions read no other module globals


@triton.jit
def _load_gate(g, tok, r0, rv, ih, H, K, ck, mk, GATE: tl.constexpr):
    """In-chunk cumulative gate G ([C] or [C, BK]) and its last row G_C (r0: the chunk's
    base row, as `gdn.common.tile` takes it)."""
    rows = tl.arange(0, tok.shape[0])
    if GATE == 1:
        b_g = tl.load(g + tok.to(tl.int64) * H + ih, mask=rv, other=0.).to(tl.float32)
        G = tl.cumsum(b_g, 0)
        GC = tl.sum(tl.where(rows == tok.shape[0] - 1, G, 0.), 0)
    else:
        b_g = tl.load(tile(g, r0, rows, ck, K, H), mask=rv[:, None] & mk[None, :], other=0.).to(tl.float32)
        G = tl.cumsum(b_g, 0)
        GC = tl.sum(tl.where(rows[:, None] == tok.shape[0] - 1, G, 0.), 0)
    return G, GC


@triton.jit
def _gate_sums(g, tok, rv, ih, H):
    """A scalar gate's in-chunk prefix sums as the forward keeps them: gates clamped at
    GATE_FLOOR, summed in float64, held as hi + lo fp32: (G, G lo, G_C, G_C lo).  The
    differences G_i - G_j and G_C - G_i then keep their digits when the sums are large: an
    fp32 running sum of gates ~ -100 a step (G ~ -1e3) put ~1e-4 relative errors in decay
    factors, every gradient 5-14x the trusted reference's error (crashes/gdn_bwd/bound-dv).  Clamping
    changes no fp32 decay (exp(-110) is 0) and keeps a huge finite gate from absorbing its
    neighbours.  A scan here, not the forward's stored sums: loading those added spills to
    the sequential kernels (sm_90 offline: _dstates 2248 -> 4168 stack bytes; this 2504)."""
    rows = tl.arange(0, tok.shape[0])
    b_g = tl.load(g + tok.to(tl.int64) * H + ih, mask=rv, other=0.).to(tl.float32)
    G64 = tl.cumsum(tl.maximum(b_g, _FLOOR).to(tl.float64), 0)
    G = G64.to(tl.float32)
    Gl = (G64 - G.to(tl.float64)).to(tl.float32)
    last = rows == tok.shape[0] - 1
    return G, Gl, tl.sum(tl.where(last, G, 0.), 0), tl.sum(tl.where(last, Gl, 0.), 0)


@triton.jit
def _pair_decay(G, Gl, mask):
    """exp(G_i - G_j) under a causal mask, 0 elsewhere (scalar gate, sums as hi + lo)."""
    return tl.exp(tl.where(mask, (G[:, None] - G[None, :]) + (Gl[:, None] - Gl[None, :]), float("-inf")))


@triton.jit
def _end_decay(G, Gl, GC, GCl):
    """exp(G_C - G_i) (scalar gate, sums as hi + lo)."""
    return tl.exp((GC - G) + (GCl - Gl))


@triton.jit
def _gate_grad(first, pairs, last, through):
    """dg of a chunk's scalar gate from its decay terms, each summed where it belongs.

    A term with decay exp(G_i - G_j) (i after j) depends on g_t for j < t <= i only, so
    dg_t = sum of the terms spanning t: ``first[i]`` (i >= t; from the entry state, j = -1),
    ``pairs[i, j]`` (strictly lower), ``last[j]`` (j < t; to the end state, i = C) and
    ``through`` (entry to end, every t).  The textbook form (row sums minus column sums of
    the pair terms, then a reverse cumsum) has each term enter with both signs, so at large
    |dk| (~1e4, shifted inputs) the sums cancel to a ~1e-4 absolute error in dg ~1 that the
    float64 autograd of the trusted reference does not make; here no term enters twice.

    The pair terms are summed along rows, then down the columns, then shifted by one:
    Z[u] = sum_{i > u} sum_{j <= u} pairs[i, j] + sum_{j <= u} last[j], and dg_t takes
    Z[t - 1].  A reverse scan down the columns would cross the four warps of the layout
    Triton 3.6 gives the [C, C] tile on sm_90, with a shuffle at every step; the row sums and
    the cumsum here take a few.
    """
    return _gate_grad_of_spans(first, _pair_spans(pairs), last, through)


@triton.jit
def _pair_spans(pairs):
    """sum_{i > u} sum_{j <= u} pairs[i, j], per u: the part of `_gate_grad` that needs the
    [C, C] pair terms, so that a kernel can reduce them to [C] before its other terms exist."""
    r = tl.arange(0, pairs.shape[0])
    return tl.sum(tl.where(r[:, None] > r[None, :], tl.cumsum(pairs, 1), 0.), 0)


@triton.jit
def _pair_spans_k(pairs):
    """`_pair_spans` per key, for the vector gate: pairs [C, C, BK] (token i, token j, key) ->
    sum_{i > u} sum_{j <= u} pairs[i, j, :], [C, BK]."""
    r = tl.arange(0, pairs.shape[0])
    return tl.sum(tl.where((r[:, None] > r[None, :])[:, :, None], tl.cumsum(pairs, 1), 0.), 0)


@triton.jit
def _gate_grad_of_spans_k(first, spans, last, through):
    """`_gate_grad_of_spans` per key, for the vector gate: first, spans and last [C, BK],
    through [BK] -> dg [C, BK]."""
    r = tl.arange(0, first.shape[0])
    Z = spans + tl.cumsum(last, 0)
    before = tl.broadcast_to(tl.maximum(r - 1, 0)[:, None], Z.shape)
    spanned = tl.where(r[:, None] > 0, tl.gather(Z, before, 0), 0.)
    return tl.cumsum(first, 0, reverse=True) + spanned + through[None, :]


@triton.jit
def _gate_grad_of_spans(first, spans, last, through):
    """`_gate_grad` from the pair terms' `_pair_spans`."""
    r = tl.arange(0, first.shape[0])
    Z = spans + tl.cumsum(last, 0)
    spanned = tl.where(r > 0, tl.gather(Z, tl.maximum(r - 1, 0), 0), 0.)
    return tl.cumsum(first, 0, reverse=True) + spanned + through

