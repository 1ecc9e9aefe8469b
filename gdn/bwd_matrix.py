"""The matrix (chunked) path of the GDN backward: the WY prep and the two passes over time.

``_prep`` (chunks in parallel) flags chunks for the exact path and builds the WY form;
``_states`` (sequential over chunks) recomputes each chunk's entry state and U;
``_dstates`` (sequential, reverse time) carries the state gradient back and stores dU
(or dv); gdn.bwd_grads then forms every chunk's gradients from those hand-offs.
Flagged chunks take the step path of gdn.bwd_exact and are rewritten by its ``_exact``.

Chunk algebra (one chunk, G the in-chunk cumulative log gate, scale folded
into q; for the scalar gate G is a float64 sum kept as hi + lo fp32, the pair
factors exp(G_i - G_j) are formed elementwise under the causal mask, so nothing
overflows, and dg_t sums the decay terms spanning step t, see
``gdn.bwd_gate._gate_grad``):

    A = strict_lower(diag(beta) (K_g K_n^T)),  T = (I + A)^-1
    U = T diag(beta) V - T diag(beta) K_g h     (U = V without delta)
    O = Q_g h + incl_lower(Q_g K_n^T) U
    S_end = exp(G_C) h + K_end^T U
with K_g = K exp(G), K_n = K exp(-G), K_end = K exp(G_C - G).

Refuses nothing itself: tile sizes, dtypes and launch grids come from gdn.chunk_bwd.
"""
from __future__ import annotations

import triton
import triton.language as tl

from gdn.bwd_chunks import _chunk_base, _chunk_rows, _seq_tile
from gdn.bwd_exact import _exact_dstep, _exact_step
from gdn.bwd_gate import _end_decay, _gate_sums, _load_gate, _pair_decay
from gdn.common import WY_MAX, handoff, mask_and, odot, outside_products, q_admits_matrix, scaled_columns, tile
from gdn.fwd_prep import unit_lower_inverse


@triton.jit
def _mm(a, b, F32: tl.constexpr, DT: tl.constexpr):
    """a b on fp32 operands ("ieee") where F32, else as `odot` takes them for DT."""
    if F32:
        return odot(a, b, tl.float32, "ieee")
    else:
        return odot(a, b, DT, "ieee")


@triton.jit
def _outside(x, bound):
    """How many elements of a 2-D block are not within [-bound, bound] (NaN counts)."""
    return tl.sum(tl.sum(tl.where(tl.abs(x) <= bound, 0, 1), 1), 0)


@triton.jit
def _gated_keys(b_k, b_beta, G, GATE: tl.constexpr):
    """diag(beta) K_g of a chunk (any K tile of it): the right factor of W = T diag(beta) K_g."""
    if GATE == 1:
        return b_k * (b_beta * tl.exp(G))[:, None]
    elif GATE == 2:
        return (b_k * tl.exp(G)) * b_beta[:, None]
    else:
        return b_k * b_beta[:, None]


@triton.jit
def _gate_bad(G, GC, GATE: tl.constexpr, GLIM: tl.constexpr):
    """How many of a chunk's gate sums send it to the exact path (`_load_gate`'s fp32 G and
    G_C): a special or overflowing sum, or for the vector gate a decay over the chunk steeper
    than GLIM (the factored form's bound)."""
    if GATE == 1:
        return _outside(G[:, None], 3.0e38)
    elif GATE == 2:
        return _outside(G, 3.0e38) + tl.where(tl.min(GC, 0) < -GLIM, 1, 0)
    else:
        return 0


