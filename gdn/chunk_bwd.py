"""Triton backward of the GDN family: every gradient, the reverse-in-time stage too.

    chunk_gdn_bwd(q, k, v, g, beta, do, dht, ...) -> (dq, dk, dv, dg, dbeta, dh0)

The backward recomputes what it needs from the inputs (given the forward's T,
``inverse``, it skips the inversion), chunk by chunk (C tokens), in six kernels.  This module is the launcher: it
checks shapes, picks tiles and dot precision, allocates the hand-off tensors and
launches the kernels, which live in the modules named after their concept:

1. ``_prep``   (chunks in parallel)  flags every chunk whose inputs are not all
   finite (or whose cumulative gate is too steep for the factored vector-gate
   form), and for the delta rule builds the WY form of the chunk: the inverse
   T = (I + A)^-1 of the unit lower triangular system, W = T diag(beta) K_g and
   Uu = T diag(beta) V.
2. ``_states`` (sequential over chunks)  recomputes the state entering every
   chunk, h_c, and the chunk's effective values U = Uu - W h_c.
3. ``_dstates`` (sequential, reverse time)  carries the state gradient dS
   backward over the chunks; stores dS at every chunk end and dU, the full
   gradient of U (delta rule) or dv (no delta), P^T dO + K_end dS with its local
   part P^T dO formed in the step (off the chain); writes dh0.  With a gate it also
   stores the rows of h * dS (dS in fp32) for the gate's gradient.
   Kernels 2 and 3 launch twice, as the forward's state pass: a matrix part whose
   chunk loop has no branch (so Triton pipelines its loads), up to the first chunk
   that needs the step path, then a resume part from there.
4. ``_grads_wy`` then ``_grads_p``  (chunks in parallel)  all the remaining
   gradients of a chunk from h_c, its end-state gradient, U and dU: the terms
   through T (dv, dbeta, partials of dk and dg; delta rule only), then the rest
   (dq, dk, dg).
5. ``_exact``  (groups of EXACT_CHUNKS chunks in parallel)  rewrites the gradients of flagged chunks
   with the step-by-step recurrence, the same operations as gdn.oracle in the
   same order and in float64, so the NaN/Inf pattern of a special value is the
   one float64 autograd through the oracle gives.  Kernels 2 and 3 take the same exact
   step path inside flagged chunks, and for any chunk whose incoming state or
   state gradient is not finite.

Kernels 1-3 and the chunk algebra: gdn.bwd_matrix; kernel 4 (two launches): gdn.bwd_grads; kernel 5 and the step path:
gdn.bwd_exact; the in-chunk gate sums and the scalar gate's gradient:
gdn.bwd_gate; the chunk table (fixed-length or varlen): gdn.bwd_chunks.

Columns of S (the value dimension) evolve independently, so the sequential
kernels split V across programs.  No atomics: every output element is written
by exactly one program, so results are bitwise reproducible.

Refuses: K or V over 256, cu_seqlens with B != 1; shapes follow gdn.oracle.
"""
from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

