"""The GDN forward's sequential pass: `_state_kernel` (launch 2 of `gdn.chunk_fwd`).

Per (V tile, sequence-head) it walks the sequence chunk by chunk with the state S [K, BV]
in registers, fp32: stores the state entering every chunk (hs), v_new = u - w S (delta; vn),
o of the chunks it steps token by token, and the final state, in two launches
(`launch_state`): PART 0, the matrix part, autotuned, with no branch in its loop; PART 1, the
resume part, from the first chunk that failed the matrix path's checks on (see
`_state_kernel`).  PART 0's config is picked as
``config.state_pick`` says (`gdn.config`).  `gdn.common` holds the shared helpers,
`gdn.chunk_fwd` the gate prefix and output kernels and the module docstring with the NaN/Inf
contract.
"""
from __future__ import annotations

import functools
import zlib

import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from gdn.common import (INTERPRET, all_within, all_within_max, exact_chunk, handoff, in_product_range, load_gates,
                        mask_and, odot, q_admits_matrix, scaled_columns)
from gdn.config import DEFAULT, GDNConfig

# the state check: one NaN-propagating max an element on a GPU; under the interpreter the same
# test as a compare (that max's custom-combine reduce runs element by element in Python there:
# about 1.5 s a [256, 64] tile against 5 ms), equal in value (NaN and inf fail both)
_state_within = all_within if INTERPRET else all_within_max


@triton.jit
def _seq_span(i_n, T, NT, cu, choff, IS_VARLEN: tl.constexpr):
    """(first token, end token, first global chunk) of sequence i_n."""
    if IS_VARLEN:
        return tl.load(cu + i_n), tl.load(cu + i_n + 1), tl.load(choff + i_n)
    return i_n * T, i_n * T + T, i_n * NT


@triton.jit
def _stile(ptr, r0, rr, cols, W: tl.constexpr, H: tl.constexpr):
    """`gdn.common.tile`'s pointers from an int64 offset per element.  The state kernel's
    tiles are addressed so: its matrix part is faster on the H200 so than with `tile`'s 64-bit
    base and 32-bit offsets (255 registers either way with Triton 3.6), where the output
    kernel is faster with `tile`."""
    return ptr + ((r0 + rr * H)[:, None] * W + cols[None, :])


@triton.jit
def _chunk_ok(k, v, S, r0, rr, rmask, dk, kmask, dv, vmask, fl, gfl,
              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, GATE: tl.constexpr,
              DELTA: tl.constexpr, BIG: tl.constexpr, SBIG: tl.constexpr):
    """(ok, k tile as loaded, v tile fp32 or None): whether the chunk's inputs and the state
    entering it admit the matrix path, with the tiles the check loaded; ``fl`` and ``gfl``
    are the chunk's flags (`_chunk_scalars`)."""
    mk = rmask[:, None] & kmask[None, :]
    kt = tl.load(_stile(k, r0, rr, dk, K, H), mask=mk, other=0.0)
    ok = _state_within(S, SBIG)
    vt = kt
    if DELTA:
        ok = ok & (fl != 0)
    else:
        vt = tl.load(_stile(v, r0, rr, dv, V, H), mask=rmask[:, None] & vmask[None, :],
                     other=0.0).to(tl.float32)
        ok = ok & in_product_range(kt, BIG) & in_product_range(vt, BIG)
    if GATE != 0:
        ok = ok & (gfl != 0)
    return ok, kt, vt


@triton.jit
def _chunk_scalars(flag, gflag, gc, gcl, c_first, bos, eos, c, nch, i_h, H: tl.constexpr,
                   BT: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr):
    """Chunk c's scalars: its flags (delta rule, gate) and, for the scalar gate, its last
    token's cumulative gate (hi, lo); zeros past the sequence's last chunk.  The matrix part
    loads them a chunk ahead of their use: loaded in the chunk's own step they were plain
    loads on the serial chain (sm_90 SASS: the last gate issued after the w S product's wait
    and consumed a barrier later); a chunk ahead they issue at the loop's top and are consumed
    at its end.  The resume part loads them in the chunk's own step."""
    live = c < nch
    cid = (c_first + c).to(tl.int64)
    fl = 0
    gfl = 0
    gk = 0.0
    gkl = 0.0
    if DELTA:
        fl = tl.load(flag + cid * H + i_h, mask=live, other=0)
    if GATE != 0:
        gfl = tl.load(gflag + cid * H + i_h, mask=live, other=0)
    if GATE == 1:
        t0 = bos + c * BT
        row = (t0.to(tl.int64) + tl.minimum(BT, eos - t0) - 1) * H + i_h
        gk = tl.load(gc + row, mask=live, other=0.0)
        gkl = tl.load(gcl + row, mask=live, other=0.0)
    return fl, gfl, gk, gkl


