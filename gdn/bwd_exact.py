"""The step-by-step path of the GDN backward: the recurrence one token at a time, as gdn.oracle writes it.

``_exact_step`` and ``_exact_dstep`` advance the state, or carry the state gradient
back, by one token: the sequential kernels (gdn.bwd_matrix ``_states``, ``_dstates``)
take them inside flagged chunks and wherever the incoming state or its gradient is
outside +-SBIG.  ``_exact`` then rewrites every gradient of a flagged chunk by autograd
of the oracle's step, op for op, in float64, so the NaN/Inf pattern of a special value
is the one float64 autograd through the oracle gives.  It steps each token about three
times, in float64, and is meant only for the few chunks the flags name, never for the bulk.
"""
from __future__ import annotations

import triton
import triton.language as tl

from gdn.bwd_chunks import _chunk_base, _coords
from gdn.common import group_flag, mask_and, tile


@triton.jit
def _exact_step(S, k, v, g, beta, t, ih, H, K, V, ck, mk, cv, mv, GATE: tl.constexpr,
                DELTA: tl.constexpr):
    """One step of the recurrence on a [BK, BV] block of S, as gdn.oracle writes it, in S's
    precision (float64: the sequential kernels convert their fp32 state for a stepped chunk)."""
    tt = (t * H + ih).to(tl.int64)
    b_k = tl.load(k + tt * K + ck, mask=mk, other=0.).to(S.dtype)
    b_v = tl.load(v + tt * V + cv, mask=mv, other=0.).to(S.dtype)
    if GATE == 1:
        S = _in_tile(tl.exp(tl.load(g + tt).to(S.dtype)) * S, mk, mv)
    elif GATE == 2:
        S = _in_tile(tl.exp(tl.load(g + tt * K + ck, mask=mk, other=0.).to(S.dtype))[:, None] * S,
                     mk, mv)
    if DELTA:
        bk = tl.where(mk, tl.load(beta + tt).to(S.dtype) * b_k, 0.)
        x = tl.sum(b_k[:, None] * S, 0)
        S = S - bk[:, None] * x[None, :] + bk[:, None] * b_v[None, :]
    else:
        S = S + b_k[:, None] * b_v[None, :]
    return _in_tile(S, mk, mv)


@triton.jit
def _in_tile(X, mk, mv):
    """X with the padding rows (keys past K) and columns (values past V) of its tile 0: a
    padded key or value is a loaded 0, and 0 times an Inf of the token's other factor is a NaN
    that the next step's sums over keys (or the gradients' over values) would carry into the
    tile's real entries, where the recurrence has no such term."""
    return tl.where(mk[:, None] & mv[None, :], X, 0.)


@triton.jit
def _exact_dstep(dS, q, k, g, beta, do, t, ih, H, K, V, scale, ck, mk, cv, mv,
                 GATE: tl.constexpr, DELTA: tl.constexpr):
    """The state gradient before step t from the one after it (autograd's order), in dS's
    precision (float64, as `_exact_step`)."""
    tt = (t * H + ih).to(tl.int64)
    b_q = tl.load(q + tt * K + ck, mask=mk, other=0.).to(dS.dtype) * scale
    b_do = tl.load(do + tt * V + cv, mask=mv, other=0.).to(dS.dtype)
    dS = _in_tile(dS + b_q[:, None] * b_do[None, :], mk, mv)
    if DELTA:
        b_k = tl.load(k + tt * K + ck, mask=mk, other=0.).to(dS.dtype)
        bk = tl.where(mk, tl.load(beta + tt).to(dS.dtype) * b_k, 0.)
        dx = tl.sum(-dS * bk[:, None], 0)
        dS = _in_tile(dS + b_k[:, None] * dx[None, :], mk, mv)
    if GATE == 1:
        dS = _in_tile(tl.exp(tl.load(g + tt).to(dS.dtype)) * dS, mk, mv)
    elif GATE == 2:
        dS = _in_tile(tl.exp(tl.load(g + tt * K + ck, mask=mk, other=0.).to(dS.dtype))[:, None] * dS,
                      mk, mv)
    return dS


@triton.jit
def _rounded(x, out):
    """A float64 gradient in ``out``'s dtype, through fp32: Triton 3.9's interpreter turns
    float64 into bf16 wrongly (kfuzz G02 on gdn_bwd_kda: inf and 2x-off dq), and fp32 holds
    every bf16/fp16 value and overflow the same way."""
    return x.to(tl.float32).to(out.dtype.element_ty)