@triton.jit
def _wy_system(q, k, g, beta, tok, r0, rv, ih, H, K, ck, mk, C: tl.constexpr, GATE: tl.constexpr,
               DELTA: tl.constexpr, F32: tl.constexpr, DT: tl.constexpr, GLIM: tl.constexpr,
               BIG: tl.constexpr, NEED_A: tl.constexpr):
    """A chunk's count of entries that send it to the exact path among q, k, beta and the
    gate (v and do are the caller's), its beta, diag(beta) K_g,
    A_raw = strict_lower(K_g K_n^T) (A = diag(beta) A_raw; zeros unless NEED_A) and the q
    and k tiles it loaded (fp32)."""
    rows = tl.arange(0, C)
    mqk = rv[:, None] & mk[None, :]
    b_q = tl.load(tile(q, r0, rows, ck, K, H), mask=mqk, other=0.).to(tl.float32)
    b_k = tl.load(tile(k, r0, rows, ck, K, H), mask=mqk, other=0.).to(tl.float32)
    bad = tl.where(q_admits_matrix(b_q, BIG, GATE), 0, 1) + outside_products(b_k, BIG)
    b_beta = tl.zeros([C], dtype=tl.float32)
    if DELTA:
        b_beta = tl.load(beta + tok.to(tl.int64) * H + ih, mask=rv, other=0.).to(tl.float32)
        bad += outside_products(b_beta[:, None], BIG) + _outside((b_beta * tl.sum(b_k * b_k, 1))[:, None], WY_MAX)
    strict = rows[:, None] > rows[None, :]
    araw = tl.zeros([C, C], dtype=tl.float32)
    if GATE == 1:
        G, GC = _load_gate(g, tok, r0, rv, ih, H, K, ck, mk, GATE)
        bad += _gate_bad(G, GC, GATE, GLIM)
        G, Gl, GC, GCl = _gate_sums(g, tok, rv, ih, H)
        kb = _gated_keys(b_k, b_beta, G, GATE)
        if NEED_A:
            araw = _mm(b_k, tl.trans(b_k), F32, DT) * _pair_decay(G, Gl, strict)
    elif GATE == 2:
        G, GC = _load_gate(g, tok, r0, rv, ih, H, K, ck, mk, GATE)
        bad += _gate_bad(G, GC, GATE, GLIM)
        kb = _gated_keys(b_k, b_beta, G, GATE)
        if NEED_A:
            araw = tl.where(strict, _mm(b_k * tl.exp(G), tl.trans(b_k * tl.exp(-G)), F32, DT), 0.)
    else:
        kb = _gated_keys(b_k, b_beta, b_beta, GATE)   # no gate: the third argument is unused
        if NEED_A:
            araw = tl.where(strict, _mm(b_k, tl.trans(b_k), F32, DT), 0.)
    return bad, b_beta, kb, araw, b_q, b_k


@triton.jit
def _chunk_qk(q, k, r0, rows, rv, H, K, ck, mk, scale):
    """A chunk's q (scale folded in) and k tiles, fp32."""
    mqk = rv[:, None] & mk[None, :]
    b_q = tl.load(tile(q, r0, rows, ck, K, H), mask=mqk, other=0.).to(tl.float32) * scale
    b_k = tl.load(tile(k, r0, rows, ck, K, H), mask=mqk, other=0.).to(tl.float32)
    return b_q, b_k


@triton.jit
def _causal_qk(b_q, b_k, G, Gl, incl, GATE: tl.constexpr, F32: tl.constexpr, DT: tl.constexpr):
    """incl_lower(Q K^T), with the scalar gate's pair decays exp(G_i - G_j) (GATE 1; G, Gl its
    sums as hi + lo) or none (GATE 0): P of a chunk, for q with the scale folded in."""
    if GATE == 1:
        return _mm(b_q, tl.trans(b_k), F32, DT) * _pair_decay(G, Gl, incl)
    else:
        return tl.where(incl, _mm(b_q, tl.trans(b_k), F32, DT), 0.)