from gdn.bwd_chunks import chunk_plan, generic_v
from gdn.bwd_exact import _exact
from gdn.bwd_grads import _grads_p, _grads_wy
from gdn.bwd_matrix import _dstates, _prep, _states
from gdn.chunk_fwd import BIG, SBIG, VECTOR_DECAY_MAX, _pow2, handoff_dtype

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_KERNELS = (_prep, _states, _dstates, _grads_wy, _grads_p, _exact)
_AT_V1 = {kern: generic_v(kern) for kern in _KERNELS}   # the launches at V == 1
# launch configuration for the GPU (fixed, not autotuned: one compile per shape
# class, and the interpreter runs the same code); benchmarks may override it
LAUNCH = {"prep_warps": 4, "prep_stages": 2, "grads_bv": 64, "seq_warps": 4,
          # _states (matrix part, pipelined) on the H200 (session 11): 2 stages 0.297 ms, 3 0.436
          "seq_stages": 2,
          # _prep on the forward's T (GIVEN_T): 8 warps measured 0.460 -> 0.429 ms in session
          # 10, but 0.518 -> 0.907 in session 12 (with P^T dO in it since session 11)
          "prep_given_warps": 4,
          # on the forward's saved states (no W, U; session 18): 8 warps 0.374 ms against 0.330
          # session 18 (H200, bwd on the forward's T): 8 warps capped at 128 registers (two
          # programs an SM) 0.533 ms against 0.501
          # _dstates (matrix part) on the H200 (session 11, P^T dO from _prep): 8 warps and 3
          # stages 0.528 ms, 4 warps 0.851 (sm_90 offline, 4 warps: 880 stack bytes); session
          # 16 (decays on the value tiles): 3 stages 0.737 ms, 2 stages 0.735, which need
          # 229888 and 155904 B of shared memory at bf16 K=V=128 (sm_90 offline; an A100 holds
          # about 164 KB a block, the H200 232448 B)
          "dstates_warps": 8, "dstates_stages": 2,
          # _dstates's V tile, 64 or 128; None: `dstates_tile`'s choice by waves
          "dstates_bv": None,
          # session 18: at two programs an SM (256 programs in one wave on the 132 SMs) slower:
          # 4 warps 1 stage 0.805 ms, 8 warps 1 stage capped at 128 registers 1.097; 8 warps 1
          # stage uncapped 0.927, against 0.731
          # the gradients, measured on the H200 (session 10, bf16 B8 T4096 H16 K=V=128):
          # _grads_p at 8 warps and 2 stages 1.232 ms, 4 warps 1.019, 4 warps and 3 stages
          # 0.949, though sm_90 offline says 4 warps spill; _grads_p in 32-wide K slices
          # 1.707; session 12: _grads_p with one program per K slice (dO U^T formed in each)
          # 1.169 at 4 warps, 1.488 at 8, 1.624 in 32-wide slices, against 0.949 (deleted)
          "grads_stages": 3, "grads_p_warps": 4, "grads_bk": 64,
          # _grads_wy (K in slices) on the H200 (session 12): 4 warps 0.798 ms, 8 warps 1.191
          # (the form with [C, K] accumulators it replaced: 0.949 at 8)
          "grads_wy_warps": 4}
LAUNCH.update(json.loads(os.environ.get("GDN_BWD_LAUNCH", "{}")))   # device bring-up overrides
# The sequential kernels in two parts each, a matrix part with no branch in its loop (Triton
# pipelines its loads: with Triton 3.6, sm_90 offline, 0 asynchronous copies in the branching
# loop of _states and _dstates) and a resume part, as the forward's state pass
# (session 11); GDN_BWD_SEQ=branch (bring-up, for timing) runs the resume part alone from the
# first chunk, which is the branching loop of sessions 1-10
SEQ_SPLIT = os.environ.get("GDN_BWD_SEQ", "split") != "branch"
# _dstates at a 128-wide V tile against two 64-wide ones, per program, with P^T dO formed in
# the step (its Q K^T once a head instead of once a tile): 0.837 ms for one wave of 128
# programs against 0.921 for two waves of 256 (0.46 a wave) on the H200 (session 19, bf16
# GDN B8 T4096 H16 K=V=128 on the forward's saved states).  Without P^T dO in the step the
# wider tile lost (0.831 against 0.733); at 16 warps it took 2.47 ms (sm_90 offline: 936 B of
# spill at 128 registers, against 408 at 8 warps)
DSTATES_WIDE_COST = 1.82
# The chunks of a head one `_exact` program looks at (their flags in one load): a program a
# chunk took 0.017 ms on the H200 with nothing flagged (session 20, bf16 B8 T4096 H16)
EXACT_CHUNKS = 16
# A V that is not a multiple of 16 keeps 8 warps and 2 stages for the gradients: at 4 warps
# the H200 gave dq 0.87 and dk 1.4 off at K 32, V 1, bf16 (gates none and scalar; session
# 10's sweep, every V of 16, 32 and 64 right).  V 1 compiles V as a plain integer
# (`gdn.bwd_chunks.generic_v`), as any V without Triton's divisibility-by-16 hint does, and
# 8 warps was right at V 1 in every sweep (and at V 24 and 80 in session 7's); _grads_wy
# too (session 13's sweep at V 2, 3, 8, 15 ran it at 8 there)
LAUNCH_UNHINTED = {"grads_stages": 2, "grads_p_warps": 8, "grads_wy_warps": 8}


def launch_for(V: int) -> dict:
    """The launch configuration at V (LAUNCH, with LAUNCH_UNHINTED where V % 16 != 0)."""
    return dict(LAUNCH, **(LAUNCH_UNHINTED if V % 16 else {}))