SEG = tl.constexpr(8)   # tokens a segment of `_exact_chunk`'s two-level recompute


@triton.jit
def _bits(S):
    return S.to(tl.int64, bitcast=True)


@triton.jit
def _keep(kept, at, S, when):
    """``kept`` ([N, BK, BV] state bits) with S's bits at the rows ``at`` names, if ``when``."""
    return tl.where(at[:, None, None] & when, _bits(S)[None, :, :], kept)


@triton.jit
def _kept(kept, at):
    """The state kept at the one row ``at`` names, bit for bit."""
    return tl.sum(tl.where(at[:, None, None], kept, 0), 0).to(tl.float64, bitcast=True)


@triton.jit
def _exact_token(S, dS, acc_dq, acc_dk, acc_dgv, acc_dg, acc_db, t, r, rows, ih, q, k, v, g, beta,
                 do, dv, scale, H, K, V, ck, mk, cv, mv, GATE: tl.constexpr, DELTA: tl.constexpr):
    """Autograd of token t's step (the r-th of its chunk) on a [BK, BV] block, in float64: S is
    the state before the step, dS the state gradient after it; returns the gradient before it
    and the accumulators with the token's row added (its dv is stored here)."""
    tt = (t * H + ih).to(tl.int64)
    b_k = tl.load(k + tt * K + ck, mask=mk, other=0.).to(tl.float64)
    b_v = tl.load(v + tt * V + cv, mask=mv, other=0.).to(tl.float64)
    b_q = tl.load(q + tt * K + ck, mask=mk, other=0.).to(tl.float64) * scale
    b_do = tl.load(do + tt * V + cv, mask=mv, other=0.).to(tl.float64)
    if GATE == 1:
        a = tl.exp(tl.load(g + tt).to(tl.float64))
        S1 = _in_tile(a * S, mk, mv)
    elif GATE == 2:
        av = tl.exp(tl.load(g + tt * K + ck, mask=mk, other=0.).to(tl.float64))
        S1 = _in_tile(av[:, None] * S, mk, mv)
    else:
        S1 = S
    if DELTA:
        bt = tl.load(beta + tt).to(tl.float64)
        bk = tl.where(mk, bt * b_k, 0.)
        # x and dx 0 in the padding columns: there S1 and dS2 are 0, so an infinite key makes
        # their sums over keys 0 * Inf = NaN, which dbk's and dk's sums over values would carry
        # to every key (the recurrence has no such term)
        x = tl.where(mv, tl.sum(b_k[:, None] * S1, 0), 0.)
        S2 = _in_tile(S1 - bk[:, None] * x[None, :] + bk[:, None] * b_v[None, :], mk, mv)
    else:
        S2 = _in_tile(S1 + b_k[:, None] * b_v[None, :], mk, mv)
    dS2 = _in_tile(dS + b_q[:, None] * b_do[None, :], mk, mv)
    dqt = tl.sum(S2 * b_do[None, :], 1)
    if DELTA:
        dbk = tl.where(mk, tl.sum(dS2 * b_v[None, :], 1) + tl.sum(-dS2 * x[None, :], 1), 0.)
        dvt = tl.sum(dS2 * bk[:, None], 0)
        dx = tl.where(mv, tl.sum(-dS2 * bk[:, None], 0), 0.)
        dkt = tl.sum(S1 * dx[None, :], 1) + bt * dbk
        acc_db += tl.where(rows == r, tl.sum(dbk * b_k, 0), 0.)
        dS1 = _in_tile(dS2 + b_k[:, None] * dx[None, :], mk, mv)
    else:
        dkt = tl.sum(dS2 * b_v[None, :], 1)
        dvt = tl.sum(dS2 * b_k[:, None], 0)
        dS1 = dS2
    if GATE == 1:
        acc_dg += tl.where(rows == r, tl.sum(tl.sum(dS1 * S, 1), 0), 0.)
        dS = _in_tile(a * dS1, mk, mv)
    elif GATE == 2:
        acc_dgv += tl.where(rows[:, None] == r, tl.sum(dS1 * S, 1)[None, :], 0.)
        dS = _in_tile(av[:, None] * dS1, mk, mv)
    else:
        dS = dS1
    acc_dq += tl.where(rows[:, None] == r, dqt[None, :], 0.)
    acc_dk += tl.where(rows[:, None] == r, dkt[None, :], 0.)
    tl.store(dv + tt * V + cv, _rounded(dvt, dv), mask=mv)
    return dS, acc_dq, acc_dk, acc_dgv, acc_dg, acc_db


