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
5. ``_exact``  (groups of ``bwd_exact_chunks`` chunks in parallel)  rewrites the gradients of flagged chunks
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

import torch
import triton
import triton.language as tl

from gdn.bwd_chunks import chunk_plan, generic_v
from gdn.bwd_exact import _exact
from gdn.bwd_grads import _grads_p, _grads_wy
from gdn.bwd_matrix import _dstates, _prep, _states
from gdn.common import BIG, EXACT_PRODUCTS, SBIG, VECTOR_DECAY_MAX, chunk_tokens, handoff_dtype, pow2
from gdn.config import DEFAULT, GDNConfig

_KERNELS = (_prep, _states, _dstates, _grads_wy, _grads_p, _exact)
_AT_V1 = {kern: generic_v(kern) for kern in _KERNELS}   # the launches at V == 1
# The sequential kernels run in two parts each, a matrix part with no branch in its loop
# (Triton pipelines its loads; a loop with the branch gets no asynchronous copies with Triton
# 3.6 on sm_90) and a resume part, as the forward's state pass.


def stages(config: GDNConfig, key: str, F32: bool, BK: int = 0) -> int:
    """A kernel's pipeline stages: one where the dots take fp32 operands, and for the two
    sequential kernels (``key`` "bwd_seq_stages", "bwd_dstates_stages") where BK is over 128;
    else the config's field ``key``.  fp32 tiles are twice bf16's, and the stages' copies of
    them overrun the H200's shared memory: `_dstates` at 3 stages needs 295424 B of 232448 at
    fp32 K 100 (BK 128), V 64; at one stage 81920 B (sm_90 offline; K = V = 256: 147456 B, and
    `_states` 229632 -> 81920 B, within an A100's 164 KB).  bf16 [C, 256] tiles do the same:
    at a K of 144 to 256 that Triton knows divisible by 16 (so its copies are pipelined)
    `_dstates` at 3 stages needs 393728 B and at 2 270592, `_states` at 2 stages 180480 B,
    over an A100's (sm_90 offline); at one stage 98304 B."""
    seq = key in ("bwd_seq_stages", "bwd_dstates_stages")
    return 1 if F32 or (seq and BK > 128) else getattr(config, key)


def prep_launch(config: GDNConfig, given_t: bool, C: int) -> dict:
    """`_prep`'s launch keywords: its warps (on the forward's T or saved states, given_t:
    ``bwd_prep_given_warps``) and the inverse's tile width IW."""
    warps = config.bwd_prep_given_warps if given_t else config.bwd_prep_warps
    return dict(num_warps=warps, IW=max(32 * warps, C))


