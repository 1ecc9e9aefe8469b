"""Triton backward of the GDN family: every gradient, the reverse-in-time stage too.

    chunk_gdn_bwd(q, k, v, g, beta, do, dht, ...) -> (dq, dk, dv, dg, dbeta, dh0)

Nothing from the forward is stored: the backward recomputes what it needs,
chunk by chunk (C tokens), in five launches.

1. ``_prep``   (chunks in parallel)  flags every chunk whose inputs are not all
   finite (or whose cumulative gate is too steep for the factored vector-gate
   form), and for the delta rule builds the WY form of the chunk: the inverse
   T = (I + A)^-1 of the unit lower triangular system, W = T diag(beta) K_g and
   Uu = T diag(beta) V.
2. ``_states`` (sequential over chunks)  recomputes the state entering every
   chunk, h_c, and the chunk's effective values U = Uu - W h_c.
3. ``_dstates`` (sequential, reverse time)  carries the state gradient dS
   backward over the chunks; stores dS at every chunk end and dU, the full
   gradient of U (delta rule) or dv (no delta); writes dh0.
4. ``_grads``  (chunks in parallel)  all the remaining gradients of a chunk
   from h_c, its end-state gradient, U and dU: dq, dk, dv, dbeta, dg.
5. ``_exact``  (chunks in parallel)  rewrites the gradients of flagged chunks
   with the step-by-step recurrence, the same operations as gdn.oracle in the
   same order and in float64, so the NaN/Inf pattern of a special value is the
   one float64 autograd through the oracle gives.  Kernels 2 and 3 take the same exact
   step path inside flagged chunks, and for any chunk whose incoming state or
   state gradient is not finite.

Columns of S (the value dimension) evolve independently, so the sequential
kernels split V across programs.  No atomics: every output element is written
by exactly one program, so results are bitwise reproducible.

Chunk algebra (one chunk, G the in-chunk cumulative log gate, scale folded
into q; for the scalar gate G is a float64 sum kept as hi + lo fp32, the pair
factors exp(G_i - G_j) are formed elementwise under the causal mask, so nothing
overflows, and dg_t sums the decay terms spanning step t, see ``_gate_grad``):

    A = strict_lower(diag(beta) (K_g K_n^T)),  T = (I + A)^-1
    U = T diag(beta) V - T diag(beta) K_g h     (U = V without delta)
    O = Q_g h + incl_lower(Q_g K_n^T) U
    S_end = exp(G_C) h + K_end^T U
with K_g = K exp(G), K_n = K exp(-G), K_end = K exp(G_C - G).

Refuses: K or V over 256, cu_seqlens with B != 1; shapes follow gdn.oracle.
"""
from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

from gdn.chunk_fwd import BIG, GATE_FLOOR, SBIG, VECTOR_DECAY_MAX, _inv_unit_lower, handoff_dtype

_FLOOR = tl.constexpr(GATE_FLOOR)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# launch configuration for the GPU (fixed, not autotuned: one compile per shape
# class, and the interpreter runs the same code); benchmarks may override it
LAUNCH = {"prep_warps": 4, "grads_warps": 8, "grads_stages": 2, "grads_bv": 64, "seq_warps": 4}
LAUNCH.update(json.loads(os.environ.get("GDN_BWD_LAUNCH", "{}")))   # device bring-up overrides


