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
     chunks it had to step token by token (xflag, per V column).  Two launches:
     the matrix part (PART 0) stops at the first chunk that fails the checks,
     the resume part (PART 1) goes on from there, token by token where needed.
  3. `_out_kernel`, one program per (chunk, head, V tile), all parallel:
     o = scale ((Gamma q) S + (q k^T decay) v_new) from the stored state (PART 0),
     or token by token from it where xflag is set or q fails the checks (PART 1, one
     program per OUT_CHUNKS chunks, head and V tile).
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
float64 (the exact path, `_exact_chunk`).  Once a NaN enters S it never leaves (0 * NaN = NaN), so the rest
of that sequence's V tile then runs exactly, which is slow: pathological inputs
are slow, normal ones fast.

Precision: states and accumulation in fp32; the state and output kernels'
products take bf16 operands for bf16 inputs on GPUs (only where every dimension
is >= 32, `_odot`), fp32 ones otherwise (tf32 on GPUs, "tf32x3" for fp32
inputs, about fp32 accuracy); the tensors handed between launches are bf16 for
bf16 inputs and fp32 otherwise.  Under the Triton
interpreter (TRITON_INTERPRET=1) products are "ieee" (its bf16 tl.dot is wrong)
and no autotuning runs.

The gated members' prefix sums come from launch 0: computed next to the matrix
path's products they fault on the H200 (Triton 3.6, an illegal address).
`tools/check_gdn_gpu.py` checks the kernels on a GPU.

Refuses: K or V over 256, mixed q/k/v dtypes, dtypes other than bf16/fp16/fp32.
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
GATE_FLOOR = -110.0     # exp(-110) == 0 in fp32: a clamped gate forgets exactly as -inf does
VECTOR_DECAY_MAX = 60.0  # exp(60) * |k| stays far inside fp32 in the vector-gate factoring
BIG = 65536.0            # input magnitude above which a chunk runs the exact path
SBIG = 1e30              # state magnitude above which a chunk runs the exact path
SCAN_MODE = os.environ.get("GDN_FWD_MODE")  # "1": matrix path only, "2": exact path only
GATED_FAST = INTERPRET or os.environ.get("GDN_FWD_GATED_FAST", "1") == "1"
# The output kernel's launch (`out_launch`).  For bf16 inputs where K is wider than
# OUT_LAUNCH["bk"] (and the gate is not a vector one, whose 16-token chunks keep one
# product), its matrix part runs K in a pipelined loop of slices that wide, with OUT_LAUNCH's
# V tile width and warps; else K in one piece, with OUT_LAUNCH_WHOLE's.  "bv" is at least 64 (see chunk_gdn_fwd) and at most the next
# power of 2 of V; "maxnreg" (optional) caps the registers a thread.  Sliced at 64-wide K and
# 128-wide V tiles with 8 warps, q k^T is formed once a chunk at 124 registers (sm_90
# offline), the fastest of the launches swept on the H200 (Triton 3.6, bf16, K=V=128).
OUT_LAUNCH = {"bk": 64, "bv": 128, "warps": 8}
OUT_LAUNCH_WHOLE = {"bv": 64, "warps": 4}
# fp32 inputs at K > 128 (see out_launch): 64-wide K slices at 64-wide V tiles, 4 warps, 2
# stages: 114688 bytes of shared memory at K = V = 256 (sm_90 offline).  Not run on a GPU yet.
OUT_LAUNCH_WIDE_FP32 = {"bk": 64, "bv": 64, "warps": 4, "stages": 2}
OUT_LAUNCH.update(json.loads(os.environ.get("GDN_FWD_OUT", "{}")))
# The chunks one program of the output kernel's PART 1 looks at (their marks in one load)
OUT_CHUNKS = 16
# Products take bf16 operands for bf16 inputs on GPUs in the state and output kernels (as
# the trusted reference rounds them; only where the output's N dimension is >= 32, see
# _odot), bf16 operands in the WY prep too (gdn.fwd_prep), and fp32 operands otherwise
# (tf32 on GPUs; fp32 inputs tf32x3; "ieee" under the interpreter).  The tensors one launch
# hands to the next (w, u, the chunk states, v_new) are stored in bf16 for bf16 inputs (as
# fla does; the outputs are bf16 anyway) and in fp32 otherwise (an fp16 state could
# overflow).


def handoff_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the tensors one launch hands to the next (forward and backward)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