@triton.jit
def _chunk_terms(b_q, b_k, g, tok, r0, rows, rv, ih, H, K, ck, mk, C: tl.constexpr,
                 GATE: tl.constexpr, F32: tl.constexpr, DT: tl.constexpr):
    """A chunk's terms of the state-gradient step from its q (scale folded in) and k tiles:
    P = incl_lower(Q_g K_n^T), Q_g = Q exp(G), K_end = K exp(G_C - G) and the chunk's decay
    exp(G_C) (a scalar; [BK, 1] for the vector gate; unused without a gate)."""
    incl = rows[:, None] >= rows[None, :]
    if GATE == 1:
        G, Gl, GC, GCl = _gate_sums(g, tok, rv, ih, H)
        p = _causal_qk(b_q, b_k, G, Gl, incl, GATE, F32, DT)
        qg = b_q * tl.exp(G)[:, None]
        ke = b_k * _end_decay(G, Gl, GC, GCl)[:, None]
        dec = tl.exp(GC)
    elif GATE == 2:
        G, GC = _load_gate(g, tok, r0, rv, ih, H, K, ck, mk, GATE)
        qg = b_q * tl.exp(G)
        p = tl.where(incl, _mm(qg, tl.trans(b_k * tl.exp(-G)), F32, DT), 0.)
        ke = b_k * tl.exp(GC[None, :] - G)
        dec = tl.exp(GC)[:, None]
    else:
        qg = b_q
        p = _causal_qk(b_q, b_k, 0., 0., incl, GATE, F32, DT)
        ke = b_k
        dec = 1.0
    return p, qg, ke, dec


@triton.jit
def _prep_wy(Tm, W, kb, araw, b_beta, r0, rows, rv, t0, eos, H, K, C: tl.constexpr, ck, mqk,
             WU: tl.constexpr, F32: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
             GIVEN_T: tl.constexpr, IW: tl.constexpr):
    """Where WU (the delta rule, W not taken from the forward): T = (I + A)^-1 and W = T
    diag(beta) K_g stored; returns T (0. where not WU).  T is the forward's (GIVEN_T), in Tm,
    or is formed as the forward's prep forms it (`gdn.fwd_prep._unit_lower_inverse`; Tm, fp32, is
    its scratch, IW its tile width: faster than a substitution on the whole chunk in
    registers) and stored in Tm (fp32: the dots round T to their operand dtype as they load
    it)."""
    tm = 0.
    if WU:
        if GIVEN_T:
            tm = tl.load(tile(Tm, r0, rows, rows, C, H), mask=rv[:, None], other=0.).to(tl.float32)
        else:
            tm = unit_lower_inverse(araw * b_beta[:, None], Tm, r0, rows, rv, t0, eos, H, C, IW, PREC)
            tl.store(tile(Tm, r0, rows, rows, C, H), tm, mask=rv[:, None])
        tl.store(tile(W, r0, rows, ck, K, H), _mm(tm, kb, F32, DT).to(W.dtype.element_ty), mask=mqk)
    return tm


