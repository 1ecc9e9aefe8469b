"""The chunk-parallel gradients of the GDN backward: dq, dk, dv, dbeta and dg of every chunk.

They come from four hand-offs of gdn.bwd_matrix: the chunk's entry state h (``_states``),
its end-state gradient dS_end and dU, the full gradient of U (``_dstates``), and U itself;
with the delta rule also T = (I + A)^-1 (``_prep``).  Two groups of terms:

- the P terms (causal products and state terms): dO h^T, U dS_end^T, dO U^T give dq, most of
  dk and dg;
- the WY terms (everything that goes through T): -dU h^T and dU (beta V)^T give dv, dbeta,
  and the rest of dk and dg.

Two launches: ``_grads_wy`` (delta only) stores dv and dbeta and hands its share of dk and dg
on as fp32 partials; ``_grads_p`` forms the P terms and adds the partials.  Both take K in
slices (one or two [C, BKS] accumulators live).  Neither keeps T live beside the P terms: one
launch for both would hold three [C, K] accumulators and T at once, and spills.

Formulas (one chunk, see gdn.bwd_matrix's docstring for A, T, U, K_g, K_n):
    dT = dU (beta V - beta K_g h)^T,  dA = -strict_lower(T^T dT T^T),
    d(beta K_g) = T^T (-dU h^T),  dv = beta T^T dU,
and dA, d(beta K_g) reach k, beta and the gate as A and W were built from them.
Refuses nothing itself: tile sizes, dtypes and launch grids come from gdn.chunk_bwd.
"""
from __future__ import annotations

import triton
import triton.language as tl

from gdn.bwd_chunks import _chunk_rows
from gdn.bwd_gate import (_end_decay, _gate_grad, _gate_grad_of_spans, _gate_grad_of_spans_k, _gate_sums,
                          _load_gate, _pair_decay, _pair_spans, _pair_spans_k)
from gdn.bwd_matrix import _mm
from gdn.common import tile