def tiles(K: int, V: int, config: GDNConfig = DEFAULT) -> dict:
    """The tile sizes the kernels launch with: BK; BV of _prep and _states (NV = ceil(V /
    BV) programs split V; _dstates's is `dstates_tile`'s); BV of _grads_wy, _grads_p and of _exact;
    BKS, the K slice of _grads_wy and _grads_p.  V tiles are ``config.bwd_bv`` (64) wide at any
    K (see there); _exact's float64 [BK, BV] tiles hold about ``bwd_exact_elements``, which
    keeps its stack small (sm_90 offline, BK 128: 1248 bytes at BV 16, 14192 at 64)."""
    BK = pow2(K)
    BV = config.bwd_bv
    return {"BK": BK, "BV": BV, "grads_BV": min(config.bwd_grads_bv, BV),
            "exact_BV": min(BV, max(16, config.bwd_exact_elements // BK)),
            "grads_BKS": min(config.bwd_grads_bk, BK)}


def dstates_tile(BK: int, V: int, heads: int, sms: int, config: GDNConfig = DEFAULT) -> int:
    """`_dstates`'s V tile for `heads` (sequence, head) pairs on `sms` multiprocessors (one
    program an SM: 255 registers at 8 warps): 128 where V > 64, BK <= 128 and the waves it
    saves outweigh its longer program (``config.bwd_dstates_wide_cost``), else 64.  At bf16 B8
    H16 K=V=128 on the H200 (132 SMs): 128 programs, one wave, at 128 against two at 64; at B1
    H16, 16 programs at 128 would each take 1.8x the 32 at 64.  ``config.bwd_dstates_bv``,
    where set, decides instead."""
    if config.bwd_dstates_bv:
        return config.bwd_dstates_bv
    if V <= 64 or BK > 128:   # [256, 128] fp32 state-gradient tiles would spill
        return 64
    waves = {bv: triton.cdiv(heads * triton.cdiv(V, bv), sms) for bv in (64, 128)}
    return 128 if waves[128] * config.bwd_dstates_wide_cost < waves[64] else 64


def _sm_count(dev) -> int:
    """Multiprocessors of a CUDA device; on the CPU (interpreter) the H200's 132, so that the
    tiles are the ones it would launch."""
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132


def _dot_mode(dtype):
    """(fp32 dots?, operand dtype of the tensor-core dots)."""
    if EXACT_PRODUCTS or dtype == torch.float32:
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
    want = {"states": ((NC, H, K, V), inter), "state_exp": ((NC, H, V), torch.int32),
            "stepped": ((NC, H, V), torch.int8)}
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
                  cu_seqlens=None, delta=True, chunk_size=None, inverse=None, saved=None,
                  config: GDNConfig = DEFAULT):
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
    its q and k checks.  config: the launch choices (`gdn.config`).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if K > 256 or V > 256:
        raise ValueError(f"chunk_gdn_bwd supports K, V <= 256; got K={K}, V={V}")
    if cu_seqlens is not None and B != 1:
        raise ValueError("cu_seqlens needs B == 1")
    scale = K ** -0.5 if scale is None else float(scale)
    C = chunk_size or chunk_tokens(g is not None and g.dim() == 4)
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
    config = config.at_v(V)   # the launch choices (gdn.config) at this V
    tile = tiles(K, V, config)
    BK, BV = tile["BK"], tile["BV"]
    NV = triton.cdiv(V, BV)
    BVD = dstates_tile(BK, V, N * H, _sm_count(dev), config)
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
    # stands for _prep's q and k checks, so that _prep loads neither
    ostep = fwd_states.get("out_stepped") if fwd_states is not None else None
    NVX = NV   # the hflag tiles `_exact` reads
    if fwd_states is not None:
        hs, hexp = fwd_states["states"], fwd_states["state_exp"]
        if ostep is not None:
            # every chunk the forward stepped is in the record, so _prep's flag sends it to
            # _exact: no hflag (a torch reduction saved)
            hflag, NVX = torch.empty(1, device=dev, dtype=torch.int32), 0
        else:
            hflag = _stepped_tiles(fwd_states["stepped"], NV, BV)
    else:
        hs = torch.empty(NC, H, K, V, device=dev, dtype=inter)
        hexp = torch.zeros(NC, H, V, device=dev, dtype=torch.int32)
        hflag = torch.empty(NC, H, NV, device=dev, dtype=torch.int32)
    # the state gradient at every chunk end, fp32 for every input dtype, not in the hand-off
    # dtype: a flagged chunk's step path (`_exact`) ends at it, and where the gradient after
    # an infinite state nearly cancels, a bf16 rounding decides between NaN (inf - inf) and an
    # Inf; `_grads_p` rounds it to the hand-off dtype as its product operand.  For bf16 inputs
    # that is 2 bytes an element over a bf16 dhs: +256 MiB at B8 T4096 H16 K=V=128 with
    # 64-token chunks (NC H K V = 2^27), +1 GiB with 16-token ones (a vector gate)
    dhs = torch.empty(NC, H, K, V, device=dev, dtype=torch.float32)
    # a state (hs) or state gradient (dhs) past fp32's range where a chunk hands it on is
    # kept as hs 2^hexp (dhs 2^dexp), a power of two per column; 0 elsewhere
    dexp = torch.zeros(NC, H, V, device=dev, dtype=torch.int32)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dg = torch.empty_like(g) if g is not None else None
    dbeta = torch.empty_like(beta) if delta else None
    dh0 = torch.empty_like(initial_state) if initial_state is not None else None
    seq_warps = config.bwd_seq_warps
    _prep_, _states_, _dstates_, _grads_wy_, _grads_p_, _exact_ = (
        _AT_V1[kern] if V == 1 else kern for kern in _KERNELS)
    common = dict(C=C, BK=BK, BV=BV, GATE=GATE, DELTA=delta, IS_VARLEN=IS_VARLEN)
    _prep_[(NC, H)](q, k, v, gp, bp, do, flag, Tm, W, U,
                    ostep if ostep is not None else dummy, cu, tab, T, H, K, V,
                    ostep.shape[0] if ostep is not None else 0, FWD_FLAGS=ostep is not None,
                    F32=F32, DT=DT, GLIM=VECTOR_DECAY_MAX, BIG=BIG,
                    PREC="ieee" if F32 else "tf32", GIVEN_T=inverse is not None,
                    SAVED=fwd_states is not None,
                    num_stages=stages(config, "bwd_prep_stages", F32),
                    **prep_launch(config, inverse is not None, C), **common)
    # what _dstates hands _grads_p for the gate's h * dS_end term (`_hd_rows`): the rows
    # summed over each V tile, fp32
    HD = torch.empty(NC, H, NVD, K, device=dev, dtype=torch.float32) if g is not None else dummy
    # the two sequential kernels, each in two parts (matrix, resume); stop and sstop pass the
    # first chunk needing the step path, and the state (gradient) there, from one part to the
    # next, _states's first, then _dstates's
    stop = torch.empty(N * H, max(NV, NVD), device=dev, dtype=torch.int32)
    sstop = torch.empty(N, H, K, V, device=dev, dtype=torch.float32)
    h0 = initial_state if initial_state is not None else dummy
    for part in (0, 1) if fwd_states is None else ():
        _states_[(NV, N * H)](k, v, gp, bp, h0, flag, hflag, W, U, hs, hexp, stop, sstop, cu, coff,
                              T, H, K, V, HAS_H0=initial_state is not None, F32=F32, DT=DT,
                              SBIG=SBIG, PART=part, num_warps=seq_warps,
                              num_stages=stages(config, "bwd_seq_stages", F32, BK), **common)
    for part in (0, 1):
        _dstates_[(NVD, N * H)](q, k, gp, bp, do, dht if dht is not None else dummy,
                                dh0 if dh0 is not None else dummy, flag, dflag, W,
                                dU if delta else dv, dhs, dexp, hs, HD, stop, sstop, cu, coff, scale,
                                T, H, K, V, HAS_DHT=dht is not None,
                                HAS_H0=initial_state is not None, F32=F32, DT=DT, SBIG=SBIG,
                                num_warps=config.bwd_dstates_warps,
                                num_stages=stages(config, "bwd_dstates_stages", F32, BK),
                                PART=part, **dict(common, BV=BVD))
    dgx = dg if dg is not None else dummy
    dkp = dgp = dummy
    if delta:
        # fp32 partials: the WY share of dk and dg, added by _grads_p (kept in fp32 so that dk
        # and dg are rounded once, at their store)
        dkp = torch.empty(B, T, H, K, device=dev, dtype=torch.float32)
        if g is not None:
            dgp = torch.empty(g.shape, device=dev, dtype=torch.float32)
        _grads_wy_[(NC, H)](k, v, gp, bp, Tm, dU, hs, dv, dbeta, dkp, dgp, flag, cu, tab, T, H, K, V,
                            C=C, BK=BK, BKS=tile["grads_BKS"], BV=tile["grads_BV"], GATE=GATE,
                            IS_VARLEN=IS_VARLEN, F32=F32, DT=DT, num_warps=config.bwd_grads_wy_warps,
                            num_stages=stages(config, "bwd_grads_stages", F32))
    _grads_p_[(NC, H)](q, k, v, gp, do, U, hs, dhs, HD, dq, dk, dgx, dkp, dgp, flag, cu, tab, scale,
                       T, H, K, V, NVD, C=C, BK=BK, BKS=tile["grads_BKS"], BV=tile["grads_BV"],
                       GATE=GATE, DELTA=delta, IS_VARLEN=IS_VARLEN, F32=F32, DT=DT,
                       num_warps=config.bwd_grads_p_warps,
                       num_stages=stages(config, "bwd_grads_stages", F32))
    _exact_[(triton.cdiv(NC, config.bwd_exact_chunks), H)](
        q, k, v, gp, bp, do, h0, dht if dht is not None else dummy, flag, hflag, dflag, hs, hexp,
        dhs, dexp, dq, dk, dv, dg if dg is not None else dummy,
        dbeta if dbeta is not None else dummy, cu, tab, scale, T, H, K, V, NVX, NVD, NC,
        G=config.bwd_exact_chunks, HAS_H0=initial_state is not None, HAS_DHT=dht is not None,
        num_warps=seq_warps, **dict(common, BV=tile["exact_BV"]))
    return dq, dk, dv, dg, dbeta, dh0