@triton.jit
def _prep(q, k, v, g, beta, do, flag, Tm, W, U, ostep, cu, tab, T, H, K, V, NVO,
          C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
          DELTA: tl.constexpr, IS_VARLEN: tl.constexpr, F32: tl.constexpr, DT: tl.constexpr,
          GLIM: tl.constexpr, PREC: tl.constexpr, BIG: tl.constexpr, GIVEN_T: tl.constexpr,
          IW: tl.constexpr, SAVED: tl.constexpr, FWD_FLAGS: tl.constexpr):
    """A chunk's exact-path flag, and with the delta rule, unless SAVED, T, W and U = T
    diag(beta) V.  SAVED (the backward on the forward's chunk states, w and v_new): no T, W or
    U, and the flag leaves out v and beta, whose special values the forward checked and
    stepped token by token (its stepped columns send the chunk to `_exact`); neither enters
    the state gradient.  dU's local part P^T dO is `_dstates`'s.  FWD_FLAGS (with
    SAVED, where the forward's record is given: the op's path): q and k are not loaded; the
    forward's output kernel's record (ostep, int8 [NVO, chunks, H]: q outside BIG, or a chunk
    its state pass stepped, which a special k, v, beta or gate makes it) stands for their
    checks, and the gate's own checks (the forward's admit a -inf scalar gate, these do not)
    and dO's are made here, so that the op's `_prep` loads neither q nor k."""
    cid = tl.program_id(0)
    ih = tl.program_id(1)
    n, ic, bos, eos, rows, tok, rv, r0 = _chunk_rows(cid, ih, T, H, cu, tab, C, IS_VARLEN)
    ck = tl.arange(0, BK)
    mk = ck < K
    mqk = rv[:, None] & mk[None, :]
    if FWD_FLAGS:
        bad = 0
        for j in range(0, NVO):
            bad += tl.load(ostep + (j * tl.num_programs(0) + cid) * H + ih).to(tl.int32)
        if GATE != 0:   # without a gate, g is a placeholder: nothing to load
            G, GC = _load_gate(g, tok, r0, rv, ih, H, K, ck, mk, GATE)
            bad += _gate_bad(G, GC, GATE, GLIM)
        b_beta = 0.
        kb = 0.
        araw = 0.
    else:
        bad, b_beta, kb, araw, b_q, b_k = _wy_system(q, k, g, beta, tok, r0, rv, ih, H, K, ck, mk,
                                                     C, GATE, DELTA and not SAVED, F32, DT, GLIM,
                                                     BIG, DELTA and not SAVED and not GIVEN_T)
    # T and W first, so that one pass over V checks v and dO and stores U (v read once, not
    # in a second pass over V for U after T and W)
    tm = _prep_wy(Tm, W, kb, araw, b_beta, r0, rows, rv, bos + ic * C, eos, H, K, C, ck, mqk,
                  DELTA and not SAVED, F32, DT, PREC, GIVEN_T, IW)
    for iv in range(0, tl.cdiv(V, BV)):
        cv = iv * BV + tl.arange(0, BV)
        mcv = rv[:, None] & (cv < V)[None, :]
        if SAVED:
            b_do = tl.load(tile(do, r0, rows, cv, V, H), mask=mcv, other=0.).to(tl.float32)
            bad += outside_products(b_do, BIG)
        else:
            b_v = tl.load(tile(v, r0, rows, cv, V, H), mask=mcv, other=0.).to(tl.float32)
            b_do = tl.load(tile(do, r0, rows, cv, V, H), mask=mcv, other=0.).to(tl.float32)
            bad += outside_products(b_v, BIG) + outside_products(b_do, BIG)
        if DELTA and not SAVED:
            u = _mm(tm, b_v * b_beta[:, None], F32, DT)
            tl.store(tile(U, r0, rows, cv, V, H), u.to(U.dtype.element_ty), mask=mcv)
    tl.store(flag + cid * H + ih, (bad > 0).to(tl.int32))


@triton.jit
def _states_step(k, v, g, W, U, h, ok, t0, eos, rows, ih, H, K, V, ck, mk, cv, mv,
                 GATE: tl.constexpr, DELTA: tl.constexpr, F32: tl.constexpr, DT: tl.constexpr):
    """One chunk (first token t0) by the matrix path: stores U = Uu - W h (delta; where ok,
    a scalar) and returns the state leaving the chunk."""
    tok = t0 + rows
    rv = tok < eos
    r0 = _chunk_base(t0, ih, H)
    mqk = rv[:, None] & mk[None, :]
    mcv = rv[:, None] & mv[None, :]
    b_k = tl.load(tile(k, r0, rows, ck, K, H), mask=mqk, other=0.)
    if DELTA:
        b_w = tl.load(tile(W, r0, rows, ck, K, H), mask=mqk, other=0.)
        b_u = tl.load(tile(U, r0, rows, cv, V, H), mask=mcv, other=0.).to(tl.float32)
        b_u = b_u - _mm(b_w, h, F32, DT)
        tl.store(tile(U, r0, rows, cv, V, H), b_u.to(U.dtype.element_ty), mask=mask_and(mcv, ok))
    else:
        b_u = tl.load(tile(v, r0, rows, cv, V, H), mask=mcv, other=0.).to(tl.float32)
    if GATE == 1:
        # the decay on U's tile [C, BV], not on the keys, so that K reaches the product as
        # loaded (faster on the H200)
        G, Gl, GC, GCl = _gate_sums(g, tok, rv, ih, H)
        return h * tl.exp(GC) + _mm(tl.trans(b_k), b_u * _end_decay(G, Gl, GC, GCl)[:, None], F32, DT)
    elif GATE == 2:
        G, GC = _load_gate(g, tok, r0, rv, ih, H, K, ck, mk, GATE)
        return h * tl.exp(GC)[:, None] + _mm(tl.trans(b_k.to(tl.float32) * tl.exp(GC[None, :] - G)), b_u,
                                             F32, DT)
    else:
        return h + _mm(tl.trans(b_k), b_u, F32, DT)