def stages(launch: dict, key: str, F32: bool, BK: int = 0) -> int:
    """A kernel's pipeline stages: one where the dots take fp32 operands, and for the two
    sequential kernels (``key`` "seq_stages", "dstates_stages") where BK is over 128; else
    launch[key].  fp32 tiles are twice bf16's, and the stages' copies of them overran the
    H200's shared memory: `_dstates` at 3 stages needed 295424 B of 232448 at fp32 K 100 (BK
    128), V 64 (session 13's device verify, G03); at one stage 81920 B (sm_90 offline; K = V
    = 256: 147456 B, and `_states` 229632 -> 81920 B, within an A100's 164 KB).  bf16 [C,
    256] tiles did the same: at a K of 144 to 256 that Triton knows divisible by 16 (so its
    copies are pipelined) `_dstates` at 3 stages needs 393728 B (303616 before session 16's
    decays on the value tiles) and at 2 270592, `_states` at 2 stages 180480 B, over an
    A100's (sm_90 offline, session 16); at one stage 98304 B."""
    seq = key in ("seq_stages", "dstates_stages")
    return 1 if F32 or (seq and BK > 128) else launch[key]


def prep_launch(launch: dict, given_t: bool, C: int) -> dict:
    """`_prep`'s launch keywords: its warps (on the forward's T or saved states, given_t:
    "prep_given_warps") and the inverse's tile width IW."""
    warps = launch["prep_given_warps" if given_t else "prep_warps"]
    return dict(num_warps=warps, IW=max(32 * warps, C))


