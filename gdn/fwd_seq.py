"""The GDN forward's state pass and output kernel, version 5.3 (behind `gdn.chunk_fwd.V53`,
default off).

The same algorithm, checks, exact path and outputs as `gdn.chunk_fwd._state_kernel` and
`_out_kernel`, arranged for the H200's latency (gdn/NOTES.md, v5.3):

- Both load every tile of a chunk and compute the matrix path before the path decision; a
  chunk that fails the checks drops that result and runs token by token.  In the state pass
  the products then sit at the loop's top level, where Triton's pipeliner prefetches chunk
  c + 1's tiles while chunk c computes (loads inside v5.2's `if ok` were not pipelined); in
  the output kernel k and v_new are fetched together with q, not after q's check.  The state
  pass's v_new of a dropped chunk is garbage, but its columns are flagged in xflag, so the
  output kernel never reads it.
- A scalar decay multiplies v_new's rows ([BT, BV]) instead of k's ([BT, K]).
- Addresses are a 64-bit base per chunk plus 32-bit offsets inside it; masks only on padded
  dimensions.

LAUNCH["seq"] = "v5.2" keeps v5.3's WY prep (gdn.fwd_prep) but runs v5.2's state and output
kernels on its w, u and flag (the same buffers, layouts and dtypes): on the H200 v5.3's prep
was faster and its state pass slower (gdn/NOTES.md, v5.3).  A bf16-operand state pass
(session 4's LAUNCH["state_bf16"]) faulted on the H200 and is gone.

When v5.3 is adopted these replace the v5.2 kernels (no two copies kept).

Refuses nothing of its own: `gdn.chunk_fwd.chunk_gdn_fwd` checks the inputs.
"""
from __future__ import annotations

import triton
import triton.language as tl

from gdn.chunk_fwd import (_all_within, _chunk_span, _exact_chunk, _forced, _load_gates, _odot,
                           _prune, _seq_span, _state_configs)


