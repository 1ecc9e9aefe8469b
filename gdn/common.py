"""What the GDN kernels share: the matrix path's bounds, the hand-off dtype, and the Triton
helpers of the forward and backward kernels (pointers into [.., H, W] tensors, the gate
prefix loads, the path checks, the token-by-token chunk, the products), and the varlen
chunk tables' cache.

Products take bf16 operands for bf16 inputs on GPUs in the state and output kernels (as the
trusted reference rounds them; only where the output's N dimension is >= 32, see `odot`),
bf16 operands in the WY prep too (`gdn.fwd_prep`), and fp32 operands otherwise (tf32 on GPUs;
fp32 inputs tf32x3; "ieee" under the interpreter).  The tensors one launch hands to the next
(w, u, the chunk states, v_new) are stored in bf16 for bf16 inputs (as fla does; the outputs
are bf16 anyway) and in fp32 otherwise (an fp16 state could overflow): `handoff_dtype`.  The
backward's chunk-end state gradients (dhs) are fp32 for every dtype (`gdn.chunk_bwd`).
"""
from __future__ import annotations

import os
from collections import OrderedDict

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Under the interpreter the products are exact fp32 ("ieee"), unless GDN_DEVICE_PRODUCTS=1:
# then they take a GPU's operand types (bf16 for bf16 inputs where a GPU's are, tf32 rounded to
# nearest for the forward's fp32 operands of bf16 and fp16 inputs; tf32x3 exact down to 2^-103;
# a tf32 part among fp32's subnormals flushed, `tensor_core_operand`), so that
# a CPU run rounds as a GPU does and reproduces a failure only a GPU showed
# (`kfuzz.interpreter` makes the interpreter's bf16 arithmetic a GPU's).
EXACT_PRODUCTS = INTERPRET and os.environ.get("GDN_DEVICE_PRODUCTS") != "1"
GATE_FLOOR = -110.0     # exp(-110) == 0 in fp32: a clamped gate forgets exactly as -inf does
VECTOR_DECAY_MAX = 60.0  # exp(60) * |k| stays far inside fp32 in the vector-gate factoring
BIG = 65536.0            # input magnitude above which a chunk runs the exact path
SBIG = 1e30              # state magnitude above which a chunk runs the exact path


def chunk_tokens(vector_gate: bool) -> int:
    """Tokens a chunk of the forward and backward kernels: 16 with a vector (per-key) gate,
    whose factored in-chunk decay needs short chunks, else 64.  The state is handed from chunk
    to chunk in fp32 at these boundaries, so the trusted reference runs at the same length: a
    state past fp32's range at a boundary is an honest overflow of both."""
    return 16 if vector_gate else 64


def handoff_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the tensors one launch hands to the next (forward and backward)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def forward_precision(dtype: torch.dtype) -> str:
    """The input precision of the forward's products on fp32 operands (`fdot`) for inputs of
    ``dtype``: "tf32x3" for fp32 inputs, "tf32" otherwise; "ieee" under the interpreter
    (`EXACT_PRODUCTS`)."""
    if EXACT_PRODUCTS:
        return "ieee"
    return "tf32x3" if dtype == torch.float32 else "tf32"