@triton.jit
def _mm(a, b, F32: tl.constexpr, DT: tl.constexpr):
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def _coords(cid, T, cu, tab, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(sequence, chunk within it, first token, end token) of a global chunk id."""
    if IS_VARLEN:
        n = tl.load(tab + cid * 2).to(tl.int32)
        ic = tl.load(tab + cid * 2 + 1).to(tl.int32)
        bos = tl.load(cu + n).to(tl.int32)
        eos = tl.load(cu + n + 1).to(tl.int32)
    else:
        nt = tl.cdiv(T, C)
        n = cid // nt
        ic = cid % nt
        bos = n * T
        eos = bos + T
    return n, ic, bos, eos


@triton.jit
def _seq(n, T, cu, coff, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(first token, end token, global id of its first chunk) of sequence n."""
    if IS_VARLEN:
        bos = tl.load(cu + n).to(tl.int32)
        eos = tl.load(cu + n + 1).to(tl.int32)
        cbase = tl.load(coff + n).to(tl.int32)
    else:
        bos = n * T
        eos = bos + T
        cbase = n * tl.cdiv(T, C)
    return bos, eos, cbase


@triton.jit
def _load_gate(g, tok, rv, ih, H, K, ck, mk, GATE: tl.constexpr):
    """In-chunk cumulative gate G ([C] or [C, BK]) and its last row G_C."""
    rows = tl.arange(0, tok.shape[0])
    if GATE == 1:
        b_g = tl.load(g + tok.to(tl.int64) * H + ih, mask=rv, other=0.).to(tl.float32)
        G = tl.cumsum(b_g, 0)
        GC = tl.sum(tl.where(rows == tok.shape[0] - 1, G, 0.), 0)
    else:
        b_g = tl.load(g + (tok[:, None].to(tl.int64) * H + ih) * K + ck[None, :],
                      mask=rv[:, None] & mk[None, :], other=0.).to(tl.float32)
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
def _outside(x, bound):
    """How many elements of a 2-D block are not within [-bound, bound] (NaN counts)."""
    return tl.sum(tl.sum(tl.where(tl.abs(x) <= bound, 0, 1), 1), 0)


@triton.jit
def _prep(q, k, v, g, beta, do, flag, Tm, W, U, cu, tab, T, H, K, V,
          C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
          DELTA: tl.constexpr, IS_VARLEN: tl.constexpr, F32: tl.constexpr, DT: tl.constexpr,
          GLIM: tl.constexpr, PREC: tl.constexpr, BIG: tl.constexpr):
    cid = tl.program_id(0)
    ih = tl.program_id(1)
    n, ic, bos, eos = _coords(cid, T, cu, tab, C, IS_VARLEN)
    rows = tl.arange(0, C)
    tok = bos + ic * C + rows
    rv = tok < eos
    ck = tl.arange(0, BK)
    mk = ck < K
    mqk = rv[:, None] & mk[None, :]
    tq = tok[:, None].to(tl.int64) * H + ih
    b_q = tl.load(q + tq * K + ck[None, :], mask=mqk, other=0.).to(tl.float32)
    b_k = tl.load(k + tq * K + ck[None, :], mask=mqk, other=0.).to(tl.float32)
    bad = _outside(b_q, BIG) + _outside(b_k, BIG)
    b_beta = tl.zeros([C], dtype=tl.float32)
    if DELTA:
        b_beta = tl.load(beta + tok.to(tl.int64) * H + ih, mask=rv, other=0.).to(tl.float32)
        bad += _outside(b_beta[:, None], BIG)
    strict = rows[:, None] > rows[None, :]
    if GATE == 1:
        G, GC = _load_gate(g, tok, rv, ih, H, K, ck, mk, GATE)
        bad += _outside(G[:, None], 3.0e38)
        G, Gl, GC, GCl = _gate_sums(g, tok, rv, ih, H)
        kb = b_k * (b_beta * tl.exp(G))[:, None]
        araw = _mm(b_k, tl.trans(b_k), F32, DT) * _pair_decay(G, Gl, strict)
    elif GATE == 2:
        G, GC = _load_gate(g, tok, rv, ih, H, K, ck, mk, GATE)
        bad += _outside(G, 3.0e38)
        bad += tl.where(tl.min(GC, 0) < -GLIM, 1, 0)
        kg = b_k * tl.exp(G)
        kb = kg * b_beta[:, None]
        araw = tl.where(strict, _mm(kg, tl.trans(b_k * tl.exp(-G)), F32, DT), 0.)
    else:
        kb = b_k * b_beta[:, None]
        araw = tl.where(strict, _mm(b_k, tl.trans(b_k), F32, DT), 0.)
    for iv in range(0, tl.cdiv(V, BV)):
        cv = iv * BV + tl.arange(0, BV)
        mcv = rv[:, None] & (cv < V)[None, :]
        tv = tok[:, None].to(tl.int64) * H + ih
        b_v = tl.load(v + tv * V + cv[None, :], mask=mcv, other=0.).to(tl.float32)
        b_do = tl.load(do + tv * V + cv[None, :], mask=mcv, other=0.).to(tl.float32)
        bad += _outside(b_v, BIG) + _outside(b_do, BIG)
    tl.store(flag + cid * H + ih, (bad > 0).to(tl.int32))
    if DELTA:
        a = araw * b_beta[:, None]
        # T = (I + A)^-1, by the forward's blocked substitution
        tm = _inv_unit_lower(a, C, PREC)
        tl.store(Tm + tq * C + rows[None, :], tm, mask=rv[:, None])
        w = _mm(tm, kb, F32, DT)
        tl.store(W + tq * K + ck[None, :], w.to(W.dtype.element_ty), mask=mqk)
        for iv in range(0, tl.cdiv(V, BV)):
            cv = iv * BV + tl.arange(0, BV)
            mcv = rv[:, None] & (cv < V)[None, :]
            b_v = tl.load(v + tq * V + cv[None, :], mask=mcv, other=0.).to(tl.float32)
            u = _mm(tm, b_v * b_beta[:, None], F32, DT)
            tl.store(U + tq * V + cv[None, :], u.to(U.dtype.element_ty), mask=mcv)


@triton.jit
def _states(k, v, g, beta, h0, flag, hflag, W, U, hs, cu, coff, T, H, K, V,
            C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
            DELTA: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr,
            F32: tl.constexpr, DT: tl.constexpr, SBIG: tl.constexpr):
    iv = tl.program_id(0)
    inh = tl.program_id(1)
    n = inh // H
    ih = inh % H
    NV = tl.num_programs(0)
    bos, eos, cbase = _seq(n, T, cu, coff, C, IS_VARLEN)
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    mk = ck < K
    cv = iv * BV + tl.arange(0, BV)
    mv = cv < V
    mkv = mk[:, None] & mv[None, :]
    offkv = ck[:, None].to(tl.int64) * V + cv[None, :]
    h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        h = tl.load(h0 + (n * H + ih).to(tl.int64) * K * V + offkv, mask=mkv, other=0.).to(tl.float32)
    for ic in range(0, tl.cdiv(eos - bos, C)):
        cid = cbase + ic
        tl.store(hs + (cid * H + ih).to(tl.int64) * K * V + offkv, h.to(hs.dtype.element_ty), mask=mkv)
        hbad = _outside(h, SBIG)
        tl.store(hflag + (cid * H + ih) * NV + iv, (hbad > 0).to(tl.int32))
        slow = (tl.load(flag + cid * H + ih) + hbad) > 0
        tok = bos + ic * C + rows
        rv = tok < eos
        tq = tok[:, None].to(tl.int64) * H + ih
        mqk = rv[:, None] & mk[None, :]
        mcv = rv[:, None] & mv[None, :]
        if slow:
            for t in range(bos + ic * C, tl.minimum(bos + ic * C + C, eos)):
                h = _exact_step(h, k, v, g, beta, t, ih, H, K, V, ck, mk, cv, mv, GATE, DELTA)
        else:
            b_k = tl.load(k + tq * K + ck[None, :], mask=mqk, other=0.).to(tl.float32)
            if DELTA:
                b_w = tl.load(W + tq * K + ck[None, :], mask=mqk, other=0.)
                b_u = tl.load(U + tq * V + cv[None, :], mask=mcv, other=0.).to(tl.float32)
                b_u = b_u - _mm(b_w, h, F32, DT)
                tl.store(U + tq * V + cv[None, :], b_u.to(U.dtype.element_ty), mask=mcv)
            else:
                b_u = tl.load(v + tq * V + cv[None, :], mask=mcv, other=0.).to(tl.float32)
            if GATE == 1:
                G, Gl, GC, GCl = _gate_sums(g, tok, rv, ih, H)
                h = h * tl.exp(GC) + _mm(tl.trans(b_k * _end_decay(G, Gl, GC, GCl)[:, None]), b_u, F32, DT)
            elif GATE == 2:
                G, GC = _load_gate(g, tok, rv, ih, H, K, ck, mk, GATE)
                h = h * tl.exp(GC)[:, None] + _mm(tl.trans(b_k * tl.exp(GC[None, :] - G)), b_u, F32, DT)
            else:
                h = h + _mm(tl.trans(b_k), b_u, F32, DT)


@triton.jit
def _exact_step(S, k, v, g, beta, t, ih, H, K, V, ck, mk, cv, mv, GATE: tl.constexpr,
                DELTA: tl.constexpr):
    """One step of the recurrence on a [BK, BV] block of S, as gdn.oracle writes it, in S's
    precision (fp32 in the sequential kernels, float64 in _exact)."""
    tt = (t * H + ih).to(tl.int64)
    b_k = tl.load(k + tt * K + ck, mask=mk, other=0.).to(S.dtype)
    b_v = tl.load(v + tt * V + cv, mask=mv, other=0.).to(S.dtype)
    if GATE == 1:
        S = tl.exp(tl.load(g + tt).to(S.dtype)) * S
    elif GATE == 2:
        S = tl.exp(tl.load(g + tt * K + ck, mask=mk, other=0.).to(S.dtype))[:, None] * S
    if DELTA:
        bk = tl.load(beta + tt).to(S.dtype) * b_k
        x = tl.sum(b_k[:, None] * S, 0)
        S = S - bk[:, None] * x[None, :] + bk[:, None] * b_v[None, :]
    else:
        S = S + b_k[:, None] * b_v[None, :]
    return S


@triton.jit
def _exact_dstep(dS, q, k, g, beta, do, t, ih, H, K, V, scale, ck, mk, cv, mv,
                 GATE: tl.constexpr, DELTA: tl.constexpr):
    """The state gradient before step t from the one after it (autograd's order)."""
    tt = (t * H + ih).to(tl.int64)
    b_q = tl.load(q + tt * K + ck, mask=mk, other=0.).to(tl.float32) * scale
    b_do = tl.load(do + tt * V + cv, mask=mv, other=0.).to(tl.float32)
    dS = dS + b_q[:, None] * b_do[None, :]
    if DELTA:
        b_k = tl.load(k + tt * K + ck, mask=mk, other=0.).to(tl.float32)
        bk = tl.load(beta + tt).to(tl.float32) * b_k
        dx = tl.sum(-dS * bk[:, None], 0)
        dS = dS + b_k[:, None] * dx[None, :]
    if GATE == 1:
        dS = tl.exp(tl.load(g + tt).to(tl.float32)) * dS
    elif GATE == 2:
        dS = tl.exp(tl.load(g + tt * K + ck, mask=mk, other=0.).to(tl.float32))[:, None] * dS
    return dS


@triton.jit
def _dstates(q, k, g, beta, do, dht, dh0, flag, dflag, W, dU, dhs, cu, coff, scale, T, H, K, V,
             C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
             DELTA: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DHT: tl.constexpr,
             HAS_H0: tl.constexpr, F32: tl.constexpr, DT: tl.constexpr, SBIG: tl.constexpr):
    iv = tl.program_id(0)
    inh = tl.program_id(1)
    n = inh // H
    ih = inh % H
    NV = tl.num_programs(0)
    bos, eos, cbase = _seq(n, T, cu, coff, C, IS_VARLEN)
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    mk = ck < K
    cv = iv * BV + tl.arange(0, BV)
    mv = cv < V
    mkv = mk[:, None] & mv[None, :]
    offkv = ck[:, None].to(tl.int64) * V + cv[None, :]
    incl = rows[:, None] >= rows[None, :]
    dh = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dh = tl.load(dht + (n * H + ih).to(tl.int64) * K * V + offkv, mask=mkv, other=0.).to(tl.float32)
    nc = tl.cdiv(eos - bos, C)
    for j in range(0, nc):
        ic = nc - 1 - j
        cid = cbase + ic
        tl.store(dhs + (cid * H + ih).to(tl.int64) * K * V + offkv, dh.to(dhs.dtype.element_ty), mask=mkv)
        dbad = _outside(dh, SBIG)
        tl.store(dflag + (cid * H + ih) * NV + iv, (dbad > 0).to(tl.int32))
        slow = (tl.load(flag + cid * H + ih) + dbad) > 0
        t0 = bos + ic * C
        if slow:
            for s in range(0, tl.minimum(C, eos - t0)):
                t = tl.minimum(t0 + C, eos) - 1 - s
                dh = _exact_dstep(dh, q, k, g, beta, do, t, ih, H, K, V, scale, ck, mk, cv, mv,
                                  GATE, DELTA)
        else:
            tok = t0 + rows
            rv = tok < eos
            tq = tok[:, None].to(tl.int64) * H + ih
            mqk = rv[:, None] & mk[None, :]
            mcv = rv[:, None] & mv[None, :]
            b_q = tl.load(q + tq * K + ck[None, :], mask=mqk, other=0.).to(tl.float32) * scale
            b_k = tl.load(k + tq * K + ck[None, :], mask=mqk, other=0.).to(tl.float32)
            b_do = tl.load(do + tq * V + cv[None, :], mask=mcv, other=0.).to(tl.float32)
            if GATE == 1:
                G, Gl, GC, GCl = _gate_sums(g, tok, rv, ih, H)
                p = _mm(b_q, tl.trans(b_k), F32, DT) * _pair_decay(G, Gl, incl)
                qg = b_q * tl.exp(G)[:, None]
                ke = b_k * _end_decay(G, Gl, GC, GCl)[:, None]
                decay = tl.exp(GC)
                du = _mm(tl.trans(p), b_do, F32, DT) + _mm(ke, dh, F32, DT)
                dh = dh * decay
            elif GATE == 2:
                G, GC = _load_gate(g, tok, rv, ih, H, K, ck, mk, GATE)
                qg = b_q * tl.exp(G)
                p = tl.where(incl, _mm(qg, tl.trans(b_k * tl.exp(-G)), F32, DT), 0.)
                ke = b_k * tl.exp(GC[None, :] - G)
                du = _mm(tl.trans(p), b_do, F32, DT) + _mm(ke, dh, F32, DT)
                dh = dh * tl.exp(GC)[:, None]
            else:
                qg = b_q
                p = tl.where(incl, _mm(b_q, tl.trans(b_k), F32, DT), 0.)
                du = _mm(tl.trans(p), b_do, F32, DT) + _mm(b_k, dh, F32, DT)
            tl.store(dU + tq * V + cv[None, :], du.to(dU.dtype.element_ty), mask=mcv)
            dh = dh + _mm(tl.trans(qg), b_do, F32, DT)
            if DELTA:
                b_w = tl.load(W + tq * K + ck[None, :], mask=mqk, other=0.)
                dh = dh - _mm(tl.trans(b_w), du, F32, DT)
    if HAS_H0:
        tl.store(dh0 + (n * H + ih).to(tl.int64) * K * V + offkv, dh.to(dh0.dtype.element_ty), mask=mkv)


@triton.jit
def _gate_grad(first, pairs, last, through, strict):
    """dg of a chunk's scalar gate from its decay terms, each summed where it belongs.

    A term with decay exp(G_i - G_j) (i after j) depends on g_t for j < t <= i only, so
    dg_t = sum of the terms spanning t: ``first[i]`` (i >= t; from the entry state, j = -1),
    ``pairs[i, j]`` (strictly lower), ``last[j]`` (j < t; to the end state, i = C) and
    ``through`` (entry to end, every t).  The textbook form (row sums minus column sums of
    the pair terms, then a reverse cumsum) has each term enter with both signs, so at large
    |dk| (~1e4, shifted inputs) the sums cancel to a ~1e-4 absolute error in dg ~1 that the
    float64 autograd of the trusted reference does not make; here no term enters twice.
    """
    spans = tl.cumsum(pairs, 0, reverse=True) + last[None, :]    # [t, j]: i >= t, j fixed
    return tl.cumsum(first, 0, reverse=True) + tl.sum(tl.where(strict, spans, 0.), 1) + through


@triton.jit
def _grads(q, k, v, g, beta, do, Tm, U, dU, hs, dhs, dq, dk, dv, dg, dbeta, cu, tab, scale,
           T, H, K, V, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
           DELTA: tl.constexpr, IS_VARLEN: tl.constexpr, F32: tl.constexpr, DT: tl.constexpr):
    cid = tl.program_id(0)
    ih = tl.program_id(1)
    n, ic, bos, eos = _coords(cid, T, cu, tab, C, IS_VARLEN)
    rows = tl.arange(0, C)
    tok = bos + ic * C + rows
    rv = tok < eos
    ck = tl.arange(0, BK)
    mk = ck < K
    mqk = rv[:, None] & mk[None, :]
    tq = tok[:, None].to(tl.int64) * H + ih
    incl = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    b_q = tl.load(q + tq * K + ck[None, :], mask=mqk, other=0.).to(tl.float32) * scale
    b_k = tl.load(k + tq * K + ck[None, :], mask=mqk, other=0.).to(tl.float32)
    b_beta = tl.zeros([C], dtype=tl.float32)
    tm = tl.zeros([C, C], dtype=tl.float32)
    if DELTA:
        b_beta = tl.load(beta + tok.to(tl.int64) * H + ih, mask=rv, other=0.).to(tl.float32)
        tm = tl.load(Tm + tq * C + rows[None, :], mask=rv[:, None], other=0.)
    acc_dqh = tl.zeros([C, BK], dtype=tl.float32)   # dO h^T
    acc_dke = tl.zeros([C, BK], dtype=tl.float32)   # U dS_end^T
    acc_dw = tl.zeros([C, BK], dtype=tl.float32)    # -dU h^T
    acc_dp = tl.zeros([C, C], dtype=tl.float32)     # dO U^T
    acc_dt = tl.zeros([C, C], dtype=tl.float32)     # dU (beta V)^T
    acc_dgc = tl.zeros([BK], dtype=tl.float32)      # rowsum(h * dS_end)
    d_beta = tl.zeros([C], dtype=tl.float32)
    hbase = (cid * H + ih).to(tl.int64) * K * V
    for iv in range(0, tl.cdiv(V, BV)):
        cv = iv * BV + tl.arange(0, BV)
        mv = cv < V
        mkv = mk[:, None] & mv[None, :]
        mcv = rv[:, None] & mv[None, :]
        offkv = ck[:, None].to(tl.int64) * V + cv[None, :]
        b_h = tl.load(hs + hbase + offkv, mask=mkv, other=0.)
        b_dsc = tl.load(dhs + hbase + offkv, mask=mkv, other=0.)
        b_do = tl.load(do + tq * V + cv[None, :], mask=mcv, other=0.)
        if DELTA:
            b_u = tl.load(U + tq * V + cv[None, :], mask=mcv, other=0.)
        else:
            b_u = tl.load(v + tq * V + cv[None, :], mask=mcv, other=0.)
        acc_dqh += _mm(b_do, tl.trans(b_h), F32, DT)
        acc_dke += _mm(b_u, tl.trans(b_dsc), F32, DT)
        acc_dp += _mm(b_do, tl.trans(b_u), F32, DT)
        if GATE > 0:
            acc_dgc += tl.sum(b_h.to(tl.float32) * b_dsc.to(tl.float32), 1)
        if DELTA:
            b_du = tl.load(dU + tq * V + cv[None, :], mask=mcv, other=0.)
            b_v = tl.load(v + tq * V + cv[None, :], mask=mcv, other=0.).to(tl.float32)
            acc_dw -= _mm(b_du, tl.trans(b_h), F32, DT)
            dvb = _mm(tl.trans(tm), b_du, F32, DT)
            tl.store(dv + tq * V + cv[None, :], (dvb * b_beta[:, None]).to(dv.dtype.element_ty), mask=mcv)
            d_beta += tl.sum(dvb * b_v, 1)
            acc_dt += _mm(b_du, tl.trans(b_v * b_beta[:, None]), F32, DT)
    dp = tl.where(incl, acc_dp, 0.)
    dG = tl.zeros([C], dtype=tl.float32)
    if GATE == 1:
        G, Gl, GC, GCl = _gate_sums(g, tok, rv, ih, H)
        eG = tl.exp(G)
        eE = _end_decay(G, Gl, GC, GCl)
        E = _pair_decay(G, Gl, incl)
        p = _mm(b_q, tl.trans(b_k), F32, DT) * E
        dqk = dp * E
        dqs = acc_dqh * eG[:, None] + _mm(dqk, b_k, F32, DT)
        dkk = _mm(tl.trans(dqk), b_q, F32, DT) + acc_dke * eE[:, None]
        # dg_t sums the pair terms whose decay spans step t (see _gate_grad)
        pairs = tl.where(strict, dp * p, 0.)
        dke_k = tl.sum(acc_dke * b_k, 1) * eE
        dG = tl.sum(acc_dqh * b_q, 1) * eG
        if DELTA:
            kk = _mm(b_k, tl.trans(b_k), F32, DT)
            araw = tl.where(strict, kk * E, 0.)
            kb = b_k * (b_beta * eG)[:, None]
            dt = acc_dt + _mm(acc_dw, tl.trans(kb), F32, DT)
            dkb = _mm(tl.trans(tm), acc_dw, F32, DT)
            da = -_mm(_mm(tl.trans(tm), dt, F32, DT), tl.trans(tm), F32, DT)
            da = tl.where(strict, da, 0.)
            d_beta += tl.sum(da * araw, 1) + tl.sum(dkb * b_k, 1) * eG
            dar = da * b_beta[:, None]
            dkk2 = dar * E
            dkk += _mm(dkk2, b_k, F32, DT) + _mm(tl.trans(dkk2), b_k, F32, DT) + dkb * (b_beta * eG)[:, None]
            pairs += dar * araw
            dG += tl.sum(dkb * kb, 1)
        dgo = _gate_grad(dG, pairs, dke_k, tl.exp(GC) * tl.sum(acc_dgc, 0), strict)
        tl.store(dg + tok.to(tl.int64) * H + ih, dgo.to(dg.dtype.element_ty), mask=rv)
    elif GATE == 2:
        G, GC = _load_gate(g, tok, rv, ih, H, K, ck, mk, GATE)
        eG = tl.exp(G)
        eN = tl.exp(-G)
        eE = tl.exp(GC[None, :] - G)
        qg = b_q * eG
        kg = b_k * eG
        kn = b_k * eN
        ke = b_k * eE
        dqg = acc_dqh + _mm(dp, kn, F32, DT)
        dkn = _mm(tl.trans(dp), qg, F32, DT)
        dkg = tl.zeros([C, BK], dtype=tl.float32)
        if DELTA:
            araw = tl.where(strict, _mm(kg, tl.trans(kn), F32, DT), 0.)
            kb = kg * b_beta[:, None]
            dt = acc_dt + _mm(acc_dw, tl.trans(kb), F32, DT)
            dkb = _mm(tl.trans(tm), acc_dw, F32, DT)
            da = -_mm(_mm(tl.trans(tm), dt, F32, DT), tl.trans(tm), F32, DT)
            da = tl.where(strict, da, 0.)
            d_beta += tl.sum(da * araw, 1) + tl.sum(dkb * kg, 1)
            dar = da * b_beta[:, None]
            dkg = _mm(dar, kn, F32, DT) + dkb * b_beta[:, None]
            dkn += _mm(tl.trans(dar), kg, F32, DT)
        dqs = dqg * eG
        dkk = dkg * eG + dkn * eN + acc_dke * eE
        dGv = dqg * qg + dkg * kg - dkn * kn - acc_dke * ke
        dGC = tl.sum(acc_dke * ke, 0) + tl.exp(GC) * acc_dgc
        dGv += tl.where(rows[:, None] == C - 1, dGC[None, :], 0.)
        dgo = tl.cumsum(dGv, 0, reverse=True)
        tl.store(dg + tq * K + ck[None, :], dgo.to(dg.dtype.element_ty), mask=mqk)
    else:
        dqs = acc_dqh + _mm(dp, b_k, F32, DT)
        dkk = _mm(tl.trans(dp), b_q, F32, DT) + acc_dke
        if DELTA:
            araw = tl.where(strict, _mm(b_k, tl.trans(b_k), F32, DT), 0.)
            kb = b_k * b_beta[:, None]
            dt = acc_dt + _mm(acc_dw, tl.trans(kb), F32, DT)
            dkb = _mm(tl.trans(tm), acc_dw, F32, DT)
            da = -_mm(_mm(tl.trans(tm), dt, F32, DT), tl.trans(tm), F32, DT)
            da = tl.where(strict, da, 0.)
            d_beta += tl.sum(da * araw, 1) + tl.sum(dkb * b_k, 1)
            dar = da * b_beta[:, None]
            dkk += _mm(dar, b_k, F32, DT) + _mm(tl.trans(dar), b_k, F32, DT) + dkb * b_beta[:, None]
    tl.store(dq + tq * K + ck[None, :], (dqs * scale).to(dq.dtype.element_ty), mask=mqk)
    tl.store(dk + tq * K + ck[None, :], dkk.to(dk.dtype.element_ty), mask=mqk)
    if DELTA:
        tl.store(dbeta + tok.to(tl.int64) * H + ih, d_beta.to(dbeta.dtype.element_ty), mask=rv)


@triton.jit
def _rounded(x, out):
    """A float64 gradient in ``out``'s dtype, through fp32: Triton 3.9's interpreter turns
    float64 into bf16 wrongly (kfuzz G02 on gdn_bwd_kda: inf and 2x-off dq), and fp32 holds
    every bf16/fp16 value and overflow the same way."""
    return x.to(tl.float32).to(out.dtype.element_ty)


@triton.jit
def _exact(q, k, v, g, beta, do, flag, hflag, dflag, hs, dhs, dq, dk, dv, dg, dbeta, cu, tab,
           scale, T, H, K, V, NV, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
           GATE: tl.constexpr, DELTA: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Step-by-step gradients of a flagged chunk: autograd of gdn.oracle's step,
    op for op, in float64 as the oracle computes, each gradient rounded once when stored.
    (In fp32, dbeta k = dS v - dS x overflowed at near-max q where the oracle's dk, 1e38,
    is finite: crashes/gdn_bwd/nonfinite-dk.)  The state before each step is recomputed
    from the chunk's entry state (quadratic in C, but only special-value chunks come here)."""
    cid = tl.program_id(0)
    ih = tl.program_id(1)
    cv0 = tl.arange(0, BV)   # NV (the sequential kernels' V tiles) <= 16 <= BV
    fl = tl.load(hflag + (cid * H + ih) * NV + cv0, mask=cv0 < NV, other=0)
    fl += tl.load(dflag + (cid * H + ih) * NV + cv0, mask=cv0 < NV, other=0)
    bad = tl.load(flag + cid * H + ih) + tl.sum(fl, 0)
    if bad > 0:
        n, ic, bos, eos = _coords(cid, T, cu, tab, C, IS_VARLEN)
        rows = tl.arange(0, C)
        t0 = bos + ic * C
        te = tl.minimum(t0 + C, eos)
        tok = t0 + rows
        rv = tok < eos
        ck = tl.arange(0, BK)
        mk = ck < K
        mqk = rv[:, None] & mk[None, :]
        tq = tok[:, None].to(tl.int64) * H + ih
        acc_dq = tl.zeros([C, BK], dtype=tl.float64)
        acc_dk = tl.zeros([C, BK], dtype=tl.float64)
        acc_dgv = tl.zeros([C, BK], dtype=tl.float64)
        acc_dg = tl.zeros([C], dtype=tl.float64)
        acc_db = tl.zeros([C], dtype=tl.float64)
        hbase = (cid * H + ih).to(tl.int64) * K * V
        for iv in range(0, tl.cdiv(V, BV)):
            cv = iv * BV + tl.arange(0, BV)
            mv = cv < V
            mkv = mk[:, None] & mv[None, :]
            offkv = ck[:, None].to(tl.int64) * V + cv[None, :]
            h = tl.load(hs + hbase + offkv, mask=mkv, other=0.).to(tl.float64)
            dS = tl.load(dhs + hbase + offkv, mask=mkv, other=0.).to(tl.float64)
            for s in range(0, te - t0):
                t = te - 1 - s
                r = t - t0
                S = h
                for u in range(t0, t):
                    S = _exact_step(S, k, v, g, beta, u, ih, H, K, V, ck, mk, cv, mv, GATE, DELTA)
                tt = (t * H + ih).to(tl.int64)
                b_k = tl.load(k + tt * K + ck, mask=mk, other=0.).to(tl.float64)
                b_v = tl.load(v + tt * V + cv, mask=mv, other=0.).to(tl.float64)
                b_q = tl.load(q + tt * K + ck, mask=mk, other=0.).to(tl.float64) * scale
                b_do = tl.load(do + tt * V + cv, mask=mv, other=0.).to(tl.float64)
                if GATE == 1:
                    a = tl.exp(tl.load(g + tt).to(tl.float64))
                    S1 = a * S
                elif GATE == 2:
                    av = tl.exp(tl.load(g + tt * K + ck, mask=mk, other=0.).to(tl.float64))
                    S1 = av[:, None] * S
                else:
                    S1 = S
                if DELTA:
                    bt = tl.load(beta + tt).to(tl.float64)
                    bk = bt * b_k
                    x = tl.sum(b_k[:, None] * S1, 0)
                    S2 = S1 - bk[:, None] * x[None, :] + bk[:, None] * b_v[None, :]
                else:
                    S2 = S1 + b_k[:, None] * b_v[None, :]
                dS2 = dS + b_q[:, None] * b_do[None, :]
                dqt = tl.sum(S2 * b_do[None, :], 1)
                if DELTA:
                    dbk = tl.sum(dS2 * b_v[None, :], 1) + tl.sum(-dS2 * x[None, :], 1)
                    dvt = tl.sum(dS2 * bk[:, None], 0)
                    dx = tl.sum(-dS2 * bk[:, None], 0)
                    dkt = tl.sum(S1 * dx[None, :], 1) + bt * dbk
                    acc_db += tl.where(rows == r, tl.sum(dbk * b_k, 0), 0.)
                    dS1 = dS2 + b_k[:, None] * dx[None, :]
                else:
                    dkt = tl.sum(dS2 * b_v[None, :], 1)
                    dvt = tl.sum(dS2 * b_k[:, None], 0)
                    dS1 = dS2
                if GATE == 1:
                    acc_dg += tl.where(rows == r, tl.sum(tl.sum(dS1 * S, 1), 0) * a, 0.)
                    dS = a * dS1
                elif GATE == 2:
                    acc_dgv += tl.where(rows[:, None] == r, (tl.sum(dS1 * S, 1) * av)[None, :], 0.)
                    dS = av[:, None] * dS1
                else:
                    dS = dS1
                acc_dq += tl.where(rows[:, None] == r, dqt[None, :], 0.)
                acc_dk += tl.where(rows[:, None] == r, dkt[None, :], 0.)
                tl.store(dv + tt * V + cv, _rounded(dvt, dv), mask=mv)
        tl.store(dq + tq * K + ck[None, :], _rounded(acc_dq * scale, dq), mask=mqk)
        tl.store(dk + tq * K + ck[None, :], _rounded(acc_dk, dk), mask=mqk)
        if GATE == 1:
            tl.store(dg + tok.to(tl.int64) * H + ih, _rounded(acc_dg, dg), mask=rv)
        elif GATE == 2:
            tl.store(dg + tq * K + ck[None, :], _rounded(acc_dgv, dg), mask=mqk)
        if DELTA:
            tl.store(dbeta + tok.to(tl.int64) * H + ih, _rounded(acc_db, dbeta), mask=rv)


def _pow2(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


def chunk_plan(cu_seqlens, B: int, T: int, C: int):
    """(sequences, total chunks, chunk table [NC, 2] int32 or None, first chunk
    of each sequence [N] int32 or None) for fixed-length or varlen batches."""
    if cu_seqlens is None:
        return B, B * triton.cdiv(T, C), None, None
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    counts = (lens + C - 1) // C
    N = len(lens)
    coff = torch.cumsum(counts, 0) - counts
    NC = int(counts.sum().item())
    seq = torch.repeat_interleave(torch.arange(N, device=cu.device), counts)
    within = torch.arange(NC, device=cu.device) - coff[seq]
    tab = torch.stack([seq, within], 1).to(torch.int32).contiguous()
    return N, NC, tab, coff.to(torch.int32).contiguous()


def _dot_mode(dtype):
    """(fp32 dots?, operand dtype of the tensor-core dots)."""
    if INTERPRET or dtype == torch.float32:
        return True, tl.float32
    if dtype == torch.float16:
        # fp16 range is too narrow for the chunk's intermediates: use tf32-free fp32
        return True, tl.float32
    return False, tl.bfloat16


def chunk_gdn_bwd(q, k, v, g, beta, do, dht=None, *, scale=None, initial_state=None,
                  cu_seqlens=None, delta=True, chunk_size=None):
    """Gradients of the GDN family recurrence (see gdn.oracle for the math).

    q, k [B,T,H,K]; v, do [B,T,H,V]; g None, [B,T,H] or [B,T,H,K] (log gate);
    beta [B,T,H] (delta=True only); dht [N,H,K,V] or None (gradient of the final
    state); initial_state [N,H,K,V] or None.  Varlen: B == 1 and cu_seqlens
    [N+1] offsets.  Returns (dq, dk, dv, dg, dbeta, dh0), each in its input's
    dtype; dg is None without a gate, dbeta None without delta, dh0 None
    without an initial state.  chunk_size (16, 32 or 64) defaults to 64, or 16
    for a vector gate.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if K > 256 or V > 256:
        raise ValueError(f"chunk_gdn_bwd supports K, V <= 256; got K={K}, V={V}")
    if cu_seqlens is not None and B != 1:
        raise ValueError("cu_seqlens needs B == 1")
    scale = K ** -0.5 if scale is None else float(scale)
    # the vector gate's factored form needs short chunks (in-chunk decay bound)
    C = chunk_size or (16 if g is not None and g.dim() == 4 else 64)
    GATE = 0 if g is None else (1 if g.dim() == 3 else 2)
    dev = q.device
    q, k, v, do = (x.contiguous() for x in (q, k, v, do))
    # the kernels index states densely: a permuted or strided state would be read (and dh0
    # written) in the wrong order (found by kfuzz: gdn_bwd with a permuted h0)
    initial_state = initial_state.contiguous() if initial_state is not None else None
    dht = dht.contiguous() if dht is not None else None
    g = g.contiguous() if g is not None else None
    beta = beta.contiguous() if delta else None
    N, NC, tab, coff = chunk_plan(cu_seqlens, B, T, C)
    cu = cu_seqlens.to(torch.int32).contiguous() if cu_seqlens is not None else None
    F32, DT = _dot_mode(q.dtype)
    inter = handoff_dtype(q.dtype)
    BK = _pow2(K)
    # BK = 256 takes 64-wide V tiles: on the H200 (Triton 3.6) with 16- or 32-wide ones the
    # sequential kernels' products compiled to out-of-range shared-memory addresses
    # (compute-sanitizer) or silently wrong gradients (K=184 V=1: error 0.91); found by kfuzz
    # (gdn_bwd, bf16 B4 T4095 H7 K184 V1). tests/test_gdn_backward.py holds the shapes.
    BV = 64 if BK > 128 else min(64, _pow2(V))
    NV = triton.cdiv(V, BV)
    IS_VARLEN = cu_seqlens is not None
    if T == 0 or NC == 0:
        z = [torch.zeros_like(x) if x is not None else None for x in (q, k, v, g, beta)]
        dh0 = None
        if initial_state is not None:
            dh0 = (dht if dht is not None else torch.zeros_like(initial_state)).to(initial_state.dtype)
        return (*z, dh0)
    dummy = torch.empty(1, device=dev, dtype=torch.float32)
    gp = g if g is not None else dummy
    bp = beta if beta is not None else dummy
    flag = torch.empty(NC, H, device=dev, dtype=torch.int32)
    hflag = torch.empty(NC, H, NV, device=dev, dtype=torch.int32)
    dflag = torch.empty(NC, H, NV, device=dev, dtype=torch.int32)
    if delta:
        Tm = torch.empty(B, T, H, C, device=dev, dtype=torch.float32)
        W = torch.empty(B, T, H, K, device=dev, dtype=inter)
        U = torch.empty(B, T, H, V, device=dev, dtype=inter)
        dU = torch.empty(B, T, H, V, device=dev, dtype=inter)
    else:
        Tm = W = U = dU = dummy
    hs = torch.empty(NC, H, K, V, device=dev, dtype=inter)
    dhs = torch.empty(NC, H, K, V, device=dev, dtype=inter)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dg = torch.empty_like(g) if g is not None else None
    dbeta = torch.empty_like(beta) if delta else None
    dh0 = torch.empty_like(initial_state) if initial_state is not None else None
    seq_warps = LAUNCH["seq_warps"]
    common = dict(C=C, BK=BK, BV=BV, GATE=GATE, DELTA=delta, IS_VARLEN=IS_VARLEN)
    _prep[(NC, H)](q, k, v, gp, bp, do, flag, Tm, W, U, cu, tab, T, H, K, V,
                   F32=F32, DT=DT, GLIM=VECTOR_DECAY_MAX, BIG=BIG,
                   PREC="ieee" if F32 else "tf32", num_warps=LAUNCH["prep_warps"],
                   num_stages=1 if F32 else 2, **common)
    _states[(NV, N * H)](k, v, gp, bp, initial_state, flag, hflag, W, U, hs, cu, coff, T, H, K, V,
                         HAS_H0=initial_state is not None, F32=F32, DT=DT, SBIG=SBIG, num_warps=seq_warps,
                         **common)
    _dstates[(NV, N * H)](q, k, gp, bp, do, dht, dh0, flag, dflag, W, dU if delta else dv, dhs,
                          cu, coff, scale, T, H, K, V, HAS_DHT=dht is not None,
                          HAS_H0=initial_state is not None, F32=F32, DT=DT, SBIG=SBIG, num_warps=seq_warps,
                          **common)
    _grads[(NC, H)](q, k, v, gp, bp, do, Tm, U, dU, hs, dhs, dq, dk, dv,
                    dg if dg is not None else dummy, dbeta if dbeta is not None else dummy,
                    cu, tab, scale, T, H, K, V, F32=F32, DT=DT, num_warps=LAUNCH["grads_warps"],
                    num_stages=1 if F32 else LAUNCH["grads_stages"],
                    **dict(common, BV=min(LAUNCH["grads_bv"], BV)))
    _exact[(NC, H)](q, k, v, gp, bp, do, flag, hflag, dflag, hs, dhs, dq, dk, dv,
                    dg if dg is not None else dummy, dbeta if dbeta is not None else dummy,
                    cu, tab, scale, T, H, K, V, NV, num_warps=seq_warps,
                    # float64 [BK, BV] tiles: ~2048 elements keep the stack small (sm_90 offline,
                    # BK 128: 1248 bytes at BV 16, 14192 at 64; fp32 at 64 was 6760)
                    **dict(common, BV=min(BV, max(16, 2048 // BK))))
    return dq, dk, dv, dg, dbeta, dh0