def tiles(K: int, V: int) -> dict:
    """The tile sizes the kernels launch with: BK; BV of _prep and _states (NV = ceil(V /
    BV) programs split V; _dstates's is `dstates_tile`'s); BV of _grads_wy, _grads_p and of _exact;
    BKS, the K slice of _grads_wy and _grads_p."""
    BK = _pow2(K)
    # BK >= 128 takes 64-wide V tiles: on the H200 (Triton 3.6) with 16- or 32-wide ones the
    # sequential kernels' products compiled to out-of-range shared-memory addresses
    # (compute-sanitizer) or silently wrong gradients (K=184 V=1: error 0.91); found by kfuzz
    # (gdn_bwd, bf16 B4 T4095 H7 K184 V1). At BK 128, BV 32 (session 5, bf16 B8 T4096
    # H16 K=V=128 forced to BV 32) every chunk went to the exact path and dq, dk, dg, dbeta
    # came out NaN. tests/test_gdn_backward.py holds the shapes.  Narrower keys too (session 7,
    # tools/sweep_gdn_gpu.py over K 16-184, V 1-64, bf16): BK 32 with BV 16 gave NaN
    # gradients (at V 1 and 16; right with _prep at 8 warps, which doubles its time at the
    # bench shape), BK 64 with BV 32 dq/dk/dbeta 0.2-0.6 off; every K took 64-wide tiles right.
    # So V tiles are 64 wide at any K (masked past V; narrow V is not where the time goes).
    BV = 64
    # _exact's float64 [BK, BV] tiles: ~2048 elements keep the stack small (sm_90 offline,
    # BK 128: 1248 bytes at BV 16, 14192 at 64; fp32 at 64 was 6760)
    return {"BK": BK, "BV": BV, "grads_BV": min(LAUNCH["grads_bv"], BV),
            "exact_BV": min(BV, max(16, 2048 // BK)),
            "grads_BKS": min(LAUNCH["grads_bk"], BK)}


def dstates_tile(BK: int, V: int, heads: int, sms: int) -> int:
    """`_dstates`'s V tile for `heads` (sequence, head) pairs on `sms` multiprocessors (one
    program an SM: 255 registers at 8 warps): 128 where V > 64, BK <= 128 and the waves it
    saves outweigh its longer program (DSTATES_WIDE_COST), else 64.  At bf16 B8 H16 K=V=128
    on the H200 (132 SMs): 128 programs, one wave, at 128 against two at 64; at B1 H16, 16
    programs at 128 would each take 1.8x the 32 at 64.  LAUNCH["dstates_bv"] overrides."""
    if LAUNCH["dstates_bv"]:
        return LAUNCH["dstates_bv"]
    if V <= 64 or BK > 128:   # [256, 128] fp32 state-gradient tiles would spill
        return 64
    waves = {bv: triton.cdiv(heads * triton.cdiv(V, bv), sms) for bv in (64, 128)}
    return 128 if waves[128] * DSTATES_WIDE_COST < waves[64] else 64


def _sm_count(dev) -> int:
    """Multiprocessors of a CUDA device; on the CPU (interpreter) the H200's 132, so that the
    tiles are the ones it would launch."""
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132


def _dot_mode(dtype):
    """(fp32 dots?, operand dtype of the tensor-core dots)."""
    if INTERPRET or dtype == torch.float32:
        return True, tl.float32
    if dtype == torch.float16:
        # fp16 range is too narrow for the chunk's intermediates: use tf32-free fp32
        return True, tl.float32
    return False, tl.bfloat16



def _forward_states(saved, NC, H, K, V, B, T, inter, dev, delta):
    """The forward's chunk states and, with the delta rule, its w and v_new
    (`gdn.chunk_fwd.saved_for_backward`), checked against this backward's chunks; None where
    ``saved`` holds no states (the backward then recomputes them)."""
    if not saved or saved.get("states") is None:
        return None
    want = {"states": ((NC, H, K, V), inter), "stepped": ((NC, H, V), torch.int8)}
    if delta:
        want.update(w=((B, T, H, K), inter), v_new=((B, T, H, V), inter))
    for name, (shape, dtype) in want.items():
        x = saved.get(name)
        if x is None or tuple(x.shape) != shape or x.dtype != dtype or x.device != dev \
                or not x.is_contiguous():
            got = "missing" if x is None else f"{x.dtype} {tuple(x.shape)} on {x.device}"
            raise ValueError(f"saved[{name!r}] must be the forward's, contiguous {dtype} {list(shape)} "
                             f"on {dev}; got {got}")
    x = saved.get("out_stepped")   # optional: its first dim is the forward's output V tiles
    if x is not None and (x.dtype != torch.int8 or x.dim() != 3 or tuple(x.shape[1:]) != (NC, H)
                          or x.device != dev or not x.is_contiguous()):
        raise ValueError(f"saved['out_stepped'] must be the forward's, contiguous int8 "
                         f"[NVo, {NC}, {H}] on {dev}; got {x.dtype} {tuple(x.shape)} on {x.device}")
    return saved


def _stepped_tiles(stepped, NV: int, BV: int):
    """hflag from the forward's record of stepped columns (int8 [NC,H,V]): a V tile is
    flagged where the forward stepped any of its columns token by token, so that `_exact`
    rewrites that chunk (its v_new is not written there)."""
    NC, H, V = stepped.shape
    x = torch.nn.functional.pad(stepped, (0, NV * BV - V))
    return x.view(NC, H, NV, BV).amax(-1).to(torch.int32).contiguous()


def chunk_gdn_bwd(q, k, v, g, beta, do, dht=None, *, scale=None, initial_state=None,
                  cu_seqlens=None, delta=True, chunk_size=None, inverse=None, saved=None):
    """Gradients of the GDN family recurrence (see gdn.oracle for the math).

    q, k [B,T,H,K]; v, do [B,T,H,V]; g None, [B,T,H] or [B,T,H,K] (log gate);
    beta [B,T,H] (delta=True only); dht [N,H,K,V] or None (gradient of the final
    state); initial_state [N,H,K,V] or None.  Varlen: B == 1 and cu_seqlens
    [N+1] offsets.  Returns (dq, dk, dv, dg, dbeta, dh0), each in its input's
    dtype; dg is None without a gate, dbeta None without delta, dh0 None
    without an initial state.  chunk_size (16, 32 or 64) defaults to 64, or 16
    for a vector gate.  inverse: the forward's T = (I + A)^-1 of every chunk, fp32
    (bf16 for bf16 inputs, as the forward stores it: `gdn.fwd_prep.t_dtype`) [B,T,H,C] (`chunk_gdn_fwd(..., return_inverse=True)`, delta rule only), which spares
    _prep the inverse; without it _prep forms T itself.  saved: what the forward hands over
    (`chunk_gdn_fwd(..., return_saved=True)`): its T (taken as ``inverse`` where that is not
    given) and, where it holds them, the state entering every chunk and with the delta rule w
    and v_new, which spare the backward `_states` and _prep's W and U; with those, its
    output kernel's record of stepped chunks ("out_stepped", optional), which spares _prep
    its q and k checks.
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
    tile = tiles(K, V)
    BK, BV = tile["BK"], tile["BV"]
    NV = triton.cdiv(V, BV)
    BVD = dstates_tile(BK, V, N * H, _sm_count(dev))
    NVD = triton.cdiv(V, BVD)   # _dstates's V tiles: dflag and HD are per tile of these
    IS_VARLEN = cu_seqlens is not None
    if inverse is None and saved:
        inverse = saved.get("inverse")
    fwd_states = _forward_states(saved, NC, H, K, V, B, T, inter, dev, delta)
    if fwd_states is not None and delta and inverse is None:   # _prep forms no T beside them
        raise ValueError("saved states with the delta rule need the forward's T: saved['inverse'] "
                         "or inverse=; got neither")
    t_dtypes = (torch.float32, torch.bfloat16) if q.dtype == torch.bfloat16 else (torch.float32,)
    if inverse is not None and (not delta or tuple(inverse.shape) != (B, T, H, C)
                                or inverse.dtype not in t_dtypes or inverse.device != dev):
        raise ValueError(f"inverse must be the forward's T, fp32 (or bf16 for bf16 inputs) "
                         f"[{B},{T},{H},{C}] on {dev} with "
                         f"delta=True; got {inverse.dtype} {tuple(inverse.shape)} on {inverse.device}"
                         f"{'' if delta else ' with delta=False'}")
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
    dflag = torch.empty(NC, H, NVD, device=dev, dtype=torch.int32)
    if inverse is not None:
        Tm = inverse.contiguous()   # the forward's T: _prep reads it (GIVEN_T)
    elif delta:
        # T = (I + A)^-1, fp32: _prep's inverse passes through it as scratch
        Tm = torch.empty(B, T, H, C, device=dev, dtype=torch.float32)
    if delta:
        if fwd_states is not None:   # the forward's: _prep forms neither
            W, U = fwd_states["w"], fwd_states["v_new"]
        else:
            W = torch.empty(B, T, H, K, device=dev, dtype=inter)
            U = torch.empty(B, T, H, V, device=dev, dtype=inter)
        dU = torch.empty(B, T, H, V, device=dev, dtype=inter)
    else:
        Tm = W = U = dU = dummy
    # on the forward's saved states, its output kernel's record of the chunks it stepped
    # stands for _prep's q and k checks (session 20): _prep 0.105 -> 0.043 ms on the H200
    ostep = fwd_states.get("out_stepped") if fwd_states is not None else None
    NVX = NV   # the hflag tiles `_exact` reads
    if fwd_states is not None:
        hs = fwd_states["states"]
        if ostep is not None:
            # every chunk the forward stepped is in the record, so _prep's flag sends it to
            # _exact: no hflag (its torch reduction took 0.007 ms on the H200)
            hflag, NVX = torch.empty(1, device=dev, dtype=torch.int32), 0
        else:
            hflag = _stepped_tiles(fwd_states["stepped"], NV, BV)
    else:
        hs = torch.empty(NC, H, K, V, device=dev, dtype=inter)
        hflag = torch.empty(NC, H, NV, device=dev, dtype=torch.int32)
    dhs = torch.empty(NC, H, K, V, device=dev, dtype=inter)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dg = torch.empty_like(g) if g is not None else None
    dbeta = torch.empty_like(beta) if delta else None
    dh0 = torch.empty_like(initial_state) if initial_state is not None else None
    launch = launch_for(V)
    seq_warps = launch["seq_warps"]
    _prep_, _states_, _dstates_, _grads_wy_, _grads_p_, _exact_ = (
        _AT_V1[kern] if V == 1 else kern for kern in _KERNELS)
    common = dict(C=C, BK=BK, BV=BV, GATE=GATE, DELTA=delta, IS_VARLEN=IS_VARLEN)
    _prep_[(NC, H)](q, k, v, gp, bp, do, flag, Tm, W, U,
                    ostep if ostep is not None else dummy, cu, tab, T, H, K, V,
                    ostep.shape[0] if ostep is not None else 0, FWD_FLAGS=ostep is not None,
                    F32=F32, DT=DT, GLIM=VECTOR_DECAY_MAX, BIG=BIG,
                    PREC="ieee" if F32 else "tf32", GIVEN_T=inverse is not None,
                    SAVED=fwd_states is not None,
                    num_stages=stages(launch, "prep_stages", F32),
                    **prep_launch(launch, inverse is not None, C), **common)
    # what _dstates hands _grads_p for the gate's h * dS_end term (`_hd_rows`): the rows
    # summed over each V tile, fp32
    HD = torch.empty(NC, H, NVD, K, device=dev, dtype=torch.float32) if g is not None else dummy
    # the two sequential kernels, each in two parts (matrix, resume); stop and sstop pass the
    # first chunk needing the step path, and the state (gradient) there, from one part to the
    # next, _states's first, then _dstates's
    stop = torch.empty(N * H, max(NV, NVD), device=dev, dtype=torch.int32)
    sstop = torch.empty(N, H, K, V, device=dev, dtype=torch.float32)
    parts = (0, 1) if SEQ_SPLIT else (1,)
    if not SEQ_SPLIT:   # bring-up: PART 1 alone, from the first chunk (the branching loop)
        stop.zero_()
        sstop.copy_(initial_state if initial_state is not None else torch.zeros_like(sstop))
    h0 = initial_state if initial_state is not None else dummy
    for part in parts if fwd_states is None else ():
        _states_[(NV, N * H)](k, v, gp, bp, h0, flag, hflag, W, U, hs, stop, sstop, cu, coff,
                              T, H, K, V, HAS_H0=initial_state is not None, F32=F32, DT=DT,
                              SBIG=SBIG, PART=part, num_warps=seq_warps,
                              num_stages=stages(launch, "seq_stages", F32, BK), **common)
    if not SEQ_SPLIT:
        sstop.copy_(dht if dht is not None else torch.zeros_like(sstop))
        if dh0 is not None:   # a sequence with no chunk: PART 1 writes nothing
            dh0.copy_(sstop)
    for part in parts:
        _dstates_[(NVD, N * H)](q, k, gp, bp, do, dht if dht is not None else dummy,
                                dh0 if dh0 is not None else dummy, flag, dflag, W,
                                dU if delta else dv, dhs, hs, HD, stop, sstop, cu, coff, scale,
                                T, H, K, V, HAS_DHT=dht is not None,
                                HAS_H0=initial_state is not None, F32=F32, DT=DT, SBIG=SBIG,
                                num_warps=launch["dstates_warps"],
                                num_stages=stages(launch, "dstates_stages", F32, BK),
                                PART=part, **dict(common, BV=BVD))
    dgx = dg if dg is not None else dummy
    dkp = dgp = dummy
    if delta:
        # fp32 partials: the WY share of dk and dg, added by _grads_p (kept in fp32 so that dk
        # and dg are rounded once, at their store)
        dkp = torch.empty(B, T, H, K, device=dev, dtype=torch.float32)
        if g is not None:
            dgp = torch.empty(g.shape, device=dev, dtype=torch.float32)
        _grads_wy_[(NC, H)](k, v, gp, bp, Tm, dU, hs, dv, dbeta, dkp, dgp, cu, tab, T, H, K, V,
                            C=C, BK=BK, BKS=tile["grads_BKS"], BV=tile["grads_BV"], GATE=GATE,
                            IS_VARLEN=IS_VARLEN, F32=F32, DT=DT, num_warps=launch["grads_wy_warps"],
                            num_stages=stages(launch, "grads_stages", F32))
    _grads_p_[(NC, H)](q, k, v, gp, do, U, hs, dhs, HD, dq, dk, dgx, dkp, dgp, cu, tab, scale,
                       T, H, K, V, NVD, C=C, BK=BK, BKS=tile["grads_BKS"], BV=tile["grads_BV"],
                       GATE=GATE, DELTA=delta, IS_VARLEN=IS_VARLEN, F32=F32, DT=DT,
                       num_warps=launch["grads_p_warps"],
                       num_stages=stages(launch, "grads_stages", F32))
    _exact_[(triton.cdiv(NC, EXACT_CHUNKS), H)](
        q, k, v, gp, bp, do, flag, hflag, dflag, hs, dhs, dq, dk, dv,
        dg if dg is not None else dummy, dbeta if dbeta is not None else dummy,
        cu, tab, scale, T, H, K, V, NVX, NVD, NC, G=EXACT_CHUNKS, num_warps=seq_warps,
        **dict(common, BV=tile["exact_BV"]))
    return dq, dk, dv, dg, dbeta, dh0