@triton.jit
def _matrix_step(w, u, gc, gcl, vn, S, kt, vt, r0, rr, rmask, nlast, dk, kmask, dv, vmask, store,
                 gk, gkl, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, GATE: tl.constexpr,
                 DELTA: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """One chunk by the matrix path: stores v_new = u - w S (delta; where `store`), returns the
    state leaving the chunk.  The scalar gate's in-chunk decay exp(G_C - G_t) goes on v_new's
    tile [BT, BV], not on the keys [BT, K] (as fla's h pass does), so the key tile reaches the
    product as its asynchronous copy loaded it."""
    mk = rmask[:, None] & kmask[None, :]
    mv = rmask[:, None] & vmask[None, :]
    if DELTA:
        wt = tl.load(_stile(w, r0, rr, dk, K, H), mask=mk, other=0.0)
        vt = tl.load(_stile(u, r0, rr, dv, V, H), mask=mv, other=0.0).to(tl.float32) - odot(wt, S, DT, PREC)
        tl.store(_stile(vn, r0, rr, dv, V, H), vt.to(vn.dtype.element_ty), mask=mask_and(mv, store))
    if GATE == 1:
        G, Glo, Gl, Gll = load_gates(gc, gcl, r0, rr, rmask, nlast, dk, mk, H, K, GATE)
        kl = kt
        vt = vt * tl.exp((Gl - G) + (Gll - Glo))[:, None]
        S = S * tl.exp(gk + gkl)   # the last token's gate (`_chunk_scalars`)
    elif GATE == 2:
        G, _, Gl, _ = load_gates(gc, gcl, r0, rr, rmask, nlast, dk, mk, H, K, GATE)
        kl = kt * tl.exp(Gl[None, :] - G)
        S = S * tl.exp(Gl)[:, None]
    else:
        kl = kt
    return S + odot(tl.trans(kl), vt, DT, PREC)


@triton.jit
def _enter_stores(hs, xflag, S, zf, cid, i_h, dv, kv_off, smask, vmask, alive, H: tl.constexpr,
                  K: tl.constexpr, V: tl.constexpr):
    """The matrix part's stores on entering a chunk: the state (hs) and a clear xflag, masked
    by ``alive`` (every chunk before it passed its checks), not by the chunk's own checks, so
    that they need not wait for its flag loads and the reduction over S.  A chunk that then
    fails has both stored again by the resume part, which runs from it (a failing chunk is
    the stop)."""
    tl.store(hs + (cid * H + i_h) * K * V + kv_off, S.to(hs.dtype.element_ty), mask=mask_and(smask, alive))
    tl.store(xflag + (cid * H + i_h) * V + dv, zf, mask=mask_and(vmask, alive))


@triton.jit
def _state_kernel(q, k, v, g, gc, gcl, gflag, beta, w, u, flag, h0, hs, hexp, vn, xflag, o, hT, stop,
                  sstop, cu, choff, scale, T, NT, OCC,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                  GATE: tl.constexpr, DELTA: tl.constexpr, HAS_H0: tl.constexpr,
                  STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr,
                  PREC: tl.constexpr, BIG: tl.constexpr, SBIG: tl.constexpr,
                  PART: tl.constexpr, DT: tl.constexpr):
    """The sequential part, per (V tile, sequence-head): the state entering every chunk
    (stored in hs, as hs 2^hexp with hexp a power of two per column, 0 but where the state
    there is past fp32's range), v_new = u - w S (delta; stored in vn), and the next state, in two parts.

    PART 0, the matrix part (its config picked by `launch_state`): walks the chunks while each admits the matrix path
    (a loop with no branch, which Triton pipelines).  At the first chunk that does not it
    records that chunk (`stop`, per V column) and the state entering it (`sstop`, fp32), and
    leaves the rest of the sequence to PART 1 (it runs on over the rest without storing).
    PART 1, the resume part (16-column tiles, launched after PART 0; a program whose columns
    ran to the end returns at once): from the recorded chunk on, steps token by token the
    chunks whose inputs (q too) or incoming state fail the checks (`exact_chunk`: float64 from
    the state held, rounded to fp32 at the chunk's end), storing their o from each step's
    state, and the others by the matrix path.  xflag marks, per V column, the chunks stepped
    token by token, whose o _out_kernel leaves as stored (stepped again from hs, rounded to the
    hand-off dtype, a state that nearly cancels where q or beta is infinite could give NaN where
    the oracle's o is an Inf).  Kept apart, the matrix part holds no float64 tiles."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos, eos, c_first = _seq_span(i_n, T, NT, cu, choff, IS_VARLEN)
    nch = tl.cdiv(eos - bos, BT)
    dk = tl.arange(0, BK)
    kmask = dk < K
    dv = i_v * BV + tl.arange(0, BV)
    vmask = dv < V
    smask = kmask[:, None] & vmask[None, :]
    kv_off = dk[:, None].to(tl.int64) * V + dv[None, :]   # int64 per element, as `_stile`
    rr = tl.arange(0, BT)
    zf = tl.zeros([BV], dtype=tl.int8)
    if PART == 0:
        if HAS_H0:
            S = tl.load(h0 + i_nh.to(tl.int64) * K * V + kv_off, mask=smask, other=0.0).to(tl.float32)
        else:
            S = tl.zeros((BK, BV), dtype=tl.float32)
        alive = nch >= 0
        if HAS_H0:
            # a first chunk whose q fails the output kernel's checks is stepped here, from h0 as
            # given: the output kernel's exact part would start it from h0 in the hand-off
            # dtype, and q past BIG can sum terms far larger than o (bf16 q near its largest,
            # h0 1e4: o 8.9e38 from h0, 3.2e38 from its bf16 rounding)
            q0 = tl.load(_stile(q, bos.to(tl.int64) * H + i_h, rr, dk, K, H),
                         mask=(bos + rr < eos)[:, None] & kmask[None, :], other=0.0)
            alive = alive & q_admits_matrix(q0, BIG, GATE)
        stopc = tl.where(alive, nch, 0)
        fl, gfl, gk, gkl = _chunk_scalars(flag, gflag, gc, gcl, c_first, bos, eos, 0, nch, i_h, H,
                                          BT, GATE, DELTA)
        for c in range(0, nch):
            cid = (c_first + c).to(tl.int64)
            t0 = bos + c * BT
            r0 = t0.to(tl.int64) * H + i_h
            rmask = t0 + rr < eos
            nlast = tl.minimum(BT, eos - t0) - 1   # the chunk's last token's row
            # this chunk's scalars, and the next chunk's loads issued
            fl_c, gfl_c, gk_c, gkl_c = fl, gfl, gk, gkl
            fl, gfl, gk, gkl = _chunk_scalars(flag, gflag, gc, gcl, c_first, bos, eos, c + 1, nch,
                                              i_h, H, BT, GATE, DELTA)
            _enter_stores(hs, xflag, S, zf, cid, i_h, dv, kv_off, smask, vmask, alive, H, K, V)
            ok, kt, vt = _chunk_ok(k, v, S, r0, rr, rmask, dk, kmask, dv, vmask, fl_c, gfl_c,
                                   H, K, V, GATE, DELTA, BIG, SBIG)
            ok = ok & alive
            Sn = _matrix_step(w, u, gc, gcl, vn, S, kt, vt, r0, rr, rmask, nlast, dk, kmask, dv,
                              vmask, ok, gk_c, gkl_c, H, K, V, GATE, DELTA, PREC, DT)
            S = tl.where(ok, Sn, S)
            stopc = tl.where(alive & (ok == 0), c, stopc)
            alive = ok
        tl.store(stop + i_nh * V + dv, tl.zeros([BV], dtype=tl.int32) + stopc, mask=vmask)
        if stopc < nch:
            tl.store(sstop + i_nh.to(tl.int64) * K * V + kv_off, S, mask=smask)
        elif STORE_HT:
            tl.store(hT + i_nh.to(tl.int64) * K * V + kv_off, S, mask=smask)
    else:
        c0 = tl.min(tl.load(stop + i_nh * V + dv, mask=vmask, other=nch))   # one value a tile
        if c0 < nch:
            S = tl.load(sstop + i_nh.to(tl.int64) * K * V + kv_off, mask=smask, other=0.0)
            E = tl.zeros([BV], dtype=tl.float64)   # the state is S 2^E (`scaled_columns`)
            for c in range(c0, nch):
                cid = (c_first + c).to(tl.int64)
                t0 = bos + c * BT
                r0 = t0.to(tl.int64) * H + i_h
                rmask = t0 + rr < eos
                nlast = tl.minimum(BT, eos - t0) - 1
                fl, gfl, gk, gkl = _chunk_scalars(flag, gflag, gc, gcl, c_first, bos, eos, c, nch, i_h,
                                                  H, BT, GATE, DELTA)
                # a scaled state (E > 0) holds a column's largest element at 2^127, past SBIG
                ok, kt, vt = _chunk_ok(k, v, S, r0, rr, rmask, dk, kmask, dv, vmask, fl, gfl,
                                       H, K, V, GATE, DELTA, BIG, SBIG)
                # and q's check: a chunk whose q fails it is stepped here too, so that its o comes
                # from the state held (the matrix part leaves q to _out_kernel)
                qt = tl.load(_stile(q, r0, rr, dk, K, H), mask=rmask[:, None] & kmask[None, :], other=0.0)
                ok = ok & q_admits_matrix(qt, BIG, GATE)
                tl.store(hs + (cid * H + i_h) * K * V + kv_off, handoff(S, hs), mask=smask)
                tl.store(hexp + (cid * H + i_h) * V + dv, E.to(tl.int32), mask=vmask)
                tl.store(xflag + (cid * H + i_h) * V + dv, zf + tl.where(ok, 0, 1).to(tl.int8), mask=vmask)
                if ok:
                    S = _matrix_step(w, u, gc, gcl, vn, S, kt, vt, r0, rr, rmask, nlast, dk, kmask,
                                     dv, vmask, ok, gk, gkl, H, K, V, GATE, DELTA, PREC, DT)
                else:   # float64 steps from the state held, o from each (`exact_chunk`)
                    Sd = exact_chunk(q, k, v, g, beta, o, S.to(tl.float64) * tl.exp2(E)[None, :],
                                     scale, t0, eos, i_h, dk, kmask, dv, vmask, smask, H, K, V, BT,
                                     GATE, DELTA)
                    S, E = scaled_columns(Sd, False, c < nch - 1, tl.float32)
            if STORE_HT:   # the last chunk leaves its state unscaled (E = 0)
                tl.store(hT + i_nh.to(tl.int64) * K * V + kv_off, S, mask=smask)


# The autotune key.  OCC (the number of sequence-heads, rounded up to a power of 2) is in it:
# few sequence-heads (one long sequence) want narrow V tiles to fill the chip.
KEY = ["K", "V", "BT", "GATE", "DELTA", "PREC", "DT", "OCC"]


def _state_configs(config: GDNConfig) -> list:
    """The matrix part's configs: ``config.state_configs`` on GPUs; under the interpreter one,
    BV 32 at 4 warps and 1 stage."""
    if INTERPRET:
        return [triton.Config({"BV": 32}, num_warps=4, num_stages=1)]
    return [triton.Config({"BV": bv}, num_warps=nw, num_stages=ns) for bv, nw, ns in config.state_configs]


def _sound_configs(configs, K: int) -> list:
    """``configs`` less those that the CUDA 12.8 assembler (ptxas 12.8.93, Triton 3.6's for
    sm_90) compiles wrong at this K: BV 32 tiles at an odd K or at one stage.  There, in the
    matrix part's SASS, a wgmma shared-memory descriptor of the k^T v_new product is built by
    adding to a uniform register that nothing wrote (`UIADD3 UR10, UP0, UR10, 0x40`, the PTX
    right), so the product reads shared memory at an address left from before: on the H200,
    bf16 GDN B4 T16 H16 K33 V64 at BV 32, 4 warps, 3 stages faults (an illegal address) and
    compute-sanitizer names it, "Invalid __shared__ read of size 1024 bytes ... Access to
    0x3c400 is out of bounds".  Offline (sm_90, Triton 3.6,
    tools/kernel_resources.py's "unwritten uniform reads") the same read appears at K 33, 35,
    49, 65, 97 and 127 with BV 32 at 4 or 8 warps and 2 or 3 stages, and at K 64 and 128 with
    BV 32 at one stage (not among the built-in configs; a config's state_configs can name
    it); never at BV 16 or 64 (docs/findings.md).  Under the interpreter nothing is
    pruned."""
    if INTERPRET:
        return list(configs)
    sound = [c for c in configs if c.kwargs["BV"] != 32 or (K % 2 == 0 and c.num_stages > 1)]
    if not sound:
        raise ValueError(f"no state-pass config left at K={K}: BV 32 is miscompiled at an odd K "
                         f"and at one stage (gdn.fwd_state._sound_configs); the configs given: "
                         f"{configs}")
    return sound


def _prune(configs, named_args, **kwargs):
    return _sound_configs(configs, kwargs["K"])


def _spread_order(configs, key: dict) -> list:
    """``configs`` rotated to start at the one the key's CRC picks ("spread"): the same order
    in every process, different keys starting at different configs."""
    pick = zlib.crc32(repr([str(key.get(n)) for n in KEY]).encode()) % len(configs)
    return configs[pick:] + configs[:pick]


def _first_that_fits(configs, launch):
    """Launch with the first of ``configs`` that compiles for this GPU (``launch(config)``);
    one that needs more shared memory than it has raises OutOfResources at compile time,
    before anything runs, and the next is launched.  Returns the config launched.  (The
    autotuner skips a config that needs more shared memory than the GPU has, and so must a
    pick: at fp32 K = V = 256, BV 64 at 2 stages needs 312320 B, the H200 has 232448.)"""
    for i, config in enumerate(configs):
        try:
            launch(config)
            return config
        except OutOfResources:
            if i == len(configs) - 1:
                raise


def _tuner(config: GDNConfig = DEFAULT):
    """The autotuned matrix part over ``config``'s configs: one autotuner, with its timings, per
    distinct list of configs (and interpreter setting, which decides the list)."""
    return _tuned(config.state_configs, INTERPRET)


@functools.lru_cache(maxsize=None)
def _tuned(state_configs: tuple, interpret: bool):
    return triton.autotune(configs=_state_configs(GDNConfig(state_configs=state_configs)), key=KEY,
                           prune_configs_by={"early_config_prune": _prune})(_state_kernel)


def launch_state(args, NH, config: GDNConfig = DEFAULT, **kw):
    """PART 0 over (V tiles of its config's width, NH sequence-heads), then PART 1 over
    ``config.state_resume_bv``-wide tiles; ``args`` and ``kw`` as `_state_kernel` takes them,
    less BV and PART.  PART 0's config, by ``config.state_pick``: "tune", autotuned; "spread",
    the first that fits of the configs in the key's order (`_spread_order`); "first", the first
    that fits in their own order (at fp32 K = V = 256 the first built-in one, BV 32 at 2
    stages, does not fit the H200's shared memory)."""
    V = kw["V"]
    if config.state_pick == "tune":
        _tuner(config)[lambda meta: (triton.cdiv(V, meta["BV"]), NH)](*args, PART=0, **kw)
    else:
        def launch(c):
            _state_kernel[(triton.cdiv(V, c.kwargs["BV"]), NH)](
                *args, PART=0, BV=c.kwargs["BV"], num_warps=c.num_warps, num_stages=c.num_stages, **kw)
        configs = _sound_configs(_state_configs(config), kw["K"])
        spread = config.state_pick == "spread"
        _first_that_fits(_spread_order(configs, {**kw, "OCC": args[-1]}) if spread else configs, launch)
    RB = config.state_resume_bv
    _state_kernel[(triton.cdiv(V, RB), NH)](*args, PART=1, BV=RB, num_warps=config.state_resume_warps, **kw)