BF16_MAX = tl.constexpr(3.3895313892515355e38)   # tl.constexpr: read inside kernels
FP32_MAX = tl.constexpr(3.4028234663852886e38)
# |beta_t| * ||k_t||^2 above which a delta-rule step's transition I - beta_t k_t k_t^T expands
# (an eigenvalue 1 - beta |k|^2 below -1): the WY inverse (I + A)^-1 of a chunk grows as the
# product of those factors over its tokens and overflows fp32 within a chunk (fp16 beta at
# -65504 with unit keys: NaN in every output of the chunk, the first token's too), so such a
# chunk takes the exact path.  The domain (beta in (0, 1), unit keys) stays below 1.
WY_MAX = tl.constexpr(2.0)
# A tensor-core product on fp32 operands ("tf32x3" for fp32 inputs, "tf32" for bf16 and fp16
# ones, `forward_precision`) reads each operand as tf32 parts, the lower one about 2^-11 of it;
# below 2^-104 that part falls among fp32's subnormals, which those products flush, and a
# subnormal operand loses itself (on the H200: q ~1e-39 against v ~1e4 put the fp32 forward's
# o 5.5e-3 off, 2.5e-6 with "ieee" products).  A chunk whose q, k, v or beta (and in the
# backward dO: a subnormal dO put an H100's bf16 dh0 4.2x its bound off) holds a nonzero value
# below PRODUCT_MIN takes the exact path, on every device, so the CPU routes as the GPU.
PRODUCT_MIN = tl.constexpr(2.0 ** -104)
# The vector gate's factored products take Gamma_t q_t, with Gamma_t >= exp(-VECTOR_DECAY_MAX)
# inside a chunk: a nonzero |q| below 2^-126 exp(VECTOR_DECAY_MAX) (about 2^-39.4) can put
# Gamma_t q_t among fp32's subnormals, or at 0, where it keeps few or no digits, so a chunk
# with such a q takes the exact path.  The trusted reference decays q k^T, not q.
VECTOR_Q_MIN = tl.constexpr(2.0 ** -39)


@triton.jit
def saturated(x, dtype: tl.constexpr):
    """x (fp32) with the finite values beyond ``dtype``'s range (bf16: |x| in (3.3895e38,
    3.4028e38]) set to its largest, keeping the sign; inf and NaN as they are."""
    if dtype == tl.bfloat16:
        x = tl.where((tl.abs(x) > BF16_MAX) & (tl.abs(x) <= FP32_MAX), tl.where(x > 0, BF16_MAX, -BF16_MAX), x)
    return x


@triton.jit
def handoff(x, ptr):
    """A state (or state gradient) in the dtype of the hand-off tensor ``ptr`` points into,
    saturated (`saturated`): stored as it is, an fp32 state near fp32's maximum (an initial
    state or final-state gradient drawn there) rounds to inf in bf16 on the GPU, and the
    exact path that reads it back gives NaN where the oracle is finite (G06 on gdn_bwd: dq and
    dk of every token of the head).  Triton's interpreter truncates fp32 -> bf16 where the
    GPU rounds to nearest, so the CPU does not show it.  Only
    the resume parts store such states: the matrix parts stop before them."""
    return saturated(x, ptr.dtype.element_ty).to(ptr.dtype.element_ty)


@triton.jit
def _within_from(x, bound, LEAST: tl.constexpr):
    """`all_within`, and no element nonzero below LEAST in magnitude (one reduction)."""
    a = tl.abs(x.to(tl.float32))
    return tl.max(tl.where((a <= bound) & ((a >= LEAST) | (a == 0)), 0, 1)) == 0


@triton.jit
def in_product_range(x, bound):
    """The check of an input tile (q, k, v, beta) whose values enter the matrix path's
    products: `all_within`, and no element nonzero below PRODUCT_MIN in magnitude."""
    return _within_from(x, bound, PRODUCT_MIN)


@triton.jit
def outside_products(x, bound):
    """1 where a tile keeps its chunk off the matrix path's products (`in_product_range`
    fails), else 0: a term of the backward's count of reasons for the exact path."""
    return tl.where(in_product_range(x, bound), 0, 1)


@triton.jit
def all_within(x, bound):
    """True when every element is finite and |x| <= bound (NaN fails).  In fp32:
    bound = 65536 rounds to inf in fp16, and |inf| <= inf would pass."""
    return tl.max(tl.where(tl.abs(x.to(tl.float32)) <= bound, 0, 1)) == 0