@triton.jit
def _grads_wy(k, v, g, beta, Tm, dU, hs, dv, dbeta, dkp, dgp, flag, cu, tab, T, H, K, V,
              C: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
              GATE: tl.constexpr, IS_VARLEN: tl.constexpr, F32: tl.constexpr,
              DT: tl.constexpr):
    """The WY terms of a chunk (delta only): stores dv and dbeta, and its shares of dk (dkp
    [.., K]) and dg (dgp: the scalar gate's [..] after its decay spans, the vector gate's
    [.., K], each after its decay spans), fp32, for _grads_p to add.  K in BKS-wide slices, one
    [C, BKS] accumulator live.  Three passes: over V, the terms without K (dv, dbeta's share,
    dU (beta V)^T); over the K slices, -dU h^T of the slice and what sums over K (dT's
    product, A's keys, dbeta's and the scalar gate's row sums), storing the slice's
    T^T (-dU h^T) share of dk in dkp; then, once dA is known, over the slices again, dA's
    share of dk added to it (and the vector gate's dg).  The second pass's stores are read
    back by the same program after a barrier.  Slices rather than [C, K] accumulators: this
    form runs at 4 warps, and at fp32 K = V = 256 it needs 57344 B of shared memory (sm_90
    offline), within an A100's."""
    cid = tl.program_id(0)
    ih = tl.program_id(1)
    n, ic, bos, eos, rows, tok, rv, r0 = _chunk_rows(cid, ih, T, H, cu, tab, C, IS_VARLEN)
    strict = rows[:, None] > rows[None, :]
    b_beta = tl.load(beta + tok.to(tl.int64) * H + ih, mask=rv, other=0.).to(tl.float32)
    tm = tl.load(tile(Tm, r0, rows, rows, C, H), mask=rv[:, None], other=0.).to(tl.float32)
    if C >= 32 and BKS >= 32 and BV >= 32:
        # every product then takes T as a DT operand (`odot`: their N is C, BKS or BV), so
        # round it once, here: half its registers (sm_90 offline, 4 warps, scalar gate: stack
        # 240 -> 104 B; no gate 56 -> 0)
        tm = tm.to(DT)
    hbase = (cid * H + ih).to(tl.int64) * K * V
    dt = tl.zeros([C, C], dtype=tl.float32)         # dU (beta V)^T, then + (-dU h^T) (beta K_g)^T
    d_beta = tl.zeros([C], dtype=tl.float32)
    fin = tl.zeros([C], dtype=tl.float32)   # the vector gate's overflow check (`_overflowed`)
    for iv in range(0, tl.cdiv(V, BV)):
        cv = iv * BV + tl.arange(0, BV)
        mcv = rv[:, None] & (cv < V)[None, :]
        b_du = tl.load(tile(dU, r0, rows, cv, V, H), mask=mcv, other=0.)
        b_v = tl.load(tile(v, r0, rows, cv, V, H), mask=mcv, other=0.).to(tl.float32)
        dvb = _mm(tl.trans(tm), b_du, F32, DT)
        b_dv = dvb * b_beta[:, None]
        if GATE == 2:
            fin += tl.sum(b_dv * 0., 1)
        tl.store(tile(dv, r0, rows, cv, V, H), b_dv.to(dv.dtype.element_ty), mask=mcv)
        d_beta += tl.sum(dvb * b_v, 1)
        dt += _mm(b_du, tl.trans(b_v * b_beta[:, None]), F32, DT)
    eG = b_beta
    if GATE == 1:
        G, Gl, GC, GCl = _gate_sums(g, tok, rv, ih, H)
        eG = tl.exp(G)
    araw = tl.zeros([C, C], dtype=tl.float32)       # K_g K_n^T, summed over the slices
    rk = tl.zeros([C], dtype=tl.float32)            # rowsum(T^T (-dU h^T) * K) (vector gate: * K_g)
    dG = tl.zeros([C], dtype=tl.float32)            # scalar gate: rowsum(T^T (-dU h^T) * beta K_g)
    for ik in range(0, tl.cdiv(K, BKS)):
        ck = ik * BKS + tl.arange(0, BKS)
        mk = ck < K
        mqk = rv[:, None] & mk[None, :]
        acc_dw = tl.zeros([C, BKS], dtype=tl.float32)   # dU h^T, this slice
        for iv in range(0, tl.cdiv(V, BV)):
            cv = iv * BV + tl.arange(0, BV)
            mv = cv < V
            b_h = tl.load(hs + hbase + ck[:, None] * V + cv[None, :], mask=mk[:, None] & mv[None, :], other=0.)
            b_du = tl.load(tile(dU, r0, rows, cv, V, H), mask=rv[:, None] & mv[None, :], other=0.)
            acc_dw += _mm(b_du, tl.trans(b_h), F32, DT)
        acc_dw = -acc_dw                                  # -dU h^T
        b_k = tl.load(tile(k, r0, rows, ck, K, H), mask=mqk, other=0.).to(tl.float32)
        if GATE == 2:
            Gs, _ = _load_gate(g, tok, r0, rv, ih, H, K, ck, mk, GATE)
            kr = b_k * tl.exp(Gs)
            araw += _mm(kr, tl.trans(b_k * tl.exp(-Gs)), F32, DT)
            kb = kr * b_beta[:, None]
        else:
            kr = b_k
            araw += _mm(b_k, tl.trans(b_k), F32, DT)
            if GATE == 1:
                kb = b_k * (b_beta * eG)[:, None]
            else:
                kb = b_k * b_beta[:, None]
        dt += _mm(acc_dw, tl.trans(kb), F32, DT)
        dkb = _mm(tl.trans(tm), acc_dw, F32, DT)
        rk += tl.sum(dkb * kr, 1)
        if GATE == 1:
            dG += tl.sum(dkb * kb, 1)
            part = dkb * (b_beta * eG)[:, None]
        else:
            part = dkb * b_beta[:, None]
        tl.store(tile(dkp, r0, rows, ck, K, H), part, mask=mqk)
    E = dt
    if GATE == 1:
        # formed after the slices, not before: one [C, C] tile fewer live through them
        E = _pair_decay(G, Gl, rows[:, None] >= rows[None, :])
        araw = tl.where(strict, araw * E, 0.)
        rk = rk * eG
    else:
        araw = tl.where(strict, araw, 0.)
    da = tl.where(strict, -_mm(_mm(tl.trans(tm), dt, F32, DT), tl.trans(tm), F32, DT), 0.)
    dar = da * b_beta[:, None]
    d_beta += tl.sum(da * araw, 1) + rk
    tl.store(dbeta + tok.to(tl.int64) * H + ih, d_beta.to(dbeta.dtype.element_ty), mask=rv)
    if GATE == 2:
        _overflowed(flag, cid, ih, H, fin + d_beta * 0.)
    dkk = dar
    if GATE == 1:
        dgw = _gate_grad(dG, dar * araw, tl.zeros([C], dtype=tl.float32), 0.)
        tl.store(dgp + tok.to(tl.int64) * H + ih, dgw, mask=rv)
        dkk = dar * E
    tl.debug_barrier()   # the slices' dkp stores above are read back below
    for ik in range(0, tl.cdiv(K, BKS)):
        ck = ik * BKS + tl.arange(0, BKS)
        mk = ck < K
        mqk = rv[:, None] & mk[None, :]
        b_k = tl.load(tile(k, r0, rows, ck, K, H), mask=mqk, other=0.).to(tl.float32)
        part = tl.load(tile(dkp, r0, rows, ck, K, H), mask=mqk, other=0.)
        if GATE == 2:
            Gs, _ = _load_gate(g, tok, r0, rv, ih, H, K, ck, mk, GATE)
            eGs = tl.exp(Gs)
            eNs = tl.exp(-Gs)
            kg = b_k * eGs
            kn = b_k * eNs
            dk = _mm(dar, kn, F32, DT) + part
            dk2 = _mm(tl.trans(dar), kg, F32, DT)
            tl.store(tile(dkp, r0, rows, ck, K, H), dk * eGs + dk2 * eNs, mask=mqk)
            # dg per key over the steps each term spans (`_gate_grad`): w's decays from the
            # chunk's start, and A's pairs
            pairs = tl.where(strict[:, :, None], dar[:, :, None] * kg[:, None, :] * kn[None, :, :], 0.)
            dgw = _gate_grad_of_spans_k(part * kg, _pair_spans_k(pairs), tl.zeros_like(part),
                                        tl.zeros([BKS], dtype=tl.float32))
            tl.store(tile(dgp, r0, rows, ck, K, H), dgw, mask=mqk)
        else:
            dk = _mm(dkk, b_k, F32, DT) + _mm(tl.trans(dkk), b_k, F32, DT) + part
            tl.store(tile(dkp, r0, rows, ck, K, H), dk, mask=mqk)