@triton.jit
def _enter_chunk(xs, flag, x, cid, ih, H, K, V, offkv, mkv, alive, SBIG: tl.constexpr,
                 RESUME: tl.constexpr):
    """A chunk's entry bookkeeping in `_states` (x the state entering it, xs hs) and
    `_dstates` (x the state gradient at its end, xs dhs): stores x where alive (resume parts:
    saturated, `handoff`; the matrix parts stop before a state that needs it).  A resume part
    stores x's power-of-two exponents itself (`_store_exp`); a scaled x holds a column's
    largest element at 2^127, outside SBIG, so its chunk takes the step path.  Returns (how
    many of x's elements are outside SBIG, for the caller's hflag or dflag; whether the chunk
    takes the matrix path: alive, x within SBIG and _prep's flag clear)."""
    bad = _outside(x, SBIG)
    ok = alive & ((tl.load(flag + cid * H + ih) + bad) == 0)
    if RESUME:
        tl.store(xs + (cid * H + ih).to(tl.int64) * K * V + offkv, handoff(x, xs), mask=mask_and(mkv, alive))
    else:
        tl.store(xs + (cid * H + ih).to(tl.int64) * K * V + offkv, x.to(xs.dtype.element_ty),
                 mask=mask_and(mkv, alive))
    return bad, ok


@triton.jit
def _store_exp(xexp, E, cid, ih, H, V, cv, mv):
    """Stores a resume part's column exponents E ([BV] float64) of the state (gradient) it
    stores at chunk ``cid``: the value is hs 2^hexp (dhs 2^dexp), E > 0 only in a column past
    fp32's range at a boundary that hands it on (`gdn.common.scaled_columns`), where a later
    decay may bring it back inside the range as the oracle's does."""
    tl.store(xexp + (cid * H + ih).to(tl.int64) * V + cv, E.to(tl.int32), mask=mv)


