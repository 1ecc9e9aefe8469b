"""The GDN-family forward in Triton: `chunk_gdn_fwd`.

Algorithm: the chunked form written out in `gdn.reference` (its docstring is
the statement this file follows).  Up to seven launches:

  0. `_gate_prefix_kernel` (gated members), one program per (chunk, head): the
     chunk-local prefix sums of the gates, stored fp32, and one flag per
     (chunk, head) that says whether the gates admit the matrix path.
  1. `gdn.fwd_prep._prep_inv_kernel` (delta members), one program per (chunk,
     head): builds A = tril(beta k k^T * decay) and its inverse T = (I + A)^-1
     from 16x16 blocks, stores T (fp32; bf16 for bf16 inputs), and one flag per
     (chunk, head) that says whether the chunk's k and beta admit the matrix path;
  1b. `gdn.fwd_prep._prep_wu_kernel`, one program per (chunk, head): w = T
     (beta Gamma k), then u = T (beta v), from the stored T; the flag gains v's
     check.  Two launches rather than one: one program holding T in registers
     for both runs at 255 registers and is slower than the two with T's round
     trip through memory.
  2. `gdn.fwd_state._state_kernel`, one program per (sequence, head, V tile), walks its
     sequence chunk by chunk with the state S [K, BV] in registers, fp32: stores
     the state entering each chunk and v_new = u - w S (delta), and marks the
     chunks it had to step token by token (xflag, per V column), whose o it
     stores from each step's float64 state.  Two launches: the matrix part
     (PART 0) stops at the first chunk that fails the checks, the resume part
     (PART 1) goes on from there, token by token where needed (there a chunk
     whose q fails the checks too).
  3. `_out_kernel`, one program per (chunk, head, V tile), all parallel:
     o = scale ((Gamma q) S + (q k^T decay) v_new) from the stored state (PART 0),
     or token by token from it in the tiles PART 0 leaves, where q fails the
     checks (before the state pass's resume part) or the state pass stepped a
     column, less the 16-column slices it stepped, whose o it wrote (PART 1,
     one program per `out_chunks` chunks (`gdn.config`), head and V tile).
     Kept apart, the matrix parts hold no float64 tiles: the state kernel's matrix
     part runs without spills, and its loop, without a branch, is pipelined.

The NaN/Inf contract (kfuzz G05: the NaN set and the Inf set equal those of
`gdn.oracle.recurrence` exactly).  The matrix path mixes every position of a
chunk into every output of it (a masked-out future NaN still multiplies in:
0 * NaN = NaN) and turns an Inf in v into inf where the step-by-step sums give
NaN.  So each chunk takes the matrix path only when its q, k, v, beta are all
finite and at most BIG in magnitude, its gates are <= 0 (scalar: -inf allowed,
clamped at -110 where exp is already 0 in fp32; vector: the chunk's total decay
at most 60 per key), and the incoming state is finite and at most SBIG.
Otherwise it runs token by token with the oracle's own formulas, each step in
float64 (the exact path, `gdn.common.exact_chunk`).  Once a NaN enters S it never
leaves (0 * NaN = NaN), so the rest of that sequence's V tile then runs exactly,
which is slow: pathological inputs are slow, normal ones fast.

Precision: states and accumulation in fp32; the state and output kernels'
products take bf16 operands for bf16 inputs on GPUs (only where the output's N
dimension is >= 32, `gdn.common.odot`), fp32 ones otherwise (tf32 on GPUs, "tf32x3" for fp32
inputs, about fp32 accuracy); the tensors handed between launches are bf16 for
bf16 inputs and fp32 otherwise.  Under the Triton
interpreter (TRITON_INTERPRET=1) products are "ieee", or a GPU's with
GDN_DEVICE_PRODUCTS=1 (`gdn.common.EXACT_PRODUCTS`), and no autotuning runs.

The gated members' prefix sums come from launch 0: computed next to the matrix
path's products they fault on the H200 (Triton 3.6, an illegal address).
`tools/check_gdn_gpu.py` checks the kernels on a GPU.

Refuses: K or V over 256, mixed q/k/v dtypes, dtypes other than bf16/fp16/fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn import fwd_prep, fwd_state
from gdn.common import (BIG, EXACT_PRODUCTS, GATE_FLOOR, INTERPRET, SBIG, VECTOR_DECAY_MAX, chunk_span,
                        chunk_tokens, exact_chunk, forward_precision, group_flag, handoff_dtype, in_product_range,
                        kept_plan, load_gates, mask_and, odot, pow2, q_admits_matrix, tile)
from gdn.config import DEFAULT, GDNConfig


# The chunk-local gate prefix sums are computed by their own kernel and stored,
# and the matrix kernels only load them (as the fla library does).  Computed
# inside the matrix kernels, the prefix sums meet dot layouts: on the H200 with
# Triton 3.6 both tl.cumsum (cf. triton-lang/triton#7817) and a float64
# masked sum (which the compiler converts into a slice of a dot-operand layout)
# fault with an illegal address at the matrix path's products.
@triton.jit
def _gate_prefix_kernel(g, gc, gcl, gflag, cb_ptr, ce_ptr, T, NT,
                        H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                        BH: tl.constexpr, GATE: tl.constexpr, IS_VARLEN: tl.constexpr,
                        FLOOR: tl.constexpr, DECAY_MAX: tl.constexpr):
    """Per chunk and block of BH heads (scalar gate; a [BT, BH] tile, contiguous rows) or per
    (chunk, head) (vector gate; a [BT, K] tile): gc = inclusive prefix sums of the gates within
    the chunk (scalar: clamped at FLOOR, summed in float64 and stored as two fp32 numbers,
    gc + gcl, so that differences G_i - G_j of large sums keep their digits; vector: fp32, at
    most DECAY_MAX per chunk), and gflag = "the gates admit the matrix path" (all <= 0;
    vector: the chunk's total decay at most DECAY_MAX per key).  The scalar gate takes a block
    of heads a program, so that its loads are contiguous rows, not one gate in every H."""
    i_c, i_x = tl.program_id(0), tl.program_id(1)
    bos, eos = chunk_span(i_c, cb_ptr, ce_ptr, T, NT, BT, IS_VARLEN)
    rr = tl.arange(0, BT)
    rmask = bos + rr < eos
    if GATE == 1:
        hh = i_x * BH + tl.arange(0, BH)
        hmask = hh < H
        m2 = rmask[:, None] & hmask[None, :]
        gx = rr[:, None] * H + hh[None, :]
        b0 = bos.to(tl.int64) * H
        gg = tl.load(g + b0 + gx, mask=m2, other=0.0).to(tl.float32)
        ok = tl.max(tl.where(gg <= 0, 0, 1), axis=0) == 0
        G = tl.cumsum(tl.maximum(gg, FLOOR).to(tl.float64), axis=0)
        hi = G.to(tl.float32)
        tl.store(gc + b0 + gx, hi, mask=m2)
        tl.store(gcl + b0 + gx, (G - hi.to(tl.float64)).to(tl.float32), mask=m2)
        tl.store(gflag + i_c * H + hh, ok.to(tl.int32), mask=hmask)
    else:
        dk = tl.arange(0, BK)
        m2 = rmask[:, None] & (dk[None, :] < K)
        r0 = bos.to(tl.int64) * H + i_x
        gv = tl.load(tile(g, r0, rr, dk, K, H), mask=m2, other=0.0).to(tl.float32)
        ok = (tl.max(tl.where(gv <= 0, 0, 1)) == 0) & (tl.min(tl.sum(gv, axis=0)) >= -DECAY_MAX)
        tl.store(tile(gc, r0, rr, dk, K, H), tl.cumsum(gv, axis=0), mask=m2)
        tl.store(gflag + i_c * H + i_x, ok.to(tl.int32))


@triton.jit
def _out_tile(q, k, v, g, gc, gcl, beta, hs, hexp, vn, xflag, oflag, o, cb_ptr, ce_ptr, scale, T, NT, NC,
              i_v, i_c, i_h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
              GATE: tl.constexpr, DELTA: tl.constexpr, IS_VARLEN: tl.constexpr,
              PREC: tl.constexpr, BIG: tl.constexpr, DT: tl.constexpr,
              PART: tl.constexpr, BKS: tl.constexpr):
    """One (V tile, chunk, head) of `_out_kernel`'s PART 0 (the matrix part, which marks in
    oflag the tiles it left) or PART 1 (token by token)."""
    bos, eos = chunk_span(i_c, cb_ptr, ce_ptr, T, NT, BT, IS_VARLEN)
    of = oflag + (i_v * NC + i_c).to(tl.int64) * H + i_h
    if bos < eos:
        rr = tl.arange(0, BT)
        r0 = bos.to(tl.int64) * H + i_h
        rmask = bos + rr < eos
        nlast = eos - bos - 1   # the chunk's last token's row
        dk = tl.arange(0, BK)
        kmask = dk < K
        dv = i_v * BV + tl.arange(0, BV)
        vmask = dv < V
        smask = kmask[:, None] & vmask[None, :]
        mk = rmask[:, None] & kmask[None, :]
        mv = rmask[:, None] & vmask[None, :]
        cid = i_c.to(tl.int64)
        hbase = (cid * H + i_h) * K * V
        if PART == 0 and BKS < BK:
            # K in BKS-wide slices (no vector gate), a pipelined loop: (Gamma q) S and q k^T
            # summed over the slices, the decay applied to q k^T after it.  (Gamma applied to
            # the fp32 sum q S after the loop instead gives o up to 28% off on the H200 with
            # Triton 3.6, bf16, scalar gate, K 128 and 184, at 3 stages; tools/sweep_gdn_gpu.py.)
            acc = tl.zeros([BT, BV], dtype=tl.float32)
            Aqk = tl.zeros([BT, BT], dtype=tl.float32)
            # the state pass's xflag over the tile: loaded here, reduced across the warps after
            # the loop, so that the loop's first copies need not wait for it
            xf = tl.load(xflag + (cid * H + i_h) * V + dv, mask=vmask, other=0)
            nbad = 0
            if GATE == 1:
                G, Glo, _, _ = load_gates(gc, gcl, r0, rr, rmask, nlast, dk, mk, H, K, GATE)
                eq = tl.exp(G + Glo)
            for ks in range(0, BK // BKS):
                dks = ks * BKS + tl.arange(0, BKS)
                mks = rmask[:, None] & (dks < K)[None, :]
                qs = tl.load(tile(q, r0, rr, dks, K, H), mask=mks, other=0.0)
                kss = tl.load(tile(k, r0, rr, dks, K, H), mask=mks, other=0.0)
                Ss = tl.load(hs + hbase + (dks[:, None] * V + dv[None, :]),
                             mask=(dks < K)[:, None] & vmask[None, :], other=0.0)
                nbad += tl.where(in_product_range(qs, BIG), 0, 1)
                Aqk += odot(qs, tl.trans(kss), DT, PREC)
                if GATE == 1:
                    acc += odot(qs * eq[:, None], Ss, DT, PREC)
                else:
                    acc += odot(qs, Ss, DT, PREC)
            nbad += tl.max(xf.to(tl.int32))
            ok = nbad == 0
            tl.store(of, tl.where(ok, 0, 1).to(tl.int8))
            causal = rr[:, None] >= rr[None, :]
            if GATE == 1:
                Aqk = Aqk * tl.exp(tl.where(causal, (G[:, None] - G[None, :]) + (Glo[:, None] - Glo[None, :]), 0.0))
            Aqk = tl.where(causal, Aqk, 0.0)
            vt = tl.load(tile(vn if DELTA else v, r0, rr, dv, V, H), mask=mv, other=0.0)
            ot = (acc + odot(Aqk, vt, DT, PREC)) * scale
            tl.store(tile(o, r0, rr, dv, V, H), ot.to(o.dtype.element_ty), mask=mask_and(mv, ok))
        elif PART == 0:
            S = tl.load(hs + hbase + (dk[:, None] * V + dv[None, :]), mask=smask, other=0.0)
            qt = tl.load(tile(q, r0, rr, dk, K, H), mask=mk, other=0.0)
            xf = tl.load(xflag + (cid * H + i_h) * V + dv, mask=vmask, other=0)
            ok = (tl.max(xf.to(tl.int32)) == 0) & q_admits_matrix(qt, BIG, GATE)
            tl.store(of, tl.where(ok, 0, 1).to(tl.int8))
            if ok:
                kt = tl.load(tile(k, r0, rr, dk, K, H), mask=mk, other=0.0)
                causal = rr[:, None] >= rr[None, :]
                if GATE == 1:
                    G, Glo, _, _ = load_gates(gc, gcl, r0, rr, rmask, nlast, dk, mk, H, K, GATE)
                    dec = tl.exp(tl.where(causal, (G[:, None] - G[None, :]) + (Glo[:, None] - Glo[None, :]), 0.0))
                    Aqk = odot(qt, tl.trans(kt), DT, PREC) * dec
                    qg = qt * tl.exp(G + Glo)[:, None]
                elif GATE == 2:
                    G, _, _, _ = load_gates(gc, gcl, r0, rr, rmask, nlast, dk, mk, H, K, GATE)
                    qg = qt * tl.exp(G)
                    Aqk = odot(qg, tl.trans(kt.to(tl.float32) * tl.exp(-G)), DT, PREC)
                else:
                    Aqk = odot(qt, tl.trans(kt), DT, PREC)
                    qg = qt
                Aqk = tl.where(causal, Aqk, 0.0)
                if DELTA:
                    vt = tl.load(tile(vn, r0, rr, dv, V, H), mask=mv, other=0.0)
                else:
                    vt = tl.load(tile(v, r0, rr, dv, V, H), mask=mv, other=0.0)
                ot = (odot(qg, S, DT, PREC) + odot(Aqk, vt, DT, PREC)) * scale
                tl.store(tile(o, r0, rr, dv, V, H), ot.to(o.dtype.element_ty), mask=mv)
        else:
            # float64 on 16-column slices of the entering state (the recurrence is separable
            # in V): a [BK, 16] float64 tile live, not [BK, BV] (sm_90, K=V=256: no more stack).
            # A slice the state pass stepped (xflag; its resume tiles, multiples of 16 wide,
            # hold whole slices) has its o from there, from the state the pass holds, not from
            # hs in the hand-off dtype; the others are taken here (q fails its checks where the
            # state pass's matrix part ran, or a stepped slice shares the tile).  One flag a
            # slice, not a column mask: with the mask this part spills (sm_90 offline: 16-24
            # bytes of stack at 80 registers)
            XV: tl.constexpr = 16 if BV > 16 else BV
            for j in range(0, BV // XV):
                dvj = i_v * BV + j * XV + tl.arange(0, XV)
                vmj = dvj < V
                xj = tl.load(xflag + (cid * H + i_h) * V + dvj, mask=vmj, other=1)
                if tl.min(xj) == 0:
                    smj = kmask[:, None] & vmj[None, :]
                    Sj = tl.load(hs + hbase + (dk[:, None] * V + dvj[None, :]), mask=smj, other=0.0)
                    Ej = tl.load(hexp + (cid * H + i_h) * V + dvj, mask=vmj, other=0).to(tl.float64)
                    exact_chunk(q, k, v, g, beta, o, Sj.to(tl.float64) * tl.exp2(Ej)[None, :],
                                scale, bos, eos, i_h, dk, kmask, dvj, vmj, smj, H, K, V, BT, GATE,
                                DELTA)


@triton.jit
def _out_kernel(q, k, v, g, gc, gcl, beta, hs, hexp, vn, xflag, oflag, o, cb_ptr, ce_ptr, scale, T, NT, NC,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                GATE: tl.constexpr, DELTA: tl.constexpr, IS_VARLEN: tl.constexpr,
                PREC: tl.constexpr, BIG: tl.constexpr, DT: tl.constexpr,
                PART: tl.constexpr, BKS: tl.constexpr, G: tl.constexpr):
    """The parallel part: o = scale (Gamma q) S + (q k^T decay) v_new with S the stored state
    entering the chunk (PART 0, a program per (V tile, chunk, head), which marks in oflag the
    tiles it left: q fails the matrix path's checks, or the state pass stepped a column
    (xflag)); token by token from that state in the marked tiles' columns that the state pass
    did not step, whose o it stored itself (PART 1, launched after PART 0: a program per
    (V tile, G chunks, head) reads their marks in one load and takes the marked ones in turn,
    rather than a program a tile with nearly all of them having nothing to do).  Apart, the
    matrix part holds no float64 tiles."""
    i_v, i_h = tl.program_id(0), tl.program_id(2)
    if PART == 0:
        _out_tile(q, k, v, g, gc, gcl, beta, hs, hexp, vn, xflag, oflag, o, cb_ptr, ce_ptr, scale, T, NT,
                  NC, i_v, tl.program_id(1), i_h, H, K, V, BK, BV, BT, GATE, DELTA, IS_VARLEN,
                  PREC, BIG, DT, PART, BKS)
    else:
        c0 = tl.program_id(1) * G
        cs = c0 + tl.arange(0, G)
        marks = tl.load(oflag + (i_v * NC + cs).to(tl.int64) * H + i_h, mask=cs < NC,
                        other=0).to(tl.int32)
        if tl.max(marks, 0) > 0:
            for j in range(0, G):
                if group_flag(marks, cs, c0 + j) > 0:
                    _out_tile(q, k, v, g, gc, gcl, beta, hs, hexp, vn, xflag, oflag, o, cb_ptr, ce_ptr,
                              scale, T, NT, NC, i_v, c0 + j, i_h, H, K, V, BK, BV, BT, GATE, DELTA,
                              IS_VARLEN, PREC, BIG, DT, PART, BKS)


def out_launch(BK: int, V: int, gate: int, dtype: torch.dtype, config: GDNConfig = DEFAULT) -> dict:
    """The output kernel's launch keywords at these sizes and input dtype: BV (at least 64, at
    most V's next power of 2), BKS (the K slice; BK: K whole), num_warps and, where set (not
    under the interpreter), maxnreg and num_stages.  bf16 inputs where K is wider than
    ``config.out_sliced.bk`` (no vector gate) take `out_sliced`: the dtype swept on the H200;
    fp32 inputs at K over 128 (no vector gate) `out_wide_fp32`, which fits the shared memory;
    the rest `out_whole`, K in one piece."""
    sliced = config.out_sliced
    if gate != 2 and dtype == torch.bfloat16 and 0 < sliced.bk < BK:
        la, bk = sliced, sliced.bk
    elif gate != 2 and dtype == torch.float32 and BK > 128:
        la, bk = config.out_wide_fp32, config.out_wide_fp32.bk or BK
    else:
        la, bk = config.out_whole, BK
    out = {"BV": max(64, min(la.bv, pow2(V))), "BKS": max(16, min(bk, BK)), "num_warps": la.warps}
    if not INTERPRET:
        if la.maxnreg:
            out["maxnreg"] = la.maxnreg
        if la.stages:
            out["num_stages"] = la.stages
    return out



def _build_plan(cu_seqlens, T: int, BT: int, dev):
    """(N, NC, cu, cb, ce, choff): sequences, chunks, the offsets and each chunk's first and
    end token (int32, on ``dev``), each sequence's first chunk; reads cu_seqlens on the host."""
    i32 = torch.int32
    offs = [int(x) for x in cu_seqlens.tolist()]
    if len(offs) < 2 or offs[0] != 0 or offs[-1] != T or any(a > b for a, b in zip(offs, offs[1:])):
        raise ValueError("cu_seqlens needs B == 1 and nondecreasing offsets from 0 to T")
    N = len(offs) - 1
    spans = [(s, min(s + BT, e)) for bs, e in zip(offs, offs[1:]) for s in range(bs, e, BT)]
    counts = [triton.cdiv(e - bs, BT) for bs, e in zip(offs, offs[1:])]
    cu = torch.tensor(offs, dtype=i32, device=dev)
    cb = torch.tensor([s for s, _ in spans] or [0], dtype=i32, device=dev)
    ce = torch.tensor([e for _, e in spans] or [0], dtype=i32, device=dev)
    choff = torch.tensor([sum(counts[:n]) for n in range(N)], dtype=i32, device=dev)
    return N, len(spans), cu, cb, ce, choff


