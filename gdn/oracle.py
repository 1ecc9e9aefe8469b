"""The float64 step-by-step oracle of the GDN family: the definition of truth.

Per head and step t, in the key-by-value state layout (S is [K, V]):

    S_t = (I - beta_t k_t k_t^T) diag(a_t) S_{t-1} + beta_t k_t v_t^T   (delta=True)
    S_t = diag(a_t) S_{t-1} + k_t v_t^T                                   (delta=False)
    o_t = S_t^T (scale q_t),   a_t = exp(g_t)

with g absent (a_t = 1), a scalar per (b, t, h), or a vector over keys
(diag(a_t) scales the rows of S).  Every step is written with the same matrix
operations the Triton kernel's exact path uses, in this order:

    S = a * S                       (a scalar, or a[:, None] for a vector gate)
    bk = beta * k
    S = S - outer(bk, k @ S) + outer(bk, v)    (delta)   |   S = S + outer(k, v)
    o = (scale * q) @ S

(k @ S and (scale q) @ S are written as products summed over keys, so a
0 * Inf among them gives NaN exactly as the kernel's exact path does.)

so the NaN/Inf pattern of this function is the one kfuzz's G05 holds kernels
to.  It is differentiable by torch autograd (no in-place ops), which the
backward's gradient gate uses.  It refuses nothing but wrong shapes; it is slow
by design (one Python step per token).
"""
from __future__ import annotations

import torch


def _check(q, k, v, g, beta, initial_state, cu_seqlens, delta):
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k must be [B,T,H,K] and v [B,T,H,V]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, T, H, K = q.shape
    if g is not None and tuple(g.shape) not in ((B, T, H), (B, T, H, K)):
        raise ValueError(f"g must be [B,T,H] or [B,T,H,K]; got {tuple(g.shape)}")
    if delta and (beta is None or tuple(beta.shape) != (B, T, H)):
        raise ValueError("delta=True needs beta of shape [B,T,H]")
    if cu_seqlens is not None:
        cu = [int(x) for x in cu_seqlens.tolist()]
        if B != 1 or len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(
                a > b for a, b in zip(cu, cu[1:])):
            raise ValueError("cu_seqlens needs B == 1 and nondecreasing offsets from 0 to T")
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [{N},{H},{K},{v.shape[-1]}]; "
                         f"got {tuple(initial_state.shape)}")
    return N


def _sequences(B, T, cu_seqlens):
    """(batch index, first token, end token) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def recurrence(q, k, v, g=None, beta=None, *, scale=None, initial_state=None,
               output_final_state=True, cu_seqlens=None, delta=True):
    """Run the recurrence step by step in float64 (batched over the batch and the
    heads, which are independent); returns (o [B,T,H,V] float64, final_state
    [N,H,K,V] float64 or None)."""
    N = _check(q, k, v, g, beta, initial_state, cu_seqlens, delta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    f64 = torch.float64
    q, k, v = q.to(f64), k.to(f64), v.to(f64)
    g = None if g is None else g.to(f64)
    beta = None if beta is None else beta.to(f64)
    vector_gate = g is not None and g.dim() == 4
    if cu_seqlens is None:
        groups = [(slice(0, B), slice(0, N), 0, T)]
    else:
        groups = [(slice(0, 1), slice(n, n + 1), bos, eos)
                  for n, (_, bos, eos) in enumerate(_sequences(B, T, cu_seqlens))]
    o_steps, finals = [None] * T, []
    for bs, ns, bos, eos in groups:
        if initial_state is None:
            S = torch.zeros(bs.stop - bs.start, H, K, V, dtype=f64, device=q.device)
        else:
            S = initial_state[ns].to(f64)
        for t in range(bos, eos):
            if g is not None:
                a = torch.exp(g[bs, t])                       # [b,H] or [b,H,K]
                S = a[..., None] * S if vector_gate else a[..., None, None] * S
            kt = k[bs, t]                                     # [b,H,K]
            if delta:
                bk = beta[bs, t][..., None] * kt
                kS = (kt[..., None] * S).sum(-2)              # k @ S: [b,H,V]
                S = S - bk[..., :, None] * kS[..., None, :] + bk[..., :, None] * v[bs, t][..., None, :]
            else:
                S = S + kt[..., :, None] * v[bs, t][..., None, :]
            o_steps[t] = ((scale * q[bs, t])[..., None] * S).sum(-2)   # (scale q) @ S: [b,H,V]
        finals.append(S)
    if cu_seqlens is None:
        o = torch.stack(o_steps, 1) if T else v.new_zeros(B, 0, H, V)
    else:
        o = torch.cat(o_steps, 0)[None] if T else v.new_zeros(1, 0, H, V)
    final = torch.cat(finals) if output_final_state else None
    return o, final