@triton.jit
def _states(k, v, g, beta, h0, flag, hflag, W, U, hs, hexp, stop, sstop, cu, coff, T, H, K, V,
            C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
            DELTA: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr,
            F32: tl.constexpr, DT: tl.constexpr, SBIG: tl.constexpr, PART: tl.constexpr):
    """The state entering every chunk (hs) and U, per (V tile, sequence-head), in two parts as
    the forward's `gdn.fwd_state._state_kernel`: PART 0, the matrix part, walks the chunks
    while each admits the matrix path (flag from _prep clear, entering state within SBIG), a
    loop with no branch, which Triton pipelines; at the first that does not it records the
    chunk (`stop`) and the state entering it (`sstop`, fp32) and stores nothing after.
    PART 1, the resume part (launched after it), goes on from there, the step path
    (`_exact_step`) for flagged chunks and the matrix path for the rest.  hflag marks, per
    chunk and V tile, an entering state outside SBIG (for _exact).  The state entering a chunk
    is hs 2^hexp (`_store_exp`; the matrix part leaves hexp as allocated, 0)."""
    iv = tl.program_id(0)
    inh = tl.program_id(1)
    NV = tl.num_programs(0)
    n, ih, bos, eos, cbase, rows, ck, mk, cv, mv, mkv, offkv = _seq_tile(inh, iv, T, H, K, V, cu, coff,
                                                                         C, BK, BV, IS_VARLEN)
    nc = tl.cdiv(eos - bos, C)
    soff = inh.to(tl.int64) * K * V + offkv
    if PART == 0:
        h = tl.zeros([BK, BV], dtype=tl.float32)
        if HAS_H0:
            h = tl.load(h0 + soff, mask=mkv, other=0.).to(tl.float32)
        alive = nc >= 0
        stopc = nc
        for ic in range(0, nc):
            cid = cbase + ic
            hbad, ok = _enter_chunk(hs, flag, h, cid, ih, H, K, V, offkv, mkv, alive, SBIG, False)
            tl.store(hflag + (cid * H + ih) * NV + iv, (hbad > 0).to(tl.int32), mask=alive)
            hn = _states_step(k, v, g, W, U, h, ok, bos + ic * C, eos, rows, ih, H, K, V, ck, mk,
                              cv, mv, GATE, DELTA, F32, DT)
            h = tl.where(ok, hn, h)
            stopc = tl.where(alive & (ok == 0), ic, stopc)
            alive = ok
        tl.store(stop + inh * NV + iv, stopc)
        if stopc < nc:
            tl.store(sstop + soff, h, mask=mkv)
    else:
        c0 = tl.load(stop + inh * NV + iv)
        if c0 < nc:
            h = tl.load(sstop + soff, mask=mkv, other=0.)
            E = tl.zeros([BV], dtype=tl.float64)   # the state is h 2^E (`_store_exp`)
            for ic in range(c0, nc):
                cid = cbase + ic
                hbad, ok = _enter_chunk(hs, flag, h, cid, ih, H, K, V, offkv, mkv, True, SBIG, True)
                _store_exp(hexp, E, cid, ih, H, V, cv, mv)
                tl.store(hflag + (cid * H + ih) * NV + iv, (hbad > 0).to(tl.int32))
                t0 = bos + ic * C
                if not ok:
                    hx = h.to(tl.float64) * tl.exp2(E)[None, :]   # float64 steps (`_exact_step`)
                    for t in range(t0, tl.minimum(t0 + C, eos)):
                        hx = _exact_step(hx, k, v, g, beta, t, ih, H, K, V, ck, mk, cv, mv, GATE,
                                         DELTA)
                    h, E = scaled_columns(hx, False, ic < nc - 1, tl.float32)
                else:
                    h = _states_step(k, v, g, W, U, h, True, t0, eos, rows, ih, H, K, V, ck, mk,
                                     cv, mv, GATE, DELTA, F32, DT)


