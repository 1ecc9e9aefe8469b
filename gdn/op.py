"""The GDN-family layer op with gradients: `gdn_attention` and its autograd Function.

Forward: `gdn.chunk_fwd.chunk_gdn_fwd`; backward: `gdn.chunk_bwd.chunk_gdn_bwd`.  The
forward saves its inputs and, with the delta rule, the WY inverse T = (I + A)^-1 its prep
formed ([B,T,H,C], fp32; bf16 for bf16 inputs, gdn.fwd_prep.t_dtype), so that the backward's prep does not invert again (as fla keeps
its A); with ``save_states`` (the default) also the state entering every chunk and, with the
delta rule, w and v_new (`gdn.chunk_fwd.saved_for_backward`), so that the backward does not
recompute them (fla recomputes them); without it the backward recomputes every chunk state.
Gradients reach q, k, v, g, beta and initial_state; the gradient of the final state (when
it is returned and used) flows into the backward.
"""
from __future__ import annotations

import torch

from gdn.chunk_bwd import chunk_gdn_bwd
from gdn.chunk_fwd import chunk_gdn_fwd
from gdn.config import DEFAULT


# what the op keeps of `gdn.chunk_fwd.saved_for_backward`: all of it with save_states, else T
SAVED = ("inverse", "states", "state_exp", "stepped", "w", "v_new", "out_stepped")


class ChunkGDNFunction(torch.autograd.Function):
    """(q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens,
    delta, save_states, config) -> (o, final_state or None)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens,
                delta, save_states, config):
        o, ht, saved = chunk_gdn_fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                     output_final_state=output_final_state,
                                     cu_seqlens=cu_seqlens, delta=delta, return_saved=True,
                                     config=config)
        saved = saved or {}
        kept = [saved.get(n) if save_states or n == "inverse" else None for n in SAVED]
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, *kept)
        ctx.scale, ctx.delta, ctx.config = scale, delta, config
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state, cu_seqlens, *kept = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        dq, dk, dv, dg, dbeta, dh0 = chunk_gdn_bwd(
            q, k, v, g, beta, do, dht, scale=ctx.scale, initial_state=initial_state,
            cu_seqlens=cu_seqlens, delta=ctx.delta, saved=dict(zip(SAVED, kept)), config=ctx.config)
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None, None, None


def gdn_attention(q, k, v, g=None, beta=None, *, scale=None, initial_state=None,
                  output_final_state=False, cu_seqlens=None, delta=True, save_states=True,
                  config=DEFAULT):
    """Gated DeltaNet family attention (see gdn.oracle for the recurrence).

    q, k [B,T,H,K] and v [B,T,H,V], one dtype of bf16/fp16/fp32; g None (no
    gate), [B,T,H] (scalar log gate) or [B,T,H,K] (vector log gate); beta
    [B,T,H] (needed when delta=True, ignored otherwise); initial_state
    [N,H,K,V]; cu_seqlens [N+1] int offsets with B == 1 for varlen batches.
    K, V in [16, 256].  Returns (o [B,T,H,V] in q's dtype, final_state
    [N,H,K,V] fp32 or None).  Differentiable in q, k, v, g, beta and
    initial_state; non-contiguous inputs are copied.  ``config``: the kernels' launch choices
    (`gdn.config.GDNConfig`; ``DEFAULT`` autotunes the forward's state pass).

    Memory.  The forward keeps, beyond references to its inputs, the delta rule's
    WY inverse T, fp32 or bf16 [B,T,H,C] (C = 64, 16 for a vector gate; 67 MB in bf16 at the
    shape below), which spares the backward a second inversion, and with
    ``save_states`` (the default) the state entering every chunk, ceil(T/C) * B*H*K*V
    elements in the hand-off dtype (bf16 for bf16 inputs, fp32 otherwise; 268 MB), and
    with the delta rule w [B,T,H,K] and v_new [B,T,H,V] in that dtype (134 MB each), which
    spare the backward its state pass and its W and U, and the forward's records of the
    chunks it stepped token by token (int8, per V column and per output V tile: 1 MB and
    16 KB).  That makes the op's forward+backward faster, for more memory: what a forward
    keeps for its backward (o included) is 769 MB at the shape below (fla 0.6.0, which
    recomputes the states: 194 MB).  ``save_states=False`` keeps T alone.  The backward
    holds transiently,
    besides the gradients themselves, the state gradient at every chunk end (and without
    ``save_states`` the recomputed state at every chunk start), ceil(T/C) * B*H*K*V
    elements each in the hand-off dtype, one fp32 state per sequence-head (N*H*K*V, where
    the sequential kernels' matrix parts hand over to their resume parts), with the delta
    rule dU [B,T,H,V] in the hand-off dtype (and without ``save_states`` W, U [B,T,H,K|V])
    and the WY share of dk [B,T,H,K] (and of a gate's dg) fp32; with a gate, the rows of
    h * dS_end, fp32 ceil(T/C) * B*H * ceil(V/BV) * K (BV 64 or 128,
    `gdn.chunk_bwd.dstates_tile`); P^T dO is formed by the state-gradient pass, not kept.
    The peak over a forward and backward at B=8, T=4096, H=16, K=V=128 bf16 is in
    docs/benchmarks.md.
    """
    if not delta:
        beta = None
    if scale is None:
        scale = q.shape[-1] ** -0.5
    o, ht = ChunkGDNFunction.apply(q, k, v, g, beta, initial_state, float(scale),
                                   output_final_state, cu_seqlens, delta, save_states, config)
    return o, ht
