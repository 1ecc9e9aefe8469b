"""The chunked GDN-family forward in PyTorch float32: the fast CPU reference,
kfuzz's trusted same-precision implementation for the `gdn_fwd` target, and the
written statement of the algorithm the Triton forward (`gdn.chunk_fwd`) follows.

The chunked algorithm.  Split each sequence into chunks of C tokens; S_0 is the
state before a chunk.  Inside the chunk let G_t = sum_{s<=t} g_s (over the chunk
only; a vector for a vector gate), Gamma_t = exp(G_t).  Unrolling the recurrence
(see `gdn.oracle`) gives, with delta_t = beta_t (v_t - (diag(a_t) S_{t-1})^T k_t),

    S_t = diag(Gamma_t) S_0 + sum_{j<=t} diag(Gamma_t / Gamma_j) k_j delta_j^T

and the deltas solve a unit lower-triangular system (the UT transform):

    (I + A) Delta = diag(beta) V - diag(beta) (Gamma * K) S_0,
    A_ij = beta_i sum_d k_id k_jd Gamma_id / Gamma_jd            (i > j)

so with T = (I + A)^-1, w = T (beta Gamma * K), u = T (beta V):

    Delta = u - w S_0                                   (the "new values")
    o_t   = scale [ (Gamma_t * q_t)^T S_0 + sum_{j<=t} (q_t . k_j Gamma_t/Gamma_j) Delta_j ]
    S_C   = diag(Gamma_C) S_0 + sum_j diag(Gamma_C / Gamma_j) k_j Delta_j^T

Without the delta term, Delta = V (no beta, no T).  Numerics shared with the
kernel: a scalar gate is clamped at -110 (exp(-110) is 0 in float32, so a
complete forget, g = -inf, stays exactly 0 and never makes -inf - -inf) and its
cumulative sum is taken in float64, so a huge |g| cannot cancel away the small
in-chunk differences.  Every decay exponent used is <= 0 when g <= 0.

The Triton kernel adds what a reference need not have: a vector gate runs with
C = 16 and factors Gamma_i/Gamma_j = Gamma_i * (1/Gamma_j) (safe only when the
chunk's total decay is <= 60 per key), the inverse T is built from 16x16 blocks,
and any chunk whose inputs or incoming state are not all finite and moderate is
run token by token with the oracle's own formulas (see `gdn.chunk_fwd`).  This
reference has no exact path: on non-finite inputs its NaN/Inf pattern is not
the oracle's.
"""
from __future__ import annotations

import torch

GATE_FLOOR = -110.0