@triton.jit
def _dstates_step(q, k, g, do, W, dU, dh, ok, t0, eos, rows, ih, H, K, V, ck, mk, cv, mv,
                  scale, C: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr,
                  F32: tl.constexpr, DT: tl.constexpr):
    """One chunk (first token t0) of the state-gradient step by the matrix path: stores dU
    (dv without delta; where ok, a scalar) and returns the state gradient entering the chunk.
    dU's local part P^T dO is formed here from the q, k and dO tiles the step loads (two
    products off the state gradient's chain) and added to K_end dS in fp32, so dU is rounded
    once.  Formed here rather than in `_prep` and handed over in fp32 (as fla splits its
    dv_local from its dh pass): the backward is faster at 128-wide V tiles, and no fp32
    [B,T,H,V] hand-off tensor is needed."""
    tok = t0 + rows
    rv = tok < eos
    r0 = _chunk_base(t0, ih, H)
    mqk = rv[:, None] & mk[None, :]
    mcv = rv[:, None] & mv[None, :]
    if GATE != 2:
        # the scalar gate's decays and q's scale on the [C, BV] tiles, q and k as loaded into
        # the products: K_end dS = diag(exp(G_C - G)) (K dS), Q_g^T dO = Q^T (diag(exp(G)
        # scale) dO), not as the [C, K] fp32 tiles Q_g, K_end (fewer instructions in the loop
        # and less spill, sm_90 offline)
        b_q = tl.load(tile(q, r0, rows, ck, K, H), mask=mqk, other=0.)
        b_k = tl.load(tile(k, r0, rows, ck, K, H), mask=mqk, other=0.)
        b_do = tl.load(tile(do, r0, rows, cv, V, H), mask=mcv, other=0.).to(tl.float32)
        kdh = _mm(b_k, dh, F32, DT)
        incl = rows[:, None] >= rows[None, :]
        if GATE == 1:
            G, Gl, GC, GCl = _gate_sums(g, tok, rv, ih, H)
            pdo = _mm(tl.trans(_causal_qk(b_q, b_k, G, Gl, incl, GATE, F32, DT)), b_do * scale,
                      F32, DT)
            kdh = kdh * _end_decay(G, Gl, GC, GCl)[:, None]
            dh = dh * tl.exp(GC)
            b_do = b_do * (tl.exp(G) * scale)[:, None]
        else:
            b_do = b_do * scale
            pdo = _mm(tl.trans(_causal_qk(b_q, b_k, 0., 0., incl, GATE, F32, DT)), b_do, F32, DT)
        du = pdo + kdh
        tl.store(tile(dU, r0, rows, cv, V, H), du.to(dU.dtype.element_ty), mask=mask_and(mcv, ok))
        dh = dh + _mm(tl.trans(b_q), b_do, F32, DT)
    else:   # the vector gate's decays are per key: on the [C, K] tiles
        b_q, b_k = _chunk_qk(q, k, r0, rows, rv, H, K, ck, mk, scale)
        b_do = tl.load(tile(do, r0, rows, cv, V, H), mask=mcv, other=0.).to(tl.float32)
        p, qg, ke, dec = _chunk_terms(b_q, b_k, g, tok, r0, rows, rv, ih, H, K, ck, mk, C,
                                      GATE, F32, DT)
        du = _mm(tl.trans(p), b_do, F32, DT) + _mm(ke, dh, F32, DT)
        dh = dh * dec
        tl.store(tile(dU, r0, rows, cv, V, H), du.to(dU.dtype.element_ty), mask=mask_and(mcv, ok))
        dh = dh + _mm(tl.trans(qg), b_do, F32, DT)
    if DELTA:
        b_w = tl.load(tile(W, r0, rows, ck, K, H), mask=mqk, other=0.)
        dh = dh - _mm(tl.trans(b_w), du, F32, DT)
    return dh


@triton.jit
def _hd_rows(hs, HD, dh, cid, ih, iv, NV, H, K, V, ck, mk, offkv, mkv, ok):
    """Stores (where ok) the row sums over the V tile of h * dS_end for one chunk (h its entry
    state as `_states` stored it, dS_end in fp32), in HD [chunk, H, V tile, K]: the gate's
    entry-to-end term exp(G_C) sum(h * dS_end) (`gdn.bwd_gate._gate_grad`'s ``through``) is a
    sum of products that cancels against the others; formed in _grads_p from dhs, dS_end
    rounded to bf16, it puts dg of bf16 cases with one token, key and value over G01's bound
    (37 ulps off at a dg of -0.0044).  The load of h waits in the serial chain, which costs
    `_dstates` time; storing dS_end's bf16 residual here for _grads_p instead costs more in
    _grads_p."""
    base = (cid * H + ih).to(tl.int64)
    b_h = tl.load(hs + base * K * V + offkv, mask=mask_and(mkv, ok), other=0.).to(tl.float32)
    tl.store(HD + (base * NV + iv) * K + ck, tl.sum(b_h * dh, 1), mask=mask_and(mk, ok))