BF16_MAX = tl.constexpr(3.3895313892515355e38)   # tl.constexpr: read inside kernels
FP32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _saturated(x, dtype: tl.constexpr):
    """x (fp32) with the finite values beyond ``dtype``'s range (bf16: |x| in (3.3895e38,
    3.4028e38]) set to its largest, keeping the sign; inf and NaN as they are."""
    if dtype == tl.bfloat16:
        x = tl.where((tl.abs(x) > BF16_MAX) & (tl.abs(x) <= FP32_MAX), tl.where(x > 0, BF16_MAX, -BF16_MAX), x)
    return x


@triton.jit
def _handoff(x, ptr):
    """A state (or state gradient) in the dtype of the hand-off tensor ``ptr`` points into,
    saturated (`_saturated`): stored as it is, an fp32 state near fp32's maximum (an initial
    state or final-state gradient drawn there) rounds to inf in bf16 on the GPU, and the
    exact path that reads it back gives NaN where the oracle is finite (G06 on gdn_bwd: dq and
    dk of every token of the head).  Triton's interpreter
    truncates fp32 -> bf16 where the GPU rounds to nearest, so the CPU never showed it.  Only
    the resume parts store such states: the matrix parts stop before them."""
    return _saturated(x, ptr.dtype.element_ty).to(ptr.dtype.element_ty)


@triton.jit
def _all_within(x, bound):
    """True when every element is finite and |x| <= bound (NaN fails).  In fp32:
    bound = 65536 rounds to inf in fp16, and |inf| <= inf would pass."""
    return tl.max(tl.where(tl.abs(x.to(tl.float32)) <= bound, 0, 1)) == 0