@triton.jit
def _exact_chunk(cid, ih, q, k, v, g, beta, do, h0, dht, hs, hexp, dhs, dexp, dq, dk, dv, dg, dbeta,
                 cu, tab, scale, T, H, K, V, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 GATE: tl.constexpr, DELTA: tl.constexpr, IS_VARLEN: tl.constexpr,
                 HAS_H0: tl.constexpr, HAS_DHT: tl.constexpr):
    """Step-by-step gradients of a flagged chunk: autograd of gdn.oracle's step,
    op for op, in float64 as the oracle computes, each gradient rounded once when stored.
    (In fp32, dbeta k = dS v - dS x overflowed at near-max q where the oracle's dk, 1e38,
    is finite: crashes/gdn_bwd/nonfinite-dk.)  The states before the tokens are recomputed
    from the chunk's entry state in two levels: one pass keeps the state at the start of every
    SEG-token segment, then each segment, last first, is stepped again to keep its SEG states,
    which the token's autograd (`_exact_token`) reads in reverse.  A state is kept as its bits,
    so the one read back is the one stepped (signed zeros and NaN included).  The chunk's entry
    state is hs 2^hexp and its end's state gradient dhs 2^dexp (dhs fp32), exact in float64
    where the sequential kernels handed on a value past fp32's range; a sequence's first chunk
    enters from h0 and its last ends at dht, read as given as the oracle's recurrence starts
    from them (hs holds h0 in the hand-off dtype).  Neither dht nor dhs is the bf16 hand-off
    copy: a bf16 rounding of the state gradient the step path ends at can flip the sign of one
    that cancels, which decides between NaN (inf - inf) and an Inf in dk beside an infinite state
    (crashes/gdn_bwd/nonfinite-dk/626b0430c43cde9a: dht about 100, the state gradient -0.0104
    at token 0 from the fp32 dht, +0.0285 from its bf16 rounding; at a chunk boundary inside a
    sequence, crashes/gdn_bwd_kda/nonfinite-dk/deecb84d4e4daab8).  About 2C steps a V tile,
    against C^2/2 recomputing each state from the entry state."""
    NSEG: tl.constexpr = C // SEG
    n, ic, bos, eos = _coords(cid, T, cu, tab, C, IS_VARLEN)
    rows = tl.arange(0, C)
    segs = tl.arange(0, NSEG)
    offs = tl.arange(0, SEG)
    t0 = bos + ic * C
    te = tl.minimum(t0 + C, eos)
    tok = t0 + rows
    rv = tok < eos
    ck = tl.arange(0, BK)
    mk = ck < K
    mqk = rv[:, None] & mk[None, :]
    r0 = _chunk_base(t0, ih, H)
    acc_dq = tl.zeros([C, BK], dtype=tl.float64)
    acc_dk = tl.zeros([C, BK], dtype=tl.float64)
    acc_dgv = tl.zeros([C, BK], dtype=tl.float64)
    acc_dg = tl.zeros([C], dtype=tl.float64)
    acc_db = tl.zeros([C], dtype=tl.float64)
    hbase = (cid * H + ih).to(tl.int64) * K * V
    sbase = (n * H + ih).to(tl.int64) * K * V   # the sequence's h0 and dht
    first = ic == 0
    last = te == eos
    for iv in range(0, tl.cdiv(V, BV)):
        cv = iv * BV + tl.arange(0, BV)
        mv = cv < V
        mkv = mk[:, None] & mv[None, :]
        offkv = ck[:, None] * V + cv[None, :]
        ebase = (cid * H + ih).to(tl.int64) * V + cv   # the exponents: hs 2^hexp, dhs 2^dexp
        S = tl.load(hs + hbase + offkv, mask=mkv, other=0.).to(tl.float64) \
            * tl.exp2(tl.load(hexp + ebase, mask=mv, other=0).to(tl.float64))[None, :]
        dS = tl.load(dhs + hbase + offkv, mask=mkv, other=0.).to(tl.float64) \
            * tl.exp2(tl.load(dexp + ebase, mask=mv, other=0).to(tl.float64))[None, :]
        if HAS_H0:   # a sequence's first chunk: h0 as given
            S0 = tl.load(h0 + sbase + offkv, mask=mask_and(mkv, first), other=0.)
            S = tl.where(first, S0.to(tl.float64), S)
        if HAS_DHT:   # a sequence's last chunk: dht as given
            dS0 = tl.load(dht + sbase + offkv, mask=mask_and(mkv, last), other=0.)
            dS = tl.where(last, dS0.to(tl.float64), dS)
        starts = tl.zeros([NSEG, BK, BV], dtype=tl.int64)
        for u in range(t0, te):
            starts = _keep(starts, segs == (u - t0) // SEG, S, (u - t0) % SEG == 0)
            S = _exact_step(S, k, v, g, beta, u, ih, H, K, V, ck, mk, cv, mv, GATE, DELTA)
        for sg in range(0, NSEG):
            s0 = t0 + (NSEG - 1 - sg) * SEG
            se = tl.minimum(s0 + SEG, te)
            S = _kept(starts, segs == NSEG - 1 - sg)
            states = tl.zeros([SEG, BK, BV], dtype=tl.int64)
            for u in range(s0, se):
                states = _keep(states, offs == u - s0, S, True)
                S = _exact_step(S, k, v, g, beta, u, ih, H, K, V, ck, mk, cv, mv, GATE, DELTA)
            for s in range(0, se - s0):
                t = se - 1 - s
                dS, acc_dq, acc_dk, acc_dgv, acc_dg, acc_db = _exact_token(
                    _kept(states, offs == t - s0), dS, acc_dq, acc_dk, acc_dgv, acc_dg, acc_db, t,
                    t - t0, rows, ih, q, k, v, g, beta, do, dv, scale, H, K, V, ck, mk, cv, mv,
                    GATE, DELTA)
    tl.store(tile(dq, r0, rows, ck, K, H), _rounded(acc_dq * scale, dq), mask=mqk)
    tl.store(tile(dk, r0, rows, ck, K, H), _rounded(acc_dk, dk), mask=mqk)
    # the gate's factor exp(g) after the sum over every V tile, as the recurrence's autograd
    # takes it: times each tile's part, an infinite gate (+inf, out of the domain) would give
    # inf - inf = NaN where two tiles' parts have opposite signs and the oracle's dg is an Inf
    if GATE == 1:
        a = tl.exp(tl.load(g + tok.to(tl.int64) * H + ih, mask=rv, other=0.).to(tl.float64))
        tl.store(dg + tok.to(tl.int64) * H + ih, _rounded(acc_dg * a, dg), mask=rv)
    elif GATE == 2:
        av = tl.exp(tl.load(tile(g, r0, rows, ck, K, H), mask=mqk, other=0.).to(tl.float64))
        tl.store(tile(dg, r0, rows, ck, K, H), _rounded(acc_dgv * av, dg), mask=mqk)
    if DELTA:
        tl.store(dbeta + tok.to(tl.int64) * H + ih, _rounded(acc_db, dbeta), mask=rv)


@triton.jit
def _exact(q, k, v, g, beta, do, h0, dht, flag, hflag, dflag, hs, hexp, dhs, dexp, dq, dk, dv, dg, dbeta,
           cu, tab, scale, T, H, K, V, NV, NVD, NC, C: tl.constexpr, BK: tl.constexpr,
           BV: tl.constexpr, G: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr,
           IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr, HAS_DHT: tl.constexpr):
    """Step-by-step gradients of the flagged chunks (`_exact_chunk`), G chunks of a head a
    program: their flags read in one load, the flagged ones then taken in turn.  Nearly every
    chunk is unflagged, so nearly every program ends after that load (a program a chunk would
    launch thousands of programs, two an SM at 255 registers, to do nothing)."""
    ih = tl.program_id(1)
    c0 = tl.program_id(0) * G
    cs = c0 + tl.arange(0, G)
    cv0 = tl.arange(0, 16)   # NV, NVD (_states's and _dstates's V tiles) <= 16
    mc = cs < NC
    row = cs * H + ih
    bad = tl.load(flag + row, mask=mc, other=0)
    bad += tl.sum(tl.load(hflag + row[:, None] * NV + cv0[None, :],
                          mask=mc[:, None] & (cv0 < NV)[None, :], other=0), 1)
    bad += tl.sum(tl.load(dflag + row[:, None] * NVD + cv0[None, :],
                          mask=mc[:, None] & (cv0 < NVD)[None, :], other=0), 1)
    if tl.max(bad, 0) > 0:
        for j in range(0, G):
            if group_flag(bad, cs, c0 + j) > 0:
                _exact_chunk(c0 + j, ih, q, k, v, g, beta, do, h0, dht, hs, hexp, dhs, dexp, dq, dk,
                             dv, dg, dbeta, cu, tab, scale, T, H, K, V, C, BK, BV, GATE, DELTA,
                             IS_VARLEN, HAS_H0, HAS_DHT)
