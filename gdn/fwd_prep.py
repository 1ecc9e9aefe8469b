"""The GDN forward's WY prep.

Two launches, which `gdn.chunk_fwd.chunk_gdn_fwd` runs before its state and output kernels:
`_prep_inv_kernel` (A, T = (I + A)^-1 stored fp32, or bf16 for the bf16 products
(`t_dtype`), and the per-(chunk, head) flag) and `_prep_wu_kernel` (w = T diag(beta Gamma) k,
u = T diag(beta) v).

- The 16x16 diagonal blocks of T by forward substitution on a [W, 16] tile that holds
  column c of block b in row 16 b + c (the BT rows repeated up to W = 32 x warps), so
  that every row of the tile lies in one thread: a step reads row i of each block's A
  (stored in T's place first, read back through the cache, 16 consecutive words) and sums
  over j inside the thread, with no shuffle and no barrier (`_diag_inverse`).  The block
  merges are products (tf32; bf16 operands for bf16 inputs, `merge_mode`).  A 16-token
  chunk (vector gate) takes a substitution on A in registers, leaner for one block.
- w then u of a chunk in one program, each in a pipelined loop over BV-wide tiles with T
  scaled once a side and read once a chunk (a program a tile stalls on its loads; a chunk
  a program without the pipelined loop is slower still).
- For bf16 inputs and no gate or a scalar gate, products on bf16 operands: k k^T on the
  raw keys (each product exact in the fp32 sum; the decay and beta scale the [BT, BT]
  result); w, u as T' k, T' v with T' = T diag(beta Gamma) rounded to bf16 and T stored in
  bf16 (`t_dtype`; as fla's A is); T's block merges on bf16 operands (`merge_mode`).  fp16
  and fp32 inputs and the vector gate keep fp32 operands: an fp16 T could overflow, and a
  per-key decay cannot be moved off the keys.

Under the Triton interpreter the bf16 operands are rounded to bf16 and multiplied in fp32
("ieee"): the same products (exact) as a bf16 tensor-core product, since the
interpreter's own bf16 tl.dot is wrong.

Refuses nothing of its own: `gdn.chunk_fwd.chunk_gdn_fwd` checks the inputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn.common import WY_MAX, all_within, chunk_span, fdot, in_product_range, inv_unit_lower, load_gates, tile
from gdn.config import DEFAULT, GDNConfig


@triton.jit
def _bdot(a, b, LOWP: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr):
    """a b on bf16 operands (LOWP; fp32 totals) or on fp32 ones at PREC."""
    if LOWP:
        a = a.to(tl.bfloat16)
        b = b.to(tl.bfloat16)
        if INTERP:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)
    return fdot(a, b, PREC)


@triton.jit
def _quad_row(tmc, b16, i: tl.constexpr, q: tl.constexpr, n, RS, FULL: tl.constexpr):
    """Words 4 q .. 4 q + 3 of D_b[i, :] = A[16 b + i, 16 b + :] (a [W, 4] tile, one row a
    thread, the same row for a block's threads), zero from column i on (A strictly lower)."""
    j4 = tl.arange(0, 4)[None, :]
    d = tl.load(tmc + ((b16 + i) * RS + b16 * FULL + 4 * q + j4), mask=b16 + i < n, other=0.0)
    return tl.where(4 * q + j4 < i, d, 0.0)


@triton.jit
def _quad_step(X, i: tl.constexpr, q: tl.constexpr, new, cq):
    """Quad q of the tile after step i: column i set to e_i - new where it lies in quad q."""
    if i // 4 == q:
        j4 = tl.arange(0, 4)[None, :]
        X = tl.where(j4 == i % 4, tl.where(cq == i, 1.0, 0.0) - new[:, None], X)
    return X


@triton.jit
def _diag_inverse(tmc, RS, bos, eos, BT: tl.constexpr, W: tl.constexpr, FULL: tl.constexpr):
    """(I + D_b)^-1 of the BT // 16 diagonal 16x16 blocks D_b of the strictly lower A stored
    at tmc (the chunk's first row of T, rows RS apart, tokens bos to eos: FULL, all BT columns,
    A[r, c] in column c; else the diagonal blocks only, A[r, c] in column c % 16), stored in
    A's place: X_b[j, c] at [16 b + j, 16 b + c] (column c where not FULL), after a barrier
    (every thread has read its rows of A's diagonal blocks).

    The tile XT[16 b + c, j] = X_b[j, c] (W = 32 x warps rows, a multiple of BT: the tile
    repeated) lies one row a thread, so that step i, X_b[i, :] = e_i - sum_{j < i} D_b[i, j]
    X_b[j, :], sums over j inside the thread with no shuffle and no barrier; it is held as
    four [W, 4] quads, and D_b's row i (16 consecutive words, the same for a block's
    threads) is loaded as four such quads.  Why this layout (sm_90, Triton 3.6):
    - in a [16, W] tile Triton spreads each column over 4 threads and every step's sum
      shuffles;
    - with A stored transposed (a step reading D_b[i, j] as one scalar a (row, j)), its
      stores, the inverses' stores and the Dinv load are one row a lane, and the kernel is
      bound by L1/TEX;
    - D_b's row loaded as one [W, 16] tile is laid out for the contiguous load (a row over 4
      threads), and the sums shuffle again;
    - A in its own orientation, rows as quads: 3 shuffles, the fewest scalar loads and
      barriers."""
    n = eos - bos
    cc = tl.arange(0, W)[:, None] % BT
    b16 = (cc // 16) * 16
    cq = cc - b16
    j4 = tl.arange(0, 4)[None, :]
    X0 = tl.where(j4 == cq, 1.0, 0.0)
    X1 = tl.where(4 + j4 == cq, 1.0, 0.0)
    X2 = tl.where(8 + j4 == cq, 1.0, 0.0)
    X3 = tl.where(12 + j4 == cq, 1.0, 0.0)
    for i in tl.static_range(1, 16):
        new = tl.sum(_quad_row(tmc, b16, i, 0, n, RS, FULL) * X0, axis=1)
        if i > 4:
            new += tl.sum(_quad_row(tmc, b16, i, 1, n, RS, FULL) * X1, axis=1)
        if i > 8:
            new += tl.sum(_quad_row(tmc, b16, i, 2, n, RS, FULL) * X2, axis=1)
        if i > 12:
            new += tl.sum(_quad_row(tmc, b16, i, 3, n, RS, FULL) * X3, axis=1)
        X0 = _quad_step(X0, i, 0, new, cq)
        X1 = _quad_step(X1, i, 1, new, cq)
        X2 = _quad_step(X2, i, 2, new, cq)
        X3 = _quad_step(X3, i, 3, new, cq)
    tl.debug_barrier()
    cw = tl.arange(0, W)[:, None]
    m = cw < BT
    base = tmc + b16 * FULL + cq
    tl.store(base + (b16 + j4) * RS, X0, mask=m & (bos + b16 + j4 < eos))
    tl.store(base + (b16 + 4 + j4) * RS, X1, mask=m & (bos + b16 + 4 + j4 < eos))
    tl.store(base + (b16 + 8 + j4) * RS, X2, mask=m & (bos + b16 + 8 + j4 < eos))
    tl.store(base + (b16 + 12 + j4) * RS, X3, mask=m & (bos + b16 + 12 + j4 < eos))


@triton.jit
def unit_lower_inverse(A, tm, r0, rr, rmask, bos, eos, H, BT: tl.constexpr, W: tl.constexpr,
                        PREC: tl.constexpr, MB: tl.constexpr = 0):
    """T = (I + A)^-1 for the chunk's strictly lower A [BT, BT] (rows r0 + rr H of the
    [.., H, BT] tensor tm, tokens bos to eos, serve as scratch: A and the diagonal blocks'
    inverses pass through it in A's orientation, fp32 (in a bf16 tm, fp32 words in its
    bytes: the diagonal blocks only), so the caller stores T there only after this
    returns).  The block merges' products by `_bdot`: fp32 operands at PREC (MB 0) or bf16 ones
    (MB 1; 2 under the interpreter), `merge_mode`.  BT 16
    (one block, the vector gate): the substitution on A in registers (`inv_unit_lower`),
    leaner there."""
    if BT == 16:
        return inv_unit_lower(A, BT, PREC)
    if tm.dtype.element_ty == tl.bfloat16:
        # T stored bf16 (`t_dtype`): the scratch is fp32 in the same bytes, half a
        # row of T each, so it holds A's diagonal blocks only (column c % 16, CM 0); A's
        # blocks below them stay in registers
        CM: tl.constexpr = 0
        RS = H * (BT // 2)
        sp = tm.to(tl.pointer_type(tl.float32), bitcast=True) + r0 * (BT // 2)
        ttr = sp + (rr[:, None] * RS + rr[None, :] % 16)
        smask = ((rr[:, None] // 16) == (rr[None, :] // 16)) & rmask[:, None]   # the diagonal blocks
    else:
        CM: tl.constexpr = 1
        RS = H * BT
        sp = tm + r0 * BT
        ttr = sp + (rr[:, None] * RS + rr[None, :])
        smask = rmask[:, None]
    tl.store(ttr, A, mask=smask)
    tl.debug_barrier()   # A's rows, stored by other threads, are read back below
    _diag_inverse(sp, RS, bos, eos, BT, W, CM)
    tl.debug_barrier()
    M = tl.load(ttr, mask=smask, other=0.0)   # Dinv on the diagonal (A below, CM 1)
    if CM:
        same = (rr[:, None] // 16) == (rr[None, :] // 16)
        eye = tl.where(rr[:, None] == rr[None, :], 1.0, 0.0)
        Dinv = tl.where(same, M, 0.0)
        Ab = tl.where((rr[:, None] // 16) > (rr[None, :] // 16), M, 0.0)
    else:
        Dinv = M
        Ab = tl.where((rr[:, None] // 16) > (rr[None, :] // 16), A, 0.0)
        eye = tl.where(rr[:, None] == rr[None, :], 1.0, 0.0)
    F = _bdot(Dinv, Ab, MB != 0, MB == 2, PREC)
    P = eye - F
    P = eye - _bdot(F, P, MB != 0, MB == 2, PREC)
    P = eye - _bdot(F, P, MB != 0, MB == 2, PREC)
    tl.debug_barrier()   # every thread has read M before T overwrites it
    return _bdot(P, Dinv, MB != 0, MB == 2, PREC)


@triton.jit
def _inverse(k, gc, gcl, beta, tm, r0, rr, rmask, bos, eos, H: tl.constexpr, K: tl.constexpr,
             BK: tl.constexpr, BT: tl.constexpr, GATE: tl.constexpr, PREC: tl.constexpr,
             BIG: tl.constexpr, LOWP: tl.constexpr, INTERP: tl.constexpr, W: tl.constexpr,
             MB: tl.constexpr):
    """A chunk's T = (I + A)^-1 (fp32, its strictly lower A formed here and passed through tm,
    `unit_lower_inverse`) and whether its k and beta admit the matrix path (within BIG, and
    every step's |beta| |k|^2 within `gdn.common.WY_MAX`)."""
    nlast = eos - bos - 1   # the chunk's last token's row
    dk = tl.arange(0, BK)
    m2 = rmask[:, None] & (dk[None, :] < K)
    kt = tl.load(tile(k, r0, rr, dk, K, H), mask=m2, other=0.0)
    bt = tl.load(beta + r0 + rr * H, mask=rmask, other=0.0).to(tl.float32)
    kf = kt.to(tl.float32)
    ok = in_product_range(kt, BIG) & in_product_range(bt, BIG) & all_within(bt * tl.sum(kf * kf, 1), WY_MAX)
    lower = rr[:, None] > rr[None, :]
    if GATE == 2:
        G, _, _, _ = load_gates(gc, gcl, r0, rr, rmask, nlast, dk, m2, H, K, GATE)
        A = fdot(kf * tl.exp(G), tl.trans(kf * tl.exp(-G)), PREC)
    else:
        A = _bdot(kt, tl.trans(kt), LOWP, INTERP, PREC)
        if GATE == 1:
            G, Glo, _, _ = load_gates(gc, gcl, r0, rr, rmask, nlast, dk, m2, H, K, GATE)
            A = A * tl.exp(tl.where(lower, (G[:, None] - G[None, :]) + (Glo[:, None] - Glo[None, :]), 0.0))
    A = tl.where(lower, A * bt[:, None], 0.0)
    return unit_lower_inverse(A, tm, r0, rr, rmask, bos, eos, H, BT, W, PREC, MB), ok


@triton.jit
def _prep_inv_kernel(k, gc, gcl, beta, tm, flag, cb_ptr, ce_ptr, T, NT,
                     H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                     GATE: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
                     BIG: tl.constexpr, LOWP: tl.constexpr, INTERP: tl.constexpr, W: tl.constexpr,
                     MB: tl.constexpr):
    """The WY prep, part 1 (`_inverse`): T stored [BT rows, BT] (fp32, or bf16: `t_dtype`); the flag covers k and
    beta."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, eos = chunk_span(i_c, cb_ptr, ce_ptr, T, NT, BT, IS_VARLEN)
    rr = tl.arange(0, BT)
    r0 = bos.to(tl.int64) * H + i_h
    rmask = bos + rr < eos
    Tm, ok = _inverse(k, gc, gcl, beta, tm, r0, rr, rmask, bos, eos, H, K, BK, BT, GATE, PREC, BIG,
                      LOWP, INTERP, W, MB)
    tl.store(tile(tm, r0, rr, rr, BT, H), Tm.to(tm.dtype.element_ty), mask=rmask[:, None])
    tl.store(flag + i_c * H + i_h, ok.to(tl.int32))


@triton.jit
def _t_dot(Ts, hi, lo, x, LOWP: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
           TLO: tl.constexpr):
    """Ts x for one tile x of k or v: (hi + lo) x on bf16 operands (LOWP; x exact in bf16;
    hi x alone where not TLO), else one product on fp32 operands at PREC."""
    if LOWP:
        if not TLO:
            return _bdot(hi, x, True, INTERP, PREC)
        return _bdot(hi, x, True, INTERP, PREC) + _bdot(lo, x, True, INTERP, PREC)
    return fdot(Ts, x, PREC)


@triton.jit
def _wu_side(i_s: tl.constexpr, k, v, gc, beta, Tm, w, u, flag, row0, rmask, i_c, i_h,
             H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
             GATE: tl.constexpr, PREC: tl.constexpr, BIG: tl.constexpr, LOWP: tl.constexpr,
             INTERP: tl.constexpr, TLO: tl.constexpr):
    """Every w tile (i_s 0) or every u tile (i_s 1) of a chunk, in a loop over the BV-wide
    tiles: w = (T diag(beta Gamma)) k, u = (T diag(beta)) v, the diagonal scales on T's columns
    so that k and v enter the products as loaded, T scaled and split once (LOWP: hi + lo in
    bf16, two bf16 products a tile; else one product on fp32 operands at PREC).  A u tile with
    a value over BIG clears the chunk's flag."""
    rr = tl.arange(0, BT)
    sc = tl.load(beta + row0 + rr * H, mask=rmask, other=0.0).to(tl.float32)
    if i_s == 0 and GATE == 1:
        sc = sc * tl.exp(tl.load(gc + row0 + rr * H, mask=rmask, other=0.0))
    Ts = Tm * sc[None, :]
    hi = Ts
    if LOWP:
        hi = Ts.to(tl.bfloat16).to(tl.float32)
    lo = Ts - hi
    if i_s == 0:
        for j in range(0, (K + BV - 1) // BV):
            _wu_tile(j, k, gc, w, Ts, hi, lo, row0, rmask, H, K, BV, BT, GATE == 2, PREC, BIG,
                     LOWP, INTERP, TLO)
    else:
        nbad = 0
        for j in range(0, (V + BV - 1) // BV):
            nbad += _wu_tile(j, v, gc, u, Ts, hi, lo, row0, rmask, H, V, BV, BT, False, PREC, BIG,
                             LOWP, INTERP, TLO)
        if nbad > 0:
            tl.store(flag + i_c * H + i_h, 0)   # the one writer of a 0 after the inverse


@triton.jit
def _wu_tile(j, x, gc, y, Ts, hi, lo, row0, rmask, H: tl.constexpr, W: tl.constexpr,
             BV: tl.constexpr, BT: tl.constexpr, KEY_GATE: tl.constexpr, PREC: tl.constexpr,
             BIG: tl.constexpr, LOWP: tl.constexpr, INTERP: tl.constexpr, TLO: tl.constexpr):
    """y's BV-wide tile j of a chunk, y = Ts x (w from k, W = K, the vector gate on the keys
    where KEY_GATE; u from v, W = V); returns 1 where a value of x there is over BIG, else 0."""
    rr = tl.arange(0, BT)
    cb = tl.arange(0, BV)
    m2 = rmask[:, None] & (j * BV + cb[None, :] < W)
    ix = rr[:, None] * (H * W) + j * BV + cb[None, :]
    xt = tl.load(x + row0 * W + ix, mask=m2, other=0.0)
    xs = xt
    if KEY_GATE:
        xs = xt.to(tl.float32) * tl.exp(tl.load(gc + row0 * W + ix, mask=m2, other=0.0))
    tl.store(y + row0 * W + ix, _t_dot(Ts, hi, lo, xs, LOWP, INTERP, PREC, TLO).to(y.dtype.element_ty),
             mask=m2)
    return tl.where(in_product_range(xt, BIG), 0, 1)


@triton.jit
def _prep_wu_kernel(k, v, gc, gcl, beta, tm, w, u, flag, cb_ptr, ce_ptr, T, NT,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                    GATE: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
                    BIG: tl.constexpr, LOWP: tl.constexpr, INTERP: tl.constexpr,
                    TLO: tl.constexpr):
    """The WY prep, part 2 (`_wu_side`): w then u of a chunk in one program (grid: chunks,
    heads), T read once."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, eos = chunk_span(i_c, cb_ptr, ce_ptr, T, NT, BT, IS_VARLEN)
    # 64-bit chunk bases, 32-bit offsets inside the chunk (BT H max(K, V) < 2^31): an
    # int64 offset per element costs two registers each
    row0 = bos.to(tl.int64) * H + i_h
    rr = tl.arange(0, BT)
    rmask = bos + rr < eos
    Tm = tl.load(tm + row0 * BT + rr[:, None] * (H * BT) + rr[None, :], mask=rmask[:, None],
                 other=0.0).to(tl.float32)
    for side in tl.static_range(2):
        _wu_side(side, k, v, gc, beta, Tm, w, u, flag, row0, rmask, i_c, i_h, H, K, V, BV, BT,
                 GATE, PREC, BIG, LOWP, INTERP, TLO)


def _cap(maxnreg, interp: bool, lowp: bool) -> dict:
    """The launch keyword that caps registers at ``maxnreg``, where set, on GPUs, for the bf16
    products (``lowp``: the path timed; fp32 and fp16 inputs hold fp32 tiles, and the inverse
    capped at 128 spills 592 bytes at fp32 K = V = 128, sm_90 offline, against none at 255
    uncapped)."""
    return {"maxnreg": maxnreg} if maxnreg and lowp and not interp else {}


def merge_mode(lowp: bool, interp: bool, config: GDNConfig = DEFAULT) -> int:
    """`unit_lower_inverse`'s MB: its block merges on bf16 operands (1; 2 under the
    interpreter, whose bf16 tl.dot is wrong) under ``config.prep_merge_bf16`` for the bf16
    products, else on fp32 ones (0)."""
    return (2 if interp else 1) if config.prep_merge_bf16 and lowp else 0


def t_dtype(lowp: bool, BT: int, config: GDNConfig = DEFAULT):
    """The dtype T is stored in: fp32, or bf16 for the bf16 products at a chunk of 32 or more
    under ``config.prep_t_bf16``."""
    return torch.bfloat16 if config.prep_t_bf16 and lowp and BT >= 32 else torch.float32


def launch_prep(k, v, gc, gcl, beta, tm, w, u, flag, cb, ce, T, NT, *, V, BV, lowp, interp,
                config: GDNConfig = DEFAULT, **prep):
    """The two prep launches (grids: chunks x heads); ``tm`` in `t_dtype`'s dtype."""
    NC, H = flag.shape
    W = max(32 * config.prep_inv_warps, prep["BT"])
    _prep_inv_kernel[(NC, H)](k, gc, gcl, beta, tm, flag, cb, ce, T, NT, LOWP=lowp, INTERP=interp,
                              W=W, MB=merge_mode(lowp, interp, config), num_warps=config.prep_inv_warps,
                              **_cap(config.prep_inv_maxnreg, interp, lowp), **prep)
    _prep_wu_kernel[(NC, H)](k, v, gc, gcl, beta, tm, w, u, flag, cb, ce, T, NT, V=V, BV=BV, LOWP=lowp,
                             INTERP=interp, TLO=tm.dtype == torch.float32,
                             num_warps=config.prep_wu_warps, num_stages=config.prep_wu_stages,
                             **_cap(config.prep_wu_maxnreg, interp, lowp), **prep)