@triton.jit
def _max_nan(a, b):
    """max(a, b), NaN where either is NaN (max.NaN.f32)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def q_admits_matrix(x, bound, GATE: tl.constexpr):
    """q's checks for the matrix path: `in_product_range` of ``bound`` (BIG); for the vector
    gate (GATE 2) the least nonzero magnitude is VECTOR_Q_MIN, above PRODUCT_MIN."""
    if GATE == 2:
        return _within_from(x, bound, VECTOR_Q_MIN)
    return in_product_range(x, bound)


@triton.jit
def all_within_max(x, bound):
    """`all_within` as one NaN-propagating max over |x| (a NaN wins it, and |inf| > bound),
    one instruction an element where `all_within` takes a compare and a select.  The state
    pass's check of the state entering a chunk (a [K, BV] tile a chunk, on its serial chain).
    The other checks keep `all_within`: with this form in it, `_out`'s K-sliced loop gives o
    5e-2 off at gate 0, K 184, V >= 16 on the H200 (tools/sweep_gdn_gpu.py --forward; the
    states right), and off the serial chain the form saves nothing measurable."""
    return tl.where(tl.reduce(tl.abs(x.to(tl.float32)), None, _max_nan) <= bound, 0, 1) == 0


@triton.jit
def tile(ptr, r0, rr, cols, W, H):
    """Pointers to rows r0 + rr H (rr [BT]) and columns `cols` of a [.., H, W] tensor seen as
    rows of W: the 64-bit chunk base r0 (token bos at head i_h: bos H + i_h) added once, the
    offsets inside the chunk 32-bit (BT H W < 2^31).  An int64 offset per element costs two
    registers and two integer operations each.  (Forward and backward; W and H constexprs in
    the forward, runtime integers in the backward.)"""
    return (ptr + r0 * W) + (rr[:, None] * (H * W) + cols[None, :])


@triton.jit
def _gate_last(gc, gcl, r0, nlast, idx, H: tl.constexpr, K: tl.constexpr, GATE: tl.constexpr):
    """The cumulative gate of a chunk's last token (row r0 + nlast H, see `tile`): scalar gate,
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
def load_gates(gc, gcl, r0, rr, rmask, nlast, dk, m2, H: tl.constexpr, K: tl.constexpr,
                GATE: tl.constexpr):
    """A chunk's cumulative gates (rows r0 + rr H, see `tile`), the padding rows set to the
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
        G = tl.load(tile(gc, r0, rr, dk, K, H), mask=m2, other=0.0)
        GL, _ = _gate_last(gc, gcl, r0, nlast, dk, H, K, GATE)
        G = tl.where(rmask[:, None], G, GL[None, :])
        return G, G, GL, GL


@triton.jit
def tf32_nearest(x):
    """fp32 x rounded to the nearest tf32 value (10 fraction bits; halves away from zero;
    NaN kept).  A tensor core's tf32 product reads only an fp32 operand's top 19 bits, so
    an unrounded operand is truncated toward zero: a bias of up to 2^-10 relative (e.g. a
    decayed key 0.49999997 read as 0.49951172), twice the error of rounding it to the fp16
    operand that the trusted reference models."""
    b = x.to(tl.uint32, bitcast=True)
    r = ((b + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return tl.where(x == x, r, x)


# Under GDN_DEVICE_PRODUCTS=1 the interpreter's tf32 operands also lose what a tensor core
# flushes: a tf32 part among fp32's subnormals (`tensor_core_operand`).
EMULATED = tl.constexpr(INTERPRET and not EXACT_PRODUCTS)
FP32_TINY = tl.constexpr(2.0 ** -126)    # fp32's least normal magnitude


@triton.jit
def _normal_or_zero(x):
    return tl.where(tl.abs(x) < FP32_TINY, 0.0, x)


@triton.jit
def tensor_core_operand(x, PREC: tl.constexpr):
    """x as a tensor core's product at PREC reads it (for the interpreter to round as a GPU
    does): "tf32", rounded to nearest tf32 and 0 where that is subnormal; "tf32x3", split
    into a high tf32 part and the remainder, each 0 where subnormal (exact where |x| is at
    least 2^-103, the remainder then normal; below, the remainder's subnormal bits are lost,
    and below 2^-126 all of x: the H200's fp32 forward put o 5.5e-3 off for q ~1e-39)."""
    if PREC == "tf32":
        x = _normal_or_zero(tf32_nearest(x))
    elif PREC == "tf32x3":
        high = (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        x = tl.where(x == x, _normal_or_zero(high) + _normal_or_zero(x - high), x)
    return x


@triton.jit
def fdot(a, b, PREC: tl.constexpr):
    """a b on fp32 operands at PREC ("ieee", "tf32x3" or "tf32"; tf32 operands rounded to
    nearest, `tf32_nearest`; under the interpreter with GDN_DEVICE_PRODUCTS=1, as a tensor
    core reads them, `tensor_core_operand`)."""
    a = a.to(tl.float32)
    b = b.to(tl.float32)
    if EMULATED:
        return tl.dot(tensor_core_operand(a, PREC), tensor_core_operand(b, PREC), input_precision="ieee")
    if PREC == "tf32":
        a = tf32_nearest(a)
        b = tf32_nearest(b)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def inv_unit_lower(A, BT: tl.constexpr, PREC: tl.constexpr):
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
        F = fdot(Dinv, tl.where((r[:, None] // 16) > (r[None, :] // 16), A, 0.0), PREC)
        P = eye - F
        P = eye - fdot(F, P, PREC)
        P = eye - fdot(F, P, PREC)
        Dinv = fdot(P, Dinv, PREC)
    return Dinv


@triton.jit
def chunk_span(i_c, cb_ptr, ce_ptr, T, NT, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    if IS_VARLEN:
        bos = tl.load(cb_ptr + i_c)
        eos = tl.load(ce_ptr + i_c)
    else:
        i_b = i_c // NT
        bos = i_b * T + (i_c % NT) * BT
        eos = tl.minimum(bos + BT, i_b * T + T)
    return bos, eos


@triton.jit
def exact_chunk(q, k, v, g, beta, o, S, scale, t0, eos, i_h, dk, kmask, dv, vmask, smask,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                GATE: tl.constexpr, DELTA: tl.constexpr):
    """One chunk token by token with the oracle's formulas, from the state S entering it
    ([BK, BV] float64), each step in float64 as the oracle computes and the state kept in
    float64 between steps (so that a value the oracle keeps inside fp32's range is not an fp32
    overflow of an intermediate: G06, beta at bf16's maximum; and a state that leaves fp32's
    range inside the chunk and comes back, as the oracle's may, is carried across: G06, final
    state 1.6e32 after a step past 3.4e38).  Stores o = scale q S_t of every token (rounded
    through fp32: Triton 3.9's interpreter rounds float64 to bf16 wrongly) and returns the state
    leaving the chunk, float64.  The state pass hands it on as `scaled_columns` rounds it: a
    column past fp32's range scaled where a next chunk takes it, so that a later decay brings
    it back as the oracle's; else rounded to fp32 as it is, so that in the final state an
    element inside fp32's range beside one past it keeps its digits rather than coming back
    from a subnormal (gdn_fwd: ht 3.4e-3 off, 1e36 beside 1e109)."""
    n = tl.minimum(BT, eos - t0)
    for t in range(0, n):
        tok = (t0 + t).to(tl.int64)
        kv = tl.load(k + (tok * H + i_h) * K + dk, mask=kmask, other=0.0).to(tl.float64)
        vv = tl.load(v + (tok * H + i_h) * V + dv, mask=vmask, other=0.0).to(tl.float64)
        if GATE == 1:
            S = tl.exp(tl.load(g + tok * H + i_h).to(tl.float64)) * S
        elif GATE == 2:
            av = tl.exp(tl.load(g + (tok * H + i_h) * K + dk, mask=kmask, other=0.0).to(tl.float64))
            S = av[:, None] * S
        if GATE != 0:   # a decay of inf times the padding's 0 is NaN, which k S would sum in
            S = tl.where(smask, S, 0.0)
        if DELTA:
            bk = tl.load(beta + tok * H + i_h).to(tl.float64) * kv
            kS = tl.sum(kv[:, None] * S, axis=0)
            S = S - bk[:, None] * kS[None, :] + bk[:, None] * vv[None, :]
        else:
            S = S + kv[:, None] * vv[None, :]
        S = tl.where(smask, S, 0.0)   # padding stays 0 (no 0 * inf in it)
        qv = scale * tl.load(q + (tok * H + i_h) * K + dk, mask=kmask, other=0.0).to(tl.float64)
        ov = tl.sum(qv[:, None] * S, axis=0)
        tl.store(o + (tok * H + i_h) * V + dv, ov.to(tl.float32).to(o.dtype.element_ty), mask=vmask)
    return S


@triton.jit
def scaled_columns(Sd, inner, keep, dtype: tl.constexpr):
    """(S, E): the float64 tile Sd as S 2^E in ``dtype``, E ([BV] float64) per column the
    power of two that brings the column's largest finite element to 2^127 where that element
    is past 2^127 and ``inner`` (a step inside a chunk), or past fp32's range and ``keep`` (a
    chunk's boundary that hands the state on); 0 elsewhere (NaN and Inf keep no scale).  So a
    state inside fp32's range at a boundary is handed on unscaled, as rounded, except that where
    ``keep`` a nonzero element below fp32's smallest subnormal is handed on as that subnormal
    with its sign, not as 0 (``dtype`` fp32): a later product with an infinite element of the
    state, or of its gradient, is then the oracle's ±Inf, not 0 * Inf = NaN (gdn_bwd_gla: a
    state gradient of 4e-78 at a boundary beside an infinite state, dg NaN where the oracle's
    is +Inf).  The absolute error stays within fp32's own rounding of its subnormals (2^-149)."""
    a = tl.where(tl.abs(Sd) < float("inf"), tl.abs(Sd), 0.0)
    big = tl.max(a, axis=0)
    E = tl.where(((big > 1.7014118346046923e38) & inner) | ((big > FP32_MAX) & keep),
                 tl.ceil(tl.log2(big)) - 127.0, 0.0)
    S = (Sd * tl.exp2(-E)[None, :]).to(dtype)
    if keep:   # +-0 from a nonzero Sd keeps Sd's sign: setting its lowest bit gives +-2^-149
        S = tl.where((S == 0) & (Sd != 0), (S.to(tl.int32, bitcast=True) | 1).to(dtype, bitcast=True), S)
    return S, E


@triton.jit
def odot(a, b, DT: tl.constexpr, PREC: tl.constexpr):
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
        return fdot(a, b, PREC)
    return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def mask_and(mask, ok):
    """mask & ok for a scalar ok, as a store mask.  (`mask & ok` alone is int32 under Triton
    3.9's interpreter, which refuses it as a mask; tl.where(ok, mask, False) is the suspect of
    stores past the tensors' ends on the H200 with Triton 3.6: V=16 with 64-wide state
    tiles fault, and o comes out wrong at T=100.)"""
    return (mask & ok) != 0


@triton.jit
def group_flag(flags, cs, c):
    """The flag of chunk ``c`` from a group's flags ``flags`` over its chunks ``cs`` (one load
    a group: the token-by-token launches, `_out_kernel`'s PART 1 and the backward's `_exact`)."""
    return tl.sum(tl.where(cs == c, flags, 0), 0)



def pow2(n):
    return max(16, triton.next_power_of_2(n))


# The varlen chunk tables of the last few cu_seqlens (`kept_plan`), newest last.
PLAN_CACHE_SIZE = 16   # a forward's and a backward's table for each of 8 cu_seqlens tensors
_plans: OrderedDict = OrderedDict()


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
    memory) is not seen: call `clear_plans()` after one."""
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


def clear_plans() -> None:
    """Forget every kept varlen chunk table (`kept_plan`): needed after a write to a
    cu_seqlens tensor that bypasses torch (a raw kernel on its memory)."""
    _plans.clear()