def varlen_plan(cu_seqlens, T: int, BT: int, dev):
    """`_build_plan`'s tables, kept (`kept_plan`) per cu_seqlens tensor and version, T, chunk
    and device."""
    return kept_plan(cu_seqlens, ("fwd", T, BT, str(dev)), lambda: _build_plan(cu_seqlens, T, BT, dev))


def chunk_gdn_fwd(q, k, v, g=None, beta=None, *, scale=None, initial_state=None,
                  output_final_state=True, cu_seqlens=None, delta=True, return_inverse=False,
                  return_saved=False, config: GDNConfig = DEFAULT):
    """The GDN-family forward.  q, k [B,T,H,K], v [B,T,H,V] (one dtype of bf16,
    fp16, fp32); g None, [B,T,H] or [B,T,H,K]; beta [B,T,H] (delta=True);
    initial_state [N,H,K,V]; cu_seqlens [N+1] offsets with B == 1.  Returns
    (o [B,T,H,V] in q's dtype, final_state [N,H,K,V] fp32 or None), and with
    return_inverse a third item: the WY prep's T = (I + A)^-1 of every chunk, fp32 (bf16 for
    bf16 inputs with no gate or a scalar one: `gdn.fwd_prep.t_dtype`)
    [B,T,H,BT] (the backward's `inverse`), or None where the prep did not run (no
    delta rule, no chunk).  With return_saved the third item is instead what the backward can
    take from the forward (`saved_for_backward`), or None where there is no chunk.  ``config``:
    the launch choices (`gdn.config`)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k.dtype != q.dtype \
            or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one of bf16/fp16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != q.shape or v.shape[:3] != q.shape[:3] or K > 256 or V > 256:
        raise ValueError(f"need q, k [B,T,H,K], v [B,T,H,V], K, V <= 256; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if delta and (beta is None or tuple(beta.shape) != (B, T, H)):
        raise ValueError("delta=True needs beta of shape [B,T,H]")
    gate = 0 if g is None else (1 if g.dim() == 3 else 2)
    if gate and tuple(g.shape) != ((B, T, H) if gate == 1 else (B, T, H, K)):
        raise ValueError(f"g must be [B,T,H] or [B,T,H,K]; got {tuple(g.shape)}")
    scale = K ** -0.5 if scale is None else float(scale)
    dev = q.device
    BT = chunk_tokens(gate == 2)
    BK = pow2(K)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g = q.new_zeros(1) if g is None else g.contiguous()
    beta = q.new_zeros(1) if beta is None else beta.contiguous()
    i32 = torch.int32
    if cu_seqlens is None:
        N, NT = B, triton.cdiv(T, BT)
        NC = B * NT
        cu = cb = ce = choff = torch.zeros(1, dtype=i32, device=dev)
    else:
        if B != 1:
            raise ValueError("cu_seqlens needs B == 1 and nondecreasing offsets from 0 to T")
        N, NC, cu, cb, ce, choff = varlen_plan(cu_seqlens, T, BT, dev)
        NT = 0
    if initial_state is not None:
        if tuple(initial_state.shape) != (N, H, K, V):
            raise ValueError(f"initial_state must be [{N},{H},{K},{V}]; got {tuple(initial_state.shape)}")
        h0 = initial_state.contiguous()
    else:
        h0 = q.new_zeros(1, dtype=torch.float32)
    inter = handoff_dtype(q.dtype)
    prec = forward_precision(q.dtype)
    o = torch.empty_like(v, dtype=q.dtype)
    hT = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if output_final_state else \
        q.new_zeros(1, dtype=torch.float32)
    if NC == 0:
        if output_final_state:
            hT.copy_(initial_state if initial_state is not None else torch.zeros_like(hT))
        return (o, hT if output_final_state else None) + ((None,) if return_inverse or return_saved else ())
    if gate:
        gc = torch.empty(g.shape, dtype=torch.float32, device=dev)
        gcl = torch.empty(g.shape if gate == 1 else (1,), dtype=torch.float32, device=dev)
        gflag = torch.empty(NC, H, dtype=i32, device=dev)
        BH = min(pow2(H), 32)
        _gate_prefix_kernel[(NC, triton.cdiv(H, BH) if gate == 1 else H)](
            g, gc, gcl, gflag, cb, ce, T, max(NT, 1), H=H, K=K, BK=BK, BT=BT, BH=BH, GATE=gate,
            IS_VARLEN=cu_seqlens is not None, FLOOR=GATE_FLOOR, DECAY_MAX=VECTOR_DECAY_MAX)
    else:
        gc = gcl = gflag = q.new_zeros(1, dtype=torch.float32)
    if delta:
        lowp = q.dtype == torch.bfloat16 and gate != 2
        tm = torch.empty(B, T, H, BT, dtype=fwd_prep.t_dtype(lowp, BT, config), device=dev)
        w = torch.empty(B, T, H, K, dtype=inter, device=dev)
        u = torch.empty(B, T, H, V, dtype=inter, device=dev)
        vn = torch.empty(B, T, H, V, dtype=inter, device=dev)
        flag = torch.empty(NC, H, dtype=i32, device=dev)
        prep = dict(H=H, K=K, BK=BK, BT=BT, GATE=gate, IS_VARLEN=cu_seqlens is not None, PREC=prec, BIG=BIG)
        fwd_prep.launch_prep(k, v, gc, gcl, beta, tm, w, u, flag, cb, ce, T, max(NT, 1), V=V,
                             BV=config.prep_bv, lowp=lowp, interp=INTERPRET, config=config, **prep)
    else:
        tm = None
        w = u = vn = flag = q.new_zeros(1)
    hs = torch.empty(NC, H, K, V, dtype=inter, device=dev)
    # the state entering a chunk is hs 2^hexp: hexp is 0 but where the resume part of the
    # state pass hands on a state past fp32's range (`gdn.common.exact_chunk`)
    hexp = torch.zeros(NC, H, V, dtype=i32, device=dev)
    xflag = torch.empty(NC, H, V, dtype=torch.int8, device=dev)
    stop = torch.empty(N * H, V, dtype=i32, device=dev)
    sstop = torch.empty(N, H, K, V, dtype=torch.float32, device=dev)
    # bf16 operands in the matrix products for bf16 inputs on GPUs (as the trusted reference
    # rounds them); fp32 ones otherwise (tf32, "tf32x3" for fp32 inputs; "ieee" interpreted)
    dt = tl.bfloat16 if inter == torch.bfloat16 and not EXACT_PRODUCTS else tl.float32
    common = dict(H=H, K=K, V=V, BK=BK, BT=BT, GATE=gate, DELTA=delta, IS_VARLEN=cu_seqlens is not None,
                  PREC=prec, BIG=BIG, DT=dt)
    state_args = (q, k, v, g, gc, gcl, gflag, beta, w, u, flag, h0, hs, hexp, vn, xflag, o, hT, stop,
                  sstop, cu, choff, scale, T, max(NT, 1), triton.next_power_of_2(N * H))
    state_kw = dict(HAS_H0=initial_state is not None, STORE_HT=output_final_state, SBIG=SBIG,
                    **common)
    fwd_state.launch_state(state_args, N * H, config, **state_kw)
    launch = out_launch(BK, V, gate, q.dtype, config)
    oflag = torch.empty(triton.cdiv(V, launch["BV"]), NC, H, dtype=torch.int8, device=dev)
    for part in (0, 1):
        _out_kernel[(triton.cdiv(V, launch["BV"]), triton.cdiv(NC, config.out_chunks if part else 1), H)](
            q, k, v, g, gc, gcl, beta, hs, hexp, vn, xflag, oflag, o, cb, ce, scale, T, max(NT, 1), NC,
            PART=part, G=config.out_chunks, **launch, **common)
    if return_saved:
        return (o, hT if output_final_state else None,
                saved_for_backward(tm, hs, hexp, xflag, w, vn, delta, oflag))
    return (o, hT if output_final_state else None) + ((tm,) if return_inverse else ())


def saved_for_backward(tm, hs, hexp, xflag, w, vn, delta: bool, oflag=None) -> dict:
    """What the forward hands the backward (`gdn.chunk_bwd.chunk_gdn_bwd(..., saved=)`), so
    that it need not recompute it: "inverse", the WY prep's T (None where the prep did not
    run); "states", the state entering every chunk [NC,H,K,V] in the hand-off dtype, times
    2^"state_exp" (int32 [NC,H,V], a power of two per column: 0 but where the state is past
    fp32's range);
    "stepped", per chunk, head and V column, whether the state pass stepped the chunk token by
    token (int8 [NC,H,V]); with the delta rule where the prep ran, "w" = T diag(beta) K_g
    [B,T,H,K] and "v_new" = u - w S [B,T,H,V] (the backward's W and U; v_new is not
    written in stepped columns); "out_stepped", per output V tile, chunk and head, whether
    `_out_kernel` took the chunk token by token (q outside BIG, or a stepped column; int8
    [NVo,NC,H])."""
    out = {"inverse": tm, "states": hs, "state_exp": hexp, "stepped": xflag, "out_stepped": oflag}
    if delta:
        out.update(w=w, v_new=vn)
    return out