class _RoundOperand(torch.autograd.Function):
    """x rounded to a matrix unit's operand dtype (bf16/fp16), kept in float32; the
    gradient is rounded the same way, as the backward's matrix products see it."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = dtype
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).to(grad.dtype), None


def _operand_rounding(dtype):
    if dtype is None or dtype == torch.float32:
        return lambda x: x
    return lambda x: _RoundOperand.apply(x, dtype)


def _chunk_scan(q, k, v, g, beta, S, scale, C, delta, operand_dtype=None):
    """One batch of equal-length sequences, [B, H, L, *] float32 each (g [B,H,L]
    or [B,H,L,K], beta [B,H,L]); S [B,H,K,V] float32.  Returns (o, S).
    With ``operand_dtype`` (bf16/fp16), every matrix product's operands are
    rounded to it and accumulate in float32, as on a GPU's matrix units."""
    r = _operand_rounding(operand_dtype)
    B, H, L, K = q.shape
    o = q.new_empty(B, H, L, v.shape[-1])
    vector_gate = g is not None and g.dim() == 4
    for c0 in range(0, L, C):
        c1 = min(c0 + C, L)
        qc, kc, vc = q[:, :, c0:c1], k[:, :, c0:c1], v[:, :, c0:c1]
        idx = torch.arange(c1 - c0, device=q.device)
        causal = idx[:, None] >= idx[None, :]
        if g is None:
            kk = kc @ kc.transpose(-1, -2)
            qk = qc @ kc.transpose(-1, -2)
            gq, gk, kG, gl = qc, kc, kc, 1.0
        else:
            G = torch.cumsum(g[:, :, c0:c1].clamp(min=GATE_FLOOR).double(), dim=2)
            Gl = G[:, :, -1:]
            if vector_gate:  # the exact decay tensor [B,H,n,n,K]
                diff = G[:, :, :, None, :] - G[:, :, None, :, :]
                dec = torch.exp(torch.where(causal[..., None], diff, -torch.inf).float())
                kk = torch.einsum("bhid,bhjd,bhijd->bhij", kc, kc, dec)
                qk = torch.einsum("bhid,bhjd,bhijd->bhij", qc, kc, dec)
                eG, eGl = torch.exp(G.float()), torch.exp((Gl - G).float())
                gl = torch.exp(Gl.float()).transpose(-1, -2)             # [B,H,K,1]
            else:
                diff = G[..., :, None] - G[..., None, :]
                dec = torch.exp(torch.where(causal, diff, -torch.inf).float())
                kk = (kc @ kc.transpose(-1, -2)) * dec
                qk = (qc @ kc.transpose(-1, -2)) * dec
                eG, eGl = torch.exp(G.float())[..., None], torch.exp((Gl - G).float())[..., None]
                gl = torch.exp(Gl.float())[..., None]                    # [B,H,1,1]
            gq, gk, kG = qc * eG, kc * eGl, kc * eG
        if delta:
            bc = beta[:, :, c0:c1, None]
            A = torch.tril(bc * kk, diagonal=-1)
            eye = torch.eye(c1 - c0, device=q.device, dtype=q.dtype)
            Tm = torch.linalg.solve_triangular(eye + A, eye.expand_as(A).contiguous(),
                                               upper=False, unitriangular=True)
            u, w = r(r(Tm) @ r(bc * vc)), r(r(Tm) @ r(bc * kG))
            vnew = u - w @ r(S)                                          # u - w S
        else:
            vnew = vc
        vnew = r(vnew)
        o[:, :, c0:c1] = scale * (r(gq) @ r(S) + r(torch.where(causal, qk, 0)) @ vnew)
        S = gl * S + r(gk).transpose(-1, -2) @ vnew
    return o, S


def chunked(q, k, v, g=None, beta=None, *, scale=None, initial_state=None,
            output_final_state=True, cu_seqlens=None, delta=True, chunk_size=64,
            operand_dtype=None):
    """The chunked forward in float32.  Takes bf16/fp16/fp32 inputs with the
    shapes of `gdn.oracle.recurrence`; returns (o in q's dtype, final_state
    float32 [N,H,K,V] or None).  ``operand_dtype`` rounds every matrix product's
    operands (see `_chunk_scan`): kfuzz's trusted implementation at a bf16 or
    fp16 kernel's own precision."""
    from gdn.oracle import _check, _sequences
    N = _check(q, k, v, g, beta, initial_state, cu_seqlens, delta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    f32 = torch.float32

    def heads_first(x, b0, b1, t0, t1):
        return None if x is None else x[b0:b1, t0:t1].transpose(1, 2).to(f32)

    o = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
    finals = []
    if cu_seqlens is None:
        spans = [(0, B, 0, T)]
    else:
        spans = [(0, 1, bos, eos) for _, bos, eos in _sequences(B, T, cu_seqlens)]
    for n0, (b0, b1, t0, t1) in enumerate(spans):
        nb = b1 - b0
        if initial_state is None:
            S = torch.zeros(nb, H, K, V, dtype=f32, device=q.device)
        else:
            S = initial_state[n0:n0 + nb].to(f32) if cu_seqlens is not None else \
                initial_state.to(f32)
        oc, S = _chunk_scan(*(heads_first(x, b0, b1, t0, t1) for x in (q, k, v, g, beta)),
                            S, scale, chunk_size, delta, operand_dtype)
        o[b0:b1, t0:t1] = oc.transpose(1, 2).to(q.dtype)
        finals.append(S)
    final = torch.cat(finals) if output_final_state else None
    return o, final