@triton.jit
def _grads_p(q, k, v, g, do, U, hs, dhs, HD, dq, dk, dg, dkp, dgp, flag, cu, tab, scale, T, H, K, V, NVS,
             C: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
             GATE: tl.constexpr, DELTA: tl.constexpr, IS_VARLEN: tl.constexpr,
             F32: tl.constexpr, DT: tl.constexpr):
    """The P terms of a chunk: dq, dk, dg, with _grads_wy's partials
    added (delta).  K in BKS-wide slices, each with its own pass over V, so two [C, BKS]
    accumulators are live instead of two [C, K]: every output column of dq and dk needs its
    own columns of h and dS_end only; what mixes the columns (dO U^T, and the scalar gate's
    Q K^T and its row sums for dg) is formed before the slices or summed across them.  The
    gate's rowsum(h * dS_end) comes from _dstates (`gdn.bwd_matrix._hd_rows`)."""
    cid = tl.program_id(0)
    ih = tl.program_id(1)
    n, ic, bos, eos, rows, tok, rv, r0 = _chunk_rows(cid, ih, T, H, cu, tab, C, IS_VARLEN)
    incl = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    hbase = (cid * H + ih).to(tl.int64) * K * V
    acc_dp = tl.zeros([C, C], dtype=tl.float32)     # dO U^T
    for iv in range(0, tl.cdiv(V, BV)):
        cv = iv * BV + tl.arange(0, BV)
        mcv = rv[:, None] & (cv < V)[None, :]
        b_do = tl.load(tile(do, r0, rows, cv, V, H), mask=mcv, other=0.)
        b_u = tl.load(tile((U if DELTA else v), r0, rows, cv, V, H), mask=mcv, other=0.)
        acc_dp += _mm(b_do, tl.trans(b_u), F32, DT)
    dp = tl.where(incl, acc_dp, 0.)
    if GATE == 1:
        cf = tl.arange(0, BK)
        mqf = rv[:, None] & (cf < K)[None, :]
        f_q = tl.load(tile(q, r0, rows, cf, K, H), mask=mqf, other=0.)
        f_k = tl.load(tile(k, r0, rows, cf, K, H), mask=mqf, other=0.)
        G, Gl, GC, GCl = _gate_sums(g, tok, rv, ih, H)
        eG = tl.exp(G)
        eE = _end_decay(G, Gl, GC, GCl)
        E = _pair_decay(G, Gl, incl)
        p = _mm(f_q, tl.trans(f_k), F32, DT) * (E * scale)
        # dg_t sums the pair terms whose decay spans step t (see _gate_grad), reduced to [C]
        # here, before the K slices, so that no [C, C] tile is held through them (less spill)
        spans = _pair_spans(tl.where(strict, dp * p, 0.))
        dp = dp * E                                  # now d(Q K^T) under the decay
    fin = tl.zeros([C], dtype=tl.float32)          # see _overflowed
    qh = tl.zeros([C], dtype=tl.float32)            # rowsum(dO h^T * Q)
    ke = tl.zeros([C], dtype=tl.float32)            # rowsum(U dS_end^T * K)
    hd = tl.zeros([BKS], dtype=tl.float32)          # rowsum(h * dS_end), slices summed
    for ik in range(0, tl.cdiv(K, BKS)):
        ck = ik * BKS + tl.arange(0, BKS)
        mk = ck < K
        mqk = rv[:, None] & mk[None, :]
        acc_dqh = tl.zeros([C, BKS], dtype=tl.float32)   # dO h^T
        acc_dke = tl.zeros([C, BKS], dtype=tl.float32)   # U dS_end^T
        acc_dgc = tl.zeros([BKS], dtype=tl.float32)      # rowsum(h * dS_end)
        if GATE > 0:
            for jv in range(0, NVS):
                acc_dgc += tl.load(HD + ((cid * H + ih).to(tl.int64) * NVS + jv) * K + ck, mask=mk, other=0.)
        for iv in range(0, tl.cdiv(V, BV)):
            cv = iv * BV + tl.arange(0, BV)
            mv = cv < V
            mkv = mk[:, None] & mv[None, :]
            mcv = rv[:, None] & mv[None, :]
            offkv = ck[:, None] * V + cv[None, :]
            b_h = tl.load(hs + hbase + offkv, mask=mkv, other=0.)
            # dS_end (fp32) in the hand-off dtype of hs, as a product operand; a chunk whose
            # dS_end is outside SBIG is flagged, and `_exact` rewrites its gradients
            b_dsc = tl.load(dhs + hbase + offkv, mask=mkv, other=0.).to(hs.dtype.element_ty)
            b_do = tl.load(tile(do, r0, rows, cv, V, H), mask=mcv, other=0.)
            b_u = tl.load(tile((U if DELTA else v), r0, rows, cv, V, H), mask=mcv, other=0.)
            acc_dqh += _mm(b_do, tl.trans(b_h), F32, DT)
            acc_dke += _mm(b_u, tl.trans(b_dsc), F32, DT)
        # q and k as stored (exact bf16 product operands; q's scale on the products), not as
        # [C, BKS] fp32 tiles beside the two accumulators
        b_q = tl.load(tile(q, r0, rows, ck, K, H), mask=mqk, other=0.)
        b_k = tl.load(tile(k, r0, rows, ck, K, H), mask=mqk, other=0.)
        if GATE == 1:
            dqs = acc_dqh * eG[:, None] + _mm(dp, b_k, F32, DT)
            dkk = _mm(tl.trans(dp), b_q, F32, DT) * scale + acc_dke * eE[:, None]
            qh += tl.sum(acc_dqh * b_q.to(tl.float32), 1) * scale
            ke += tl.sum(acc_dke * b_k.to(tl.float32), 1)
            hd += acc_dgc
        elif GATE == 2:
            b_q = b_q.to(tl.float32) * scale
            b_k = b_k.to(tl.float32)
            G, GC = _load_gate(g, tok, r0, rv, ih, H, K, ck, mk, GATE)
            eG = tl.exp(G)
            eN = tl.exp(-G)
            eE = tl.exp(GC[None, :] - G)
            qg = b_q * eG
            kn = b_k * eN
            ke2 = b_k * eE
            dqg = acc_dqh + _mm(dp, kn, F32, DT)
            dkn = _mm(tl.trans(dp), qg, F32, DT)
            dqs = dqg * eG
            dkk = dkn * eN + acc_dke * eE
            # dg per key: each decay term summed over the steps it spans (`_gate_grad`), so no
            # term enters with both signs (row sums minus column sums of the pair terms, then a
            # reverse cumsum, cancel terms ~1e4 to an error ~1e-3 in a dg of 0.04: fp16, v at
            # fp16's largest, one token)
            pairs = tl.where(strict[:, :, None], dp[:, :, None] * qg[:, None, :] * kn[None, :, :], 0.)
            dgo = _gate_grad_of_spans_k(acc_dqh * qg, _pair_spans_k(pairs), acc_dke * ke2,
                                        tl.exp(GC) * acc_dgc)
            if DELTA:
                dgo += tl.load(tile(dgp, r0, rows, ck, K, H), mask=mqk, other=0.)
            fin += tl.sum(dgo * 0., 1)
            tl.store(tile(dg, r0, rows, ck, K, H), dgo.to(dg.dtype.element_ty), mask=mqk)
        else:
            dqs = acc_dqh + _mm(dp, b_k, F32, DT)
            dkk = _mm(tl.trans(dp), b_q, F32, DT) * scale + acc_dke
        tl.store(tile(dq, r0, rows, ck, K, H), (dqs * scale).to(dq.dtype.element_ty), mask=mqk)
        if DELTA:
            dkk += tl.load(tile(dkp, r0, rows, ck, K, H), mask=mqk, other=0.)
        if GATE == 2:
            fin += tl.sum(dqs * 0. + dkk * 0., 1)
        tl.store(tile(dk, r0, rows, ck, K, H), dkk.to(dk.dtype.element_ty), mask=mqk)
    if GATE == 1:
        dgo = _gate_grad_of_spans(qh * eG, spans, ke * eE, tl.exp(GC) * tl.sum(hd, 0))
        if DELTA:
            dgo += tl.load(dgp + tok.to(tl.int64) * H + ih, mask=rv, other=0.)
        tl.store(dg + tok.to(tl.int64) * H + ih, dgo.to(dg.dtype.element_ty), mask=rv)
    if GATE == 2:
        _overflowed(flag, cid, ih, H, fin)


@triton.jit
def _overflowed(flag, cid, ih, H, fin):
    """Sets the chunk's exact-path flag where its matrix path left a gradient outside fp32's
    range (``fin``: row sums of the gradients times 0, NaN in a row with an Inf or NaN, else
    0): `_exact`, launched after both gradient kernels, then rewrites every gradient of the
    chunk step by step, in float64.  Checked with the vector gate, whose factored products
    take exp(-G), up to exp(VECTOR_DECAY_MAX), before the decay exp(G) that brings them back:
    with finite inputs within BIG and states within SBIG such a product can overflow where
    the gradient is finite ((dA K_n) exp(G) put dk at +Inf and NaN where the oracle's is 1.6e28,
    a state gradient near SBIG: crashes/gdn_bwd_kda/nonfinite-dk/03397a04cdf4c7d8); a gradient
    truly past fp32's range the step path rounds to the same Inf.  The scalar gate's pair
    decays exp(G_i - G_j) are formed whole, and no other product grows past its gradient."""
    tl.store(flag + cid * H + ih, 1, mask=tl.sum(fin, 0) != 0.)