@triton.jit
def _state_kernel(k, v, g, gc, gcl, gflag, beta, w, u, flag, h0, hs, vn, xflag, hT, cu, choff,
                  T, NT, OCC,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                  GATE: tl.constexpr, DELTA: tl.constexpr, HAS_H0: tl.constexpr,
                  STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr,
                  PREC: tl.constexpr, BIG: tl.constexpr, SBIG: tl.constexpr,
                  MODE: tl.constexpr):
    """gdn.chunk_fwd._state_kernel arranged as the module docstring says."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos, eos, c_first = _seq_span(i_n, T, NT, cu, choff, IS_VARLEN)
    dk = tl.arange(0, BK)
    kmask = dk < K
    dv = i_v * BV + tl.arange(0, BV)
    vmask = dv < V
    # masks only where a dimension has padding (a [BK, BV] mask costs registers)
    smask = vmask[None, :] if K == BK else kmask[:, None] & vmask[None, :]
    kv_off = dk[:, None] * V + dv[None, :]
    if HAS_H0:
        S = tl.load(h0 + i_nh.to(tl.int64) * (K * V) + kv_off, mask=smask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BK, BV), dtype=tl.float32)
    rr = tl.arange(0, BT)
    kx = rr[:, None] * (H * K) + dk[None, :]
    vx = rr[:, None] * (H * V) + dv[None, :]
    for c in range(0, tl.cdiv(eos - bos, BT)):
        cid = (c_first + c).to(tl.int64)
        tl.store(hs + (cid * H + i_h) * (K * V) + kv_off, S.to(hs.dtype.element_ty), mask=smask)
        t0 = bos + c * BT
        row0 = t0.to(tl.int64) * H + i_h
        rows = (t0 + rr).to(tl.int64)
        rmask = t0 + rr < eos
        last = t0 + rr == tl.minimum(t0 + BT, eos) - 1   # the chunk's last token
        mk = rmask[:, None] if K == BK else rmask[:, None] & kmask[None, :]
        mv = rmask[:, None] if V % BV == 0 else rmask[:, None] & vmask[None, :]
        # the chunk's tiles first, outside the branches: the loop's pipeliner can then fetch
        # chunk c + 1's tiles while chunk c computes (loads inside `if ok` cannot be)
        kt = tl.load(k + row0 * K + kx, mask=mk, other=0.0)
        if DELTA:
            wt = tl.load(w + row0 * K + kx, mask=mk, other=0.0)
            vt = tl.load(u + row0 * V + vx, mask=mv, other=0.0)
        else:
            vt = tl.load(v + row0 * V + vx, mask=mv, other=0.0)
        ok = _all_within(S, SBIG)
        if DELTA:
            ok = ok & (tl.load(flag + cid * H + i_h) != 0)
        else:
            ok = ok & _all_within(kt, BIG) & _all_within(vt, BIG)
        if GATE != 0:
            ok = ok & (tl.load(gflag + cid * H + i_h) != 0)
        ok = _forced(ok, MODE)
        tl.store(xflag + (cid * H + i_h) * V + dv, tl.zeros([BV], dtype=tl.int8) + tl.where(ok, 0, 1).to(tl.int8),
                 mask=vmask)
        # the matrix path unconditionally, so that its products sit at the loop's top level
        # (where the pipeliner prefetches their operands); a chunk that fails the checks
        # drops its result and is stepped exactly
        kf = kt.to(tl.float32)
        vf = vt.to(tl.float32)
        if DELTA:
            vf = vf - tl.dot(wt.to(tl.float32), S, input_precision=PREC)
            tl.store(vn + row0 * V + vx, vf.to(vn.dtype.element_ty), mask=mv)
        Sd = S
        if GATE == 1:   # the decay on v_new's rows, not on k's: [BT, BV] not [BT, BK]
            G, Glo = _load_gates(gc, gcl, rows, rmask, last, i_h, dk, mk, H, K, GATE)
            Gl = tl.sum(tl.where(last, G, 0.0), axis=0)
            Gll = tl.sum(tl.where(last, Glo, 0.0), axis=0)
            vf = vf * tl.exp((Gl - G) + (Gll - Glo))[:, None]
            kl = kf
            Sd = S * tl.exp(Gl + Gll)
        elif GATE == 2:
            G, _ = _load_gates(gc, gcl, rows, rmask, last, i_h, dk, mk, H, K, GATE)
            Gl = tl.sum(tl.where(last[:, None], G, 0.0), axis=0)
            kl = kf * tl.exp(Gl[None, :] - G)
            Sd = S * tl.exp(Gl)[:, None]
        else:
            kl = kf
        Sm = Sd + tl.dot(tl.trans(kl), vf, input_precision=PREC)
        if ok:
            S = Sm
        else:
            S = _exact_chunk(k, k, v, g, beta, k, S, 1.0, t0, eos, i_h, dk, kmask, dv, vmask,
                             smask, H, K, V, BT, GATE, DELTA, False)
    if STORE_HT:
        tl.store(hT + i_nh.to(tl.int64) * (K * V) + kv_off, S, mask=smask)


@triton.jit
def _out_kernel(q, k, v, g, gc, gcl, beta, hs, vn, xflag, o, cb_ptr, ce_ptr, scale, T, NT,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                GATE: tl.constexpr, DELTA: tl.constexpr, IS_VARLEN: tl.constexpr,
                PREC: tl.constexpr, BIG: tl.constexpr, MODE: tl.constexpr, DT: tl.constexpr):
    """gdn.chunk_fwd._out_kernel arranged as the module docstring says."""
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos = _chunk_span(i_c, cb_ptr, ce_ptr, T, NT, BT, IS_VARLEN)
    if bos < eos:
        rr = tl.arange(0, BT)
        rows = (bos + rr).to(tl.int64)
        rmask = bos + rr < eos
        last = bos + rr == eos - 1
        row0 = bos.to(tl.int64) * H + i_h
        dk = tl.arange(0, BK)
        kmask = dk < K
        dv = i_v * BV + tl.arange(0, BV)
        vmask = dv < V
        smask = vmask[None, :] if K == BK else kmask[:, None] & vmask[None, :]
        mk = rmask[:, None] if K == BK else rmask[:, None] & kmask[None, :]
        mv = rmask[:, None] if V % BV == 0 else rmask[:, None] & vmask[None, :]
        kx = rr[:, None] * (H * K) + dk[None, :]
        vx = rr[:, None] * (H * V) + dv[None, :]
        cid = i_c.to(tl.int64)
        S = tl.load(hs + (cid * H + i_h) * (K * V) + dk[:, None] * V + dv[None, :], mask=smask, other=0.0)
        qt = tl.load(q + row0 * K + kx, mask=mk, other=0.0)
        xf = tl.load(xflag + (cid * H + i_h) * V + dv, mask=vmask, other=0)
        # every tile loaded and the matrix path computed before the decision, so the loads
        # overlap (v5.2 loaded k and v_new only after q's check); a chunk that takes the
        # exact path drops the result
        kt = tl.load(k + row0 * K + kx, mask=mk, other=0.0)
        if DELTA:
            vt = tl.load(vn + row0 * V + vx, mask=mv, other=0.0)
        else:
            vt = tl.load(v + row0 * V + vx, mask=mv, other=0.0)
        ok = _forced((tl.max(xf.to(tl.int32)) == 0) & _all_within(qt, BIG), MODE)
        causal = rr[:, None] >= rr[None, :]
        if GATE == 1:
            G, Glo = _load_gates(gc, gcl, rows, rmask, last, i_h, dk, mk, H, K, GATE)
            dec = tl.exp(tl.where(causal, (G[:, None] - G[None, :]) + (Glo[:, None] - Glo[None, :]), 0.0))
            Aqk = _odot(qt, tl.trans(kt), DT, PREC) * dec
            qg = qt * tl.exp(G + Glo)[:, None]
        elif GATE == 2:
            G, _ = _load_gates(gc, gcl, rows, rmask, last, i_h, dk, mk, H, K, GATE)
            qg = qt * tl.exp(G)
            Aqk = _odot(qg, tl.trans(kt.to(tl.float32) * tl.exp(-G)), DT, PREC)
        else:
            Aqk = _odot(qt, tl.trans(kt), DT, PREC)
            qg = qt
        Aqk = tl.where(causal, Aqk, 0.0)
        ot = (_odot(qg, S, DT, PREC) + _odot(Aqk, vt, DT, PREC)) * scale
        if ok:
            tl.store(o + row0 * V + vx, ot.to(o.dtype.element_ty), mask=mv)
        else:
            _exact_chunk(q, k, v, g, beta, o, S.to(tl.float32), scale, bos, eos, i_h, dk, kmask, dv, vmask,
                         smask, H, K, V, BT, GATE, DELTA, True)


_state = triton.autotune(configs=_state_configs(),
                         key=["K", "V", "BT", "GATE", "DELTA", "PREC", "OCC"],
                         prune_configs_by={"early_config_prune": _prune})(_state_kernel)


# The output kernel's V tile and warps (bench_gdn's fwdprof stage also times BV 128 at 8
# warps: q and k read once per chunk, not once per V tile; 192 registers, no spill offline;
# on the H200 0.591 ms against 0.495).
# seq: "v5.3" runs this module's state and output kernels; "v5.2" runs gdn.chunk_fwd's
# (`_state`, `_out_kernel` at its own V tile and warps; out_bv and out_warps unused) on v5.3's
# prep, which took 0.56 ms on the H200 against v5.2's 0.74, while this state pass took 0.69
# against v5.2's 0.54 (gdn/NOTES.md, v5.3).
LAUNCH = {"out_bv": 64, "out_warps": 4, "seq": "v5.3"}