@triton.jit
def _dstates(q, k, g, beta, do, dht, dh0, flag, dflag, W, dU, dhs, dexp, hs, HD, stop, sstop, cu,
             coff, scale, T, H, K, V,
             C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
             DELTA: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DHT: tl.constexpr,
             HAS_H0: tl.constexpr, F32: tl.constexpr, DT: tl.constexpr, SBIG: tl.constexpr,
             PART: tl.constexpr):
    """The state gradient at every chunk end (dhs), dU (dv without delta) and dh0, per (V
    tile, sequence-head), in reverse time and in two parts as `_states` (PART 0 the matrix
    part, no branch in its loop; PART 1 from the first chunk, in reverse, that needs the step
    path: flagged by _prep, or a state gradient outside SBIG).  dflag marks, per chunk and V
    tile, a state gradient outside SBIG at the chunk's end (for _exact).  The state gradient at
    a chunk's end is dhs 2^dexp (`_store_exp`; the matrix part leaves dexp as allocated, 0).
    With a gate, HD gets the rows of h * dS_end, dS_end in fp32 (`_hd_rows`; a chunk whose h or
    dS_end is scaled is flagged, and `_exact` rewrites its gradients)."""
    iv = tl.program_id(0)
    inh = tl.program_id(1)
    NV = tl.num_programs(0)
    n, ih, bos, eos, cbase, rows, ck, mk, cv, mv, mkv, offkv = _seq_tile(inh, iv, T, H, K, V, cu, coff,
                                                                         C, BK, BV, IS_VARLEN)
    nc = tl.cdiv(eos - bos, C)
    soff = inh.to(tl.int64) * K * V + offkv
    if PART == 0:
        dh = tl.zeros([BK, BV], dtype=tl.float32)
        if HAS_DHT:
            dh = tl.load(dht + soff, mask=mkv, other=0.).to(tl.float32)
        alive = nc >= 0
        stopj = nc
        for j in range(0, nc):
            ic = nc - 1 - j
            cid = cbase + ic
            dbad, ok = _enter_chunk(dhs, flag, dh, cid, ih, H, K, V, offkv, mkv, alive, SBIG, False)
            if GATE != 0:
                _hd_rows(hs, HD, dh, cid, ih, iv, NV, H, K, V, ck, mk, offkv, mkv, alive)
            tl.store(dflag + (cid * H + ih) * NV + iv, (dbad > 0).to(tl.int32), mask=alive)
            dhn = _dstates_step(q, k, g, do, W, dU, dh, ok, bos + ic * C, eos, rows, ih, H, K, V,
                                ck, mk, cv, mv, scale, C, GATE, DELTA, F32, DT)
            dh = tl.where(ok, dhn, dh)
            stopj = tl.where(alive & (ok == 0), j, stopj)
            alive = ok
        tl.store(stop + inh * NV + iv, stopj)
        if stopj < nc:
            tl.store(sstop + soff, dh, mask=mkv)
        elif HAS_H0:
            tl.store(dh0 + soff, dh.to(dh0.dtype.element_ty), mask=mkv)
    else:
        j0 = tl.load(stop + inh * NV + iv)
        if j0 < nc:
            dh = tl.load(sstop + soff, mask=mkv, other=0.)
            D = tl.zeros([BV], dtype=tl.float64)   # the state gradient is dh 2^D (`_store_exp`)
            for j in range(j0, nc):
                ic = nc - 1 - j
                cid = cbase + ic
                dbad, ok = _enter_chunk(dhs, flag, dh, cid, ih, H, K, V, offkv, mkv, True, SBIG, True)
                _store_exp(dexp, D, cid, ih, H, V, cv, mv)
                if GATE != 0:
                    _hd_rows(hs, HD, dh, cid, ih, iv, NV, H, K, V, ck, mk, offkv, mkv, True)
                tl.store(dflag + (cid * H + ih) * NV + iv, (dbad > 0).to(tl.int32))
                t0 = bos + ic * C
                if not ok:
                    dx = dh.to(tl.float64) * tl.exp2(D)[None, :]   # float64 steps (`_exact_dstep`)
                    for s in range(0, tl.minimum(C, eos - t0)):
                        t = tl.minimum(t0 + C, eos) - 1 - s
                        dx = _exact_dstep(dx, q, k, g, beta, do, t, ih, H, K, V, scale, ck, mk, cv,
                                          mv, GATE, DELTA)
                    dh, D = scaled_columns(dx, False, j < nc - 1, tl.float32)
                else:
                    dh = _dstates_step(q, k, g, do, W, dU, dh, True, t0, eos, rows, ih, H, K, V,
                                       ck, mk, cv, mv, scale, C, GATE, DELTA, F32, DT)
            if HAS_H0:
                tl.store(dh0 + soff, dh.to(dh0.dtype.element_ty), mask=mkv)