@triton.jit
def _max_nan(a, b):
    """max(a, b), NaN where either is NaN (max.NaN.f32)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _all_within_max(x, bound):
    """`_all_within` as one NaN-propagating max over |x| (a NaN wins it, and |inf| > bound),
    one instruction an element where `_all_within` takes a compare and a select.  The state
    pass's check of the state entering a chunk (a [K, BV] tile a chunk, on its serial chain).
    The other checks keep `_all_within`: with this form in it, `_out`'s K-sliced loop gives o
    5e-2 off at gate 0, K 184, V >= 16 on the H200 (tools/sweep_gdn_gpu.py --forward; the
    states right), and off the serial chain the form saves nothing measurable."""
    return tl.where(tl.reduce(tl.abs(x.to(tl.float32)), None, _max_nan) <= bound, 0, 1) == 0


@triton.jit
def _tile(ptr, r0, rr, cols, W, H):
    """Pointers to rows r0 + rr H (rr [BT]) and columns `cols` of a [.., H, W] tensor seen as
    rows of W: the 64-bit chunk base r0 (token bos at head i_h: bos H + i_h) added once, the
    offsets inside the chunk 32-bit (BT H W < 2^31).  An int64 offset per element costs two
    registers and two integer operations each.  (Forward and backward; W and H constexprs in
    the forward, runtime integers in the backward.)"""
    return (ptr + r0 * W) + (rr[:, None] * (H * W) + cols[None, :])


# The chunk-local gate prefix sums are computed by their own kernel and stored,
# and the matrix kernels only load them (as the fla library does).  Computed
# inside the matrix kernels, the prefix sums meet dot layouts: on the H200 with
# Triton 3.6 both tl.cumsum (cf. triton-lang/triton issue 7817) and a float64
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
    bos, eos = _chunk_span(i_c, cb_ptr, ce_ptr, T, NT, BT, IS_VARLEN)
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
        gv = tl.load(_tile(g, r0, rr, dk, K, H), mask=m2, other=0.0).to(tl.float32)
        ok = (tl.max(tl.where(gv <= 0, 0, 1)) == 0) & (tl.min(tl.sum(gv, axis=0)) >= -DECAY_MAX)
        tl.store(_tile(gc, r0, rr, dk, K, H), tl.cumsum(gv, axis=0), mask=m2)
        tl.store(gflag + i_c * H + i_x, ok.to(tl.int32))


@triton.jit
def _gate_last(gc, gcl, r0, nlast, idx, H: tl.constexpr, K: tl.constexpr, GATE: tl.constexpr):
    """The cumulative gate of a chunk's last token (row r0 + nlast H, see `_tile`): scalar gate,
    (hi, lo) broadcast along ``idx`` (loads of one address, so that Triton pipelines them as
    it does the chunk's gates); vector gate, its [BK] row (``idx`` the key columns) twice.
    Loaded, not summed out of the chunk's gates: each such sum is a reduction across the
    warps, with its barriers (the state pass's serial chain had four a chunk, 24 barriers a
    chunk at sm_90 offline; 14 loaded)."""
    if GATE == 1:
        return tl.load(gc + r0 + nlast * H + idx * 0), tl.load(gcl + r0 + nlast * H + idx * 0)
    GL = tl.load((gc + r0 * K) + nlast * (H * K) + idx, mask=idx < K, other=0.0)
    return GL, GL


@triton.jit
def _load_gates(gc, gcl, r0, rr, rmask, nlast, dk, m2, H: tl.constexpr, K: tl.constexpr,
                GATE: tl.constexpr):
    """A chunk's cumulative gates (rows r0 + rr H, see `_tile`), the padding rows set to the
    last token's (so no decay exponent within the chunk is positive: exp(0 - (-120)) is inf
    in fp32, and inf * 0 = NaN would spread through the products), and the last token's
    (``nlast`` its row, `_gate_last`): a scalar gate as (hi, lo, last hi, last lo), the last
    [BT] vectors of one value; a vector gate as (G, G, last row, last row)."""
    if GATE == 1:
        G = tl.load(gc + r0 + rr * H, mask=rmask, other=0.0)
        Gl = tl.load(gcl + r0 + rr * H, mask=rmask, other=0.0)
        GL, GLl = _gate_last(gc, gcl, r0, nlast, rr, H, K, GATE)
        return tl.where(rmask, G, GL), tl.where(rmask, Gl, GLl), GL, GLl
    else:
        G = tl.load(_tile(gc, r0, rr, dk, K, H), mask=m2, other=0.0)
        GL, _ = _gate_last(gc, gcl, r0, nlast, dk, H, K, GATE)
        G = tl.where(rmask[:, None], G, GL[None, :])
        return G, G, GL, GL


@triton.jit
def _inv_unit_lower(A, BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for A strictly lower [BT, BT], BT in {16, 32, 64}: forward
    substitution inside the 16x16 diagonal blocks (all blocks at once), then the
    block Neumann product (I + F)^-1 = I - F + F^2 - F^3, F = Dinv E, which is
    block forward substitution term by term."""
    NB: tl.constexpr = BT // 16
    r = tl.arange(0, BT)
    same = (r[:, None] // 16) == (r[None, :] // 16)
    D3 = tl.sum(tl.reshape(tl.where(same, A, 0.0), (NB, 16, NB, 16)), axis=2)
    a = tl.arange(0, 16)
    ia = a[None, :, None]
    ib = a[None, None, :]
    X = tl.where(ia == ib, 1.0, 0.0) + tl.zeros((NB, 16, 16), dtype=tl.float32)
    for i in tl.static_range(1, 16):
        row = tl.sum(tl.where(ia == i, D3, 0.0), axis=1)            # [NB, 16]: D[i, :]
        new = tl.sum(row[:, :, None] * X, axis=1)                   # [NB, 16]: D[i, :] X
        X = tl.where(ia == i, tl.where(ib == i, 1.0, 0.0) - new[:, None, :], X)
    X4 = tl.broadcast_to(tl.reshape(X, (NB, 16, 1, 16)), (NB, 16, NB, 16))
    Dinv = tl.where(same, tl.reshape(X4, (BT, BT)), 0.0)
    if NB > 1:
        eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
        F = tl.dot(Dinv, tl.where((r[:, None] // 16) > (r[None, :] // 16), A, 0.0),
                   input_precision=PREC)
        P = eye - F
        P = eye - tl.dot(F, P, input_precision=PREC)
        P = eye - tl.dot(F, P, input_precision=PREC)
        Dinv = tl.dot(P, Dinv, input_precision=PREC)
    return Dinv


@triton.jit
def _chunk_span(i_c, cb_ptr, ce_ptr, T, NT, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    if IS_VARLEN:
        bos = tl.load(cb_ptr + i_c)
        eos = tl.load(ce_ptr + i_c)
    else:
        i_b = i_c // NT
        bos = i_b * T + (i_c % NT) * BT
        eos = tl.minimum(bos + BT, i_b * T + T)
    return bos, eos


@triton.jit
def _exact_chunk(q, k, v, g, beta, o, S, scale, t0, eos, i_h, dk, kmask, dv, vmask, smask,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                 GATE: tl.constexpr, DELTA: tl.constexpr, STORE_O: tl.constexpr):
    """One chunk token by token with the oracle's formulas, each step in float64 as the oracle
    computes (so that a value the oracle keeps inside fp32's range is not an fp32 overflow of
    an intermediate: G06, beta at bf16's maximum); stores its outputs when STORE_O (rounded
    through fp32: Triton 3.9's interpreter rounds float64 to bf16 wrongly), returns the new
    state.  Between steps the state is kept in S's dtype (float64 in the output kernel); an
    fp32 one (the state kernel's, whose [BK, BV] tile in float64 spilled at sm_90) as
    S_true / 2^e, e > 0 only while the state's largest finite element is past 2^100, so a
    state that leaves fp32's range inside the chunk and comes back, as the oracle's may, is
    carried across (G06: final state 1.6e32 after a step past 3.4e38)."""
    RESCALE: tl.constexpr = S.dtype == tl.float32
    e = tl.full([], 0.0, tl.float64)
    for t in range(0, tl.minimum(BT, eos - t0)):
        tok = (t0 + t).to(tl.int64)
        Sd = S.to(tl.float64)
        if RESCALE:
            Sd = Sd * tl.exp2(e)
        kv = tl.load(k + (tok * H + i_h) * K + dk, mask=kmask, other=0.0).to(tl.float64)
        vv = tl.load(v + (tok * H + i_h) * V + dv, mask=vmask, other=0.0).to(tl.float64)
        if GATE == 1:
            Sd = tl.exp(tl.load(g + tok * H + i_h).to(tl.float64)) * Sd
        elif GATE == 2:
            av = tl.exp(tl.load(g + (tok * H + i_h) * K + dk, mask=kmask, other=0.0).to(tl.float64))
            Sd = av[:, None] * Sd
        if DELTA:
            bk = tl.load(beta + tok * H + i_h).to(tl.float64) * kv
            kS = tl.sum(kv[:, None] * Sd, axis=0)
            Sd = Sd - bk[:, None] * kS[None, :] + bk[:, None] * vv[None, :]
        else:
            Sd = Sd + kv[:, None] * vv[None, :]
        Sd = tl.where(smask, Sd, 0.0)   # padding stays 0 (no 0 * inf in it)
        if STORE_O:
            qv = scale * tl.load(q + (tok * H + i_h) * K + dk, mask=kmask, other=0.0).to(tl.float64)
            ov = tl.sum(qv[:, None] * Sd, axis=0)
            tl.store(o + (tok * H + i_h) * V + dv, ov.to(tl.float32).to(o.dtype.element_ty), mask=vmask)
        if RESCALE:
            a = tl.where(tl.abs(Sd) < float("inf"), tl.abs(Sd), 0.0)   # NaN and Inf keep no scale
            big = tl.max(tl.max(a, axis=1), axis=0)
            e = tl.where(big > 1.2676506002282294e30, tl.ceil(tl.log2(big)) - 100.0, 0.0)   # 2^100
            S = (Sd * tl.exp2(-e)).to(S.dtype)
        else:
            S = Sd.to(S.dtype)
    if RESCALE:
        S = (S.to(tl.float64) * tl.exp2(e)).to(S.dtype)
    return S


@triton.jit
def _odot(a, b, DT: tl.constexpr, PREC: tl.constexpr):
    """A matrix product of the forward and backward kernels: bf16 operands for bf16 inputs on
    GPUs (DT), fp32 ones at PREC otherwise and wherever the output's N dimension is under 32.
    bf16 products with N = 16 miscompile on the H200 with Triton 3.6: the output kernel at
    V <= 16 gives o 100% wrong, and the state kernel's 16-wide resume tiles read shared
    memory out of bounds (compute-sanitizer: DeltaNet with a NaN in v, "Invalid __shared__
    read of size 512 bytes" here).  M or K under 32 is fine (swept on the H200: forward and
    backward, every gate, K 16-184, V 1-80, bf16), so KDA's 16-token chunks keep bf16
    products."""
    narrow = b.shape[1] < 32
    if DT == tl.float32 or narrow:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def _and(mask, ok):
    """mask & ok for a scalar ok, as a store mask.  (`mask & ok` alone is int32 under Triton
    3.9's interpreter, which refuses it as a mask; tl.where(ok, mask, False) is the suspect of
    stores past the tensors' ends on the H200 with Triton 3.6: V=16 with 64-wide state
    tiles faulted, and o came out wrong at T=100.)"""
    return (mask & ok) != 0


@triton.jit
def _forced(ok, MODE: tl.constexpr):
    """The path decision under the bring-up switch GDN_FWD_MODE (1: matrix, 2: exact)."""
    if MODE == 1:
        return ok | True
    elif MODE == 2:
        return ok & False
    return ok


@triton.jit
def _out_tile(q, k, v, g, gc, gcl, beta, hs, vn, xflag, oflag, o, cb_ptr, ce_ptr, scale, T, NT, NC,
              i_v, i_c, i_h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
              GATE: tl.constexpr, DELTA: tl.constexpr, IS_VARLEN: tl.constexpr,
              PREC: tl.constexpr, BIG: tl.constexpr, MODE: tl.constexpr, DT: tl.constexpr,
              PART: tl.constexpr, BKS: tl.constexpr):
    """One (V tile, chunk, head) of `_out_kernel`'s PART 0 (the matrix part, which marks in
    oflag the tiles it left) or PART 1 (token by token)."""
    bos, eos = _chunk_span(i_c, cb_ptr, ce_ptr, T, NT, BT, IS_VARLEN)
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
                G, Glo, _, _ = _load_gates(gc, gcl, r0, rr, rmask, nlast, dk, mk, H, K, GATE)
                eq = tl.exp(G + Glo)
            for ks in range(0, BK // BKS):
                dks = ks * BKS + tl.arange(0, BKS)
                mks = rmask[:, None] & (dks < K)[None, :]
                qs = tl.load(_tile(q, r0, rr, dks, K, H), mask=mks, other=0.0)
                kss = tl.load(_tile(k, r0, rr, dks, K, H), mask=mks, other=0.0)
                Ss = tl.load(hs + hbase + (dks[:, None] * V + dv[None, :]),
                             mask=(dks < K)[:, None] & vmask[None, :], other=0.0)
                nbad += tl.where(_all_within(qs, BIG), 0, 1)
                Aqk += _odot(qs, tl.trans(kss), DT, PREC)
                if GATE == 1:
                    acc += _odot(qs * eq[:, None], Ss, DT, PREC)
                else:
                    acc += _odot(qs, Ss, DT, PREC)
            nbad += tl.max(xf.to(tl.int32))
            ok = _forced(nbad == 0, MODE)
            tl.store(of, tl.where(ok, 0, 1).to(tl.int8))
            causal = rr[:, None] >= rr[None, :]
            if GATE == 1:
                Aqk = Aqk * tl.exp(tl.where(causal, (G[:, None] - G[None, :]) + (Glo[:, None] - Glo[None, :]), 0.0))
            Aqk = tl.where(causal, Aqk, 0.0)
            vt = tl.load(_tile(vn if DELTA else v, r0, rr, dv, V, H), mask=mv, other=0.0)
            ot = (acc + _odot(Aqk, vt, DT, PREC)) * scale
            tl.store(_tile(o, r0, rr, dv, V, H), ot.to(o.dtype.element_ty), mask=_and(mv, ok))
        elif PART == 0:
            S = tl.load(hs + hbase + (dk[:, None] * V + dv[None, :]), mask=smask, other=0.0)
            qt = tl.load(_tile(q, r0, rr, dk, K, H), mask=mk, other=0.0)
            xf = tl.load(xflag + (cid * H + i_h) * V + dv, mask=vmask, other=0)
            ok = _forced((tl.max(xf.to(tl.int32)) == 0) & _all_within(qt, BIG), MODE)
            tl.store(of, tl.where(ok, 0, 1).to(tl.int8))
            if ok:
                kt = tl.load(_tile(k, r0, rr, dk, K, H), mask=mk, other=0.0)
                causal = rr[:, None] >= rr[None, :]
                if GATE == 1:
                    G, Glo, _, _ = _load_gates(gc, gcl, r0, rr, rmask, nlast, dk, mk, H, K, GATE)
                    dec = tl.exp(tl.where(causal, (G[:, None] - G[None, :]) + (Glo[:, None] - Glo[None, :]), 0.0))
                    Aqk = _odot(qt, tl.trans(kt), DT, PREC) * dec
                    qg = qt * tl.exp(G + Glo)[:, None]
                elif GATE == 2:
                    G, _, _, _ = _load_gates(gc, gcl, r0, rr, rmask, nlast, dk, mk, H, K, GATE)
                    qg = qt * tl.exp(G)
                    Aqk = _odot(qg, tl.trans(kt.to(tl.float32) * tl.exp(-G)), DT, PREC)
                else:
                    Aqk = _odot(qt, tl.trans(kt), DT, PREC)
                    qg = qt
                Aqk = tl.where(causal, Aqk, 0.0)
                if DELTA:
                    vt = tl.load(_tile(vn, r0, rr, dv, V, H), mask=mv, other=0.0)
                else:
                    vt = tl.load(_tile(v, r0, rr, dv, V, H), mask=mv, other=0.0)
                ot = (_odot(qg, S, DT, PREC) + _odot(Aqk, vt, DT, PREC)) * scale
                tl.store(_tile(o, r0, rr, dv, V, H), ot.to(o.dtype.element_ty), mask=mv)
        else:
            # float64 on 16-column slices of the entering state (the recurrence is separable
            # in V): a [BK, 16] float64 tile live, not [BK, BV] (sm_90, K=V=256: no more stack)
            XV: tl.constexpr = 16 if BV > 16 else BV
            for j in range(0, BV // XV):
                dvj = i_v * BV + j * XV + tl.arange(0, XV)
                vmj = dvj < V
                smj = kmask[:, None] & vmj[None, :]
                Sj = tl.load(hs + hbase + (dk[:, None] * V + dvj[None, :]), mask=smj, other=0.0)
                _exact_chunk(q, k, v, g, beta, o, Sj.to(tl.float64), scale, bos, eos, i_h, dk, kmask,
                             dvj, vmj, smj, H, K, V, BT, GATE, DELTA, True)


@triton.jit
def _group_flag(flags, cs, c):
    """The flag of chunk ``c`` from a group's flags ``flags`` over its chunks ``cs`` (one load
    a group: the token-by-token launches, `_out_kernel`'s PART 1 and the backward's `_exact`)."""
    return tl.sum(tl.where(cs == c, flags, 0), 0)


@triton.jit
def _out_kernel(q, k, v, g, gc, gcl, beta, hs, vn, xflag, oflag, o, cb_ptr, ce_ptr, scale, T, NT, NC,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                GATE: tl.constexpr, DELTA: tl.constexpr, IS_VARLEN: tl.constexpr,
                PREC: tl.constexpr, BIG: tl.constexpr, MODE: tl.constexpr, DT: tl.constexpr,
                PART: tl.constexpr, BKS: tl.constexpr, G: tl.constexpr):
    """The parallel part: o = scale (Gamma q) S + (q k^T decay) v_new with S the stored state
    entering the chunk (PART 0, a program per (V tile, chunk, head), which marks in oflag the
    tiles it left); token by token from that state where the state pass stepped the chunk
    (xflag) or q fails the matrix path's checks (PART 1, launched after PART 0: a program per
    (V tile, G chunks, head) reads their marks in one load and takes the marked ones in turn,
    rather than a program a tile with nearly all of them having nothing to do).  Apart, the
    matrix part holds no float64 tiles."""
    i_v, i_h = tl.program_id(0), tl.program_id(2)
    if PART == 0:
        _out_tile(q, k, v, g, gc, gcl, beta, hs, vn, xflag, oflag, o, cb_ptr, ce_ptr, scale, T, NT,
                  NC, i_v, tl.program_id(1), i_h, H, K, V, BK, BV, BT, GATE, DELTA, IS_VARLEN,
                  PREC, BIG, MODE, DT, PART, BKS)
    else:
        c0 = tl.program_id(1) * G
        cs = c0 + tl.arange(0, G)
        marks = tl.load(oflag + (i_v * NC + cs).to(tl.int64) * H + i_h, mask=cs < NC,
                        other=0).to(tl.int32)
        if tl.max(marks, 0) > 0:
            for j in range(0, G):
                if _group_flag(marks, cs, c0 + j) > 0:
                    _out_tile(q, k, v, g, gc, gcl, beta, hs, vn, xflag, oflag, o, cb_ptr, ce_ptr,
                              scale, T, NT, NC, i_v, c0 + j, i_h, H, K, V, BK, BV, BT, GATE, DELTA,
                              IS_VARLEN, PREC, BIG, MODE, DT, PART, BKS)


def _pow2(n):
    return max(16, triton.next_power_of_2(n))


def out_launch(BK: int, V: int, gate: int, dtype: torch.dtype) -> dict:
    """The output kernel's launch at these sizes and input dtype (see OUT_LAUNCH): BV, BKS,
    num_warps and, where set (not under the interpreter), maxnreg and num_stages.  bf16
    inputs are sliced (OUT_LAUNCH): the dtype swept on the H200.  fp32 inputs at K over 128
    are sliced at OUT_LAUNCH_WIDE_FP32: in one piece the kernel needs 262144 bytes of shared
    memory at K = V = 256 (sm_90 offline), more than any GPU has (the H200: 232448); the rest
    take OUT_LAUNCH_WHOLE."""
    bk = OUT_LAUNCH.get("bk") or 0
    if gate != 2 and dtype == torch.bfloat16 and 0 < bk < BK:
        la = OUT_LAUNCH
    elif gate != 2 and dtype == torch.float32 and BK > 128:
        la = OUT_LAUNCH_WIDE_FP32
    else:
        la = dict(OUT_LAUNCH_WHOLE, bk=BK)
    out = {"BV": max(64, min(la["bv"], _pow2(V))), "BKS": max(16, min(la["bk"], BK)),
           "num_warps": la["warps"]}
    for key, arg in (("maxnreg", "maxnreg"), ("stages", "num_stages")):
        if la.get(key) and not INTERPRET:
            out[arg] = la[key]
    return out


# The varlen chunk tables of the last few cu_seqlens (`kept_plan`), newest last.
PLAN_CACHE_SIZE = 16   # a forward's and a backward's table for each of 8 cu_seqlens tensors
_plans: OrderedDict = OrderedDict()


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


def kept_plan(cu_seqlens, key: tuple, build):
    """``build()`` (a chunk table made from cu_seqlens), kept for the last PLAN_CACHE_SIZE
    (cu_seqlens tensor, ``key``) pairs: the forward's (`varlen_plan`) and the backward's
    (`gdn.bwd_chunks.chunk_plan`).  Reading cu_seqlens on the host waits for the GPU, so a
    launch that builds its tables on every call runs its host work with the GPU idle: on the
    H200 (bf16 GDN, 64 varlen sequences, T 32768 H16 K=V=128) that nearly doubles the
    forward's time.  An entry is the same tensor object (held by
    the cache, so its id is not reused) at the same version counter, which every in-place
    write through torch (views included) advances; a tensor without a version counter (made
    in inference mode) is read every time.  A write that bypasses torch (a raw kernel on its
    memory) is not seen: call `_plans.clear()` after one."""
    try:
        full = (id(cu_seqlens), cu_seqlens._version, cu_seqlens.data_ptr()) + tuple(key)
    except RuntimeError:   # an inference tensor: no version counter
        return build()
    hit = _plans.get(full)
    if hit is not None and hit[0] is cu_seqlens:
        _plans.move_to_end(full)
        return hit[1]
    plan = build()
    _plans[full] = (cu_seqlens, plan)
    while len(_plans) > PLAN_CACHE_SIZE:
        _plans.popitem(last=False)
    return plan


def varlen_plan(cu_seqlens, T: int, BT: int, dev):
    """`_build_plan`'s tables, kept (`kept_plan`) per cu_seqlens tensor and version, T, chunk
    and device."""
    return kept_plan(cu_seqlens, ("fwd", T, BT, str(dev)), lambda: _build_plan(cu_seqlens, T, BT, dev))


def chunk_gdn_fwd(q, k, v, g=None, beta=None, *, scale=None, initial_state=None,
                  output_final_state=True, cu_seqlens=None, delta=True, return_inverse=False,
                  return_saved=False):
    """The GDN-family forward.  q, k [B,T,H,K], v [B,T,H,V] (one dtype of bf16,
    fp16, fp32); g None, [B,T,H] or [B,T,H,K]; beta [B,T,H] (delta=True);
    initial_state [N,H,K,V]; cu_seqlens [N+1] offsets with B == 1.  Returns
    (o [B,T,H,V] in q's dtype, final_state [N,H,K,V] fp32 or None), and with
    return_inverse a third item: the WY prep's T = (I + A)^-1 of every chunk, fp32 (bf16 for
    bf16 inputs with no gate or a scalar one: `gdn.fwd_prep.t_dtype`)
    [B,T,H,BT] (the backward's `inverse`), or None where the prep did not run (no
    delta rule, the exact-path mode, no chunk).  With return_saved the third item is
    instead what the backward can take from the forward (`saved_for_backward`), or None where
    there is no chunk."""
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
    BT = 16 if gate == 2 else 64
    BK = _pow2(K)
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
    prec = "ieee" if INTERPRET else ("tf32x3" if q.dtype == torch.float32 else "tf32")
    mode = int(SCAN_MODE) if SCAN_MODE else (0 if gate == 0 or GATED_FAST else 2)
    o = torch.empty_like(v, dtype=q.dtype)
    hT = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if output_final_state else \
        q.new_zeros(1, dtype=torch.float32)
    if NC == 0:
        if output_final_state:
            hT.copy_(initial_state if initial_state is not None else torch.zeros_like(hT))
        return (o, hT if output_final_state else None) + ((None,) if return_inverse or return_saved else ())
    if gate and mode != 2:
        gc = torch.empty(g.shape, dtype=torch.float32, device=dev)
        gcl = torch.empty(g.shape if gate == 1 else (1,), dtype=torch.float32, device=dev)
        gflag = torch.empty(NC, H, dtype=i32, device=dev)
        BH = min(_pow2(H), 32)
        _gate_prefix_kernel[(NC, triton.cdiv(H, BH) if gate == 1 else H)](
            g, gc, gcl, gflag, cb, ce, T, max(NT, 1), H=H, K=K, BK=BK, BT=BT, BH=BH, GATE=gate,
            IS_VARLEN=cu_seqlens is not None, FLOOR=GATE_FLOOR, DECAY_MAX=VECTOR_DECAY_MAX)
    else:
        gc = gcl = gflag = q.new_zeros(1, dtype=torch.float32)
    # V tiles of the prep and output kernels: 64 wide at any V (masked past it).  Narrower ones
    # miscompile on the H200 with Triton 3.6, bf16: 16-wide give o 100% wrong, and 32-wide
    # (V 32, K >= 64) o 0.36-0.7 off or an illegal address (tools/sweep_gdn_gpu.py)
    BVP = 64
    if delta and mode != 2:
        from gdn import fwd_prep   # here: gdn.fwd_prep imports this module's helpers
        lowp = q.dtype == torch.bfloat16 and gate != 2
        tm = torch.empty(B, T, H, BT, dtype=fwd_prep.t_dtype(lowp, BT), device=dev)
        w = torch.empty(B, T, H, K, dtype=inter, device=dev)
        u = torch.empty(B, T, H, V, dtype=inter, device=dev)
        vn = torch.empty(B, T, H, V, dtype=inter, device=dev)
        flag = torch.empty(NC, H, dtype=i32, device=dev)
        prep = dict(H=H, K=K, BK=BK, BT=BT, GATE=gate, IS_VARLEN=cu_seqlens is not None, PREC=prec, BIG=BIG)
        fwd_prep.launch_prep(k, v, gc, gcl, beta, tm, w, u, flag, cb, ce, T, max(NT, 1), V=V, BV=BVP,
                             lowp=lowp, interp=INTERPRET, **prep)
    else:
        tm = None
        w = u = vn = flag = q.new_zeros(1)
    hs = torch.empty(NC, H, K, V, dtype=inter, device=dev)
    xflag = torch.empty(NC, H, V, dtype=torch.int8, device=dev)
    stop = torch.empty(N * H, V, dtype=i32, device=dev)
    sstop = torch.empty(N, H, K, V, dtype=torch.float32, device=dev)
    # bf16 operands in the matrix products for bf16 inputs on GPUs (as the trusted reference
    # rounds them); fp32 ones otherwise (tf32, "tf32x3" for fp32 inputs; "ieee" interpreted)
    dt = tl.bfloat16 if inter == torch.bfloat16 and not INTERPRET else tl.float32
    common = dict(H=H, K=K, V=V, BK=BK, BT=BT, GATE=gate, DELTA=delta, IS_VARLEN=cu_seqlens is not None,
                  PREC=prec, BIG=BIG, MODE=mode, DT=dt)
    state_args = (k, v, g, gc, gcl, gflag, beta, w, u, flag, h0, hs, vn, xflag, hT, stop, sstop, cu, choff,
                  T, max(NT, 1), triton.next_power_of_2(N * H))
    state_kw = dict(HAS_H0=initial_state is not None, STORE_HT=output_final_state, SBIG=SBIG,
                    **common)
    from gdn import fwd_state   # here: gdn.fwd_state imports this module's helpers
    fwd_state.launch_state(state_args, N * H, **state_kw)
    launch = out_launch(BK, V, gate, q.dtype)
    oflag = torch.empty(triton.cdiv(V, launch["BV"]), NC, H, dtype=torch.int8, device=dev)
    for part in (0, 1):
        _out_kernel[(triton.cdiv(V, launch["BV"]), triton.cdiv(NC, OUT_CHUNKS if part else 1), H)](
            q, k, v, g, gc, gcl, beta, hs, vn, xflag, oflag, o, cb, ce, scale, T, max(NT, 1), NC,
            PART=part, G=OUT_CHUNKS, **launch, **common)
    if return_saved:
        return o, hT if output_final_state else None, saved_for_backward(tm, hs, xflag, w, vn, delta, oflag)
    return (o, hT if output_final_state else None) + ((tm,) if return_inverse else ())


def saved_for_backward(tm, hs, xflag, w, vn, delta: bool, oflag=None) -> dict:
    """What the forward hands the backward (`gdn.chunk_bwd.chunk_gdn_bwd(..., saved=)`), so
    that it need not recompute it: "inverse", the WY prep's T (None where the prep did not
    run); "states", the state entering every chunk [NC,H,K,V] in the hand-off dtype;
    "stepped", per chunk, head and V column, whether the state pass stepped the chunk token by
    token (int8 [NC,H,V]); with the delta rule where the prep ran, "w" = T diag(beta) K_g
    [B,T,H,K] and "v_new" = u - w S [B,T,H,V] (the backward's W and U; v_new is not
    written in stepped columns); "out_stepped", per output V tile, chunk and head, whether
    `_out_kernel` took the chunk token by token (q outside BIG, or a stepped column; int8
    [NVo,NC,H]).  Without the prep (the exact-path mode) the delta rule's backward recomputes
    everything: only "inverse" is given, as None."""
    if delta and tm is None:
        return {"inverse": None}
    out = {"inverse": tm, "states": hs, "stepped": xflag, "out_stepped": oflag}
    if delta:
        out.update(w=w, v_new=vn)
    return out
