"""A fast float64 oracle of the GDN family: the chunked closed form where it is exact up to
float64 rounding, the step-by-step definition (``gdn.oracle.recurrence``) everywhere else.

The step-by-step oracle costs one Python step (a few small tensor ops) per token: about a
millisecond a token on a GPU, seconds for a T = 8192 backward. The closed form over chunks
of ``CHUNK`` tokens does the same math in a few matrix products per chunk. Per chunk,
with S_0 the state before it, G_t the running sum of the gates inside it and
Gamma_t = exp(G_t) (a vector over keys for a vector gate), the recurrence of
``gdn.oracle`` unrolls to

    delta_t = beta_t (v_t - S_0^T (Gamma_t k_t) - sum_{j<t} kk_tj delta_j)
    kk_tj   = sum_d k_td k_jd exp(G_td - G_jd)
    o_t     = scale [ S_0^T (Gamma_t q_t) + sum_{j<=t} qk_tj delta_j ],  qk_tj likewise with q_t
    S_C     = diag(Gamma_C) S_0 + sum_j diag(exp(G_C - G_j)) k_j delta_j^T

(without the delta rule, delta_t = v_t), the deltas from one unit lower-triangular solve.
Everything is float64, with no clamp, no operand rounding and no fast paths. The sums
G_i - G_j and G_C - G_j are formed so that autograd adds each gate's share once
(``_Between``, ``_After``), as the step-by-step gradients do.

Where it is used (``fast_path``): every input finite, gates GATE_MIN <= g <= 0, beta in
[0, 1], every key's L2 norm at most 1 (the targets' domain; then each step's transition has
norm at most 1, the triangular systems are well conditioned, and every exponent is <= 0; a
chunk's gate sums stay within CHUNK * -GATE_MIN = 1024, whose float64 rounding, about 1e-13,
leaves each decay exp(G_i - G_j) as exact as the step's exp(g), while a gate of -3.4e38 rounds
every later sum of its chunk to one float64 value, up to 4e22 off), and the result finite.
Anything else, injected special values and domain-breaking injections above all, goes to
the step-by-step definition, whose NaN/Inf pattern is the one kernels are held to.
Both agree to float64 rounding where both apply; ``tests/test_gdn_oracle_fast.py`` shows they
give the same verdicts on the kept GDN failures and on gate cases.
"""
from __future__ import annotations

import torch

from gdn.oracle import _check, _sequences, recurrence

CHUNK = 16
KEY_NORM_SLACK = 1e-6     # keys normalized in low precision may have a norm of 1 + a few ulps
GATE_MIN = -64.0          # gates below it go step by step (the module docstring)


@torch.no_grad()
def fast_path(q, k, v, g, beta, initial_state) -> bool:
    """Whether the closed form applies to these inputs (see the module docstring)."""
    for t in (q, k, v, g, beta, initial_state):
        if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return False
    if g is not None and bool(((g > 0) | (g < GATE_MIN)).any()):
        return False
    if beta is not None and bool(((beta < 0) | (beta > 1)).any()):
        return False
    return k.numel() == 0 or float(k.double().norm(dim=-1).max()) <= 1 + KEY_NORM_SLACK


class _Between(torch.autograd.Function):
    """The gate sums between two tokens of a chunk, G_i - G_j = sum_{j < r <= i} g_r for i >= j
    (0 above the diagonal; [.., n, n] or [.., n, n, K] from g [.., n] or [.., n, K]), whose
    gradient reaches each g_r from the pairs it lies between and no other:
    grad g_r = sum_{i >= r} sum_{j < r} grad_ij. Autograd through
    the difference of cumulative sums would add grad_ij to every g_r with r <= i and subtract it
    from every r <= j, so each pair's term enters twice with both signs and a gate gradient far
    smaller than those terms (a tiny initial state beside a large output gradient) is lost to
    their rounding."""

    @staticmethod
    def forward(ctx, g):
        G = torch.cumsum(g, dim=2)
        n = g.shape[2]
        idx = torch.arange(n, device=g.device)
        lower = (idx[:, None] >= idx[None, :]).reshape(n, n, *([1] * (g.dim() - 3)))
        return torch.where(lower, G[:, :, :, None] - G[:, :, None, :], 0.0)

    @staticmethod
    def backward(ctx, grad):
        n = grad.shape[2]
        # P[i, m] = sum_{j <= m} grad_ij; Q[i, r] = P[i, r - 1] (0 at r = 0)
        P = torch.cumsum(grad, dim=3)
        Q = torch.cat([torch.zeros_like(P[:, :, :, :1]), P[:, :, :, :-1]], dim=3)
        # R[i, r] = sum_{i' >= i} Q[i', r]; grad g_r = R[r, r]
        R = torch.flip(torch.cumsum(torch.flip(Q, [2]), dim=2), [2])
        idx = torch.arange(n, device=grad.device)
        return R[:, :, idx, idx]


class _After(torch.autograd.Function):
    """The gate sums after each token to the chunk's end, G_n - G_j = sum_{r > j} g_r ([.., n] or
    [.., n, K]), with grad g_r = sum_{j < r} grad_j: no term entering with both signs (as
    ``_Between``)."""

    @staticmethod
    def forward(ctx, g):
        G = torch.cumsum(g, dim=2)
        return G[:, :, -1:] - G

    @staticmethod
    def backward(ctx, grad):
        P = torch.cumsum(grad, dim=2)
        return torch.cat([torch.zeros_like(P[:, :, :1]), P[:, :, :-1]], dim=2)


def _chunks(q, k, v, g, beta, S, scale, delta):
    """One batch of equal-length sequences, heads first ([b, H, L, *] float64; g [b,H,L] or
    [b,H,L,K]); S [b,H,K,V]. Returns (o [b,H,L,V], S)."""
    L = q.shape[2]
    outs = []
    vector_gate = g is not None and g.dim() == 4
    for c0 in range(0, L, CHUNK):
        c1 = min(c0 + CHUNK, L)
        qc, kc, vc = q[:, :, c0:c1], k[:, :, c0:c1], v[:, :, c0:c1]
        n = c1 - c0
        idx = torch.arange(n, device=q.device)
        causal = idx[:, None] >= idx[None, :]
        if g is None:
            kk, qk = kc @ kc.transpose(-1, -2), qc @ kc.transpose(-1, -2)
            gq, gk, kG, last = qc, kc, kc, None
        elif vector_gate:
            gc = g[:, :, c0:c1]
            G = torch.cumsum(gc, dim=2)                                     # [b,H,n,K]
            dec = torch.exp(torch.where(causal[..., None], _Between.apply(gc), -torch.inf))
            kk = torch.einsum("bhid,bhjd,bhijd->bhij", kc, kc, dec)
            qk = torch.einsum("bhid,bhjd,bhijd->bhij", qc, kc, dec)
            Gl = G[:, :, -1:]
            gq, kG = qc * torch.exp(G), kc * torch.exp(G)
            gk = kc * torch.exp(_After.apply(gc))
            last = torch.exp(Gl).transpose(-1, -2)                            # [b,H,K,1]
        else:
            gc = g[:, :, c0:c1]
            G = torch.cumsum(gc, dim=2)                                     # [b,H,n]
            dec = torch.exp(torch.where(causal, _Between.apply(gc), -torch.inf))
            kk, qk = (kc @ kc.transpose(-1, -2)) * dec, (qc @ kc.transpose(-1, -2)) * dec
            Gl = G[:, :, -1:]
            gq, kG = qc * torch.exp(G)[..., None], kc * torch.exp(G)[..., None]
            gk = kc * torch.exp(_After.apply(gc))[..., None]
            last = torch.exp(Gl)[..., None]                                  # [b,H,1,1]
        if delta:
            bc = beta[:, :, c0:c1, None]
            eye = torch.eye(n, dtype=q.dtype, device=q.device)
            A = eye + torch.tril(bc * kk, diagonal=-1)
            rhs = bc * vc - (bc * kG) @ S
            dl = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        else:
            dl = vc
        outs.append(scale * (gq @ S + torch.where(causal, qk, 0.0) @ dl))
        S = (S if last is None else last * S) + gk.transpose(-1, -2) @ dl
    o = torch.cat(outs, dim=2) if outs else v.new_zeros(*v.shape[:2], 0, v.shape[-1])
    return o, S


def closed_form(q, k, v, g=None, beta=None, *, scale=None, initial_state=None,
                output_final_state=True, cu_seqlens=None, delta=True):
    """The chunked closed form in float64 (no check of where it applies): (o [B,T,H,V],
    final state [N,H,K,V]), both float64, as ``recurrence`` returns them."""
    N = _check(q, k, v, g, beta, initial_state, cu_seqlens, delta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    f64 = torch.float64

    def heads_first(x, b0, b1, t0, t1):
        return None if x is None else x[b0:b1, t0:t1].transpose(1, 2).to(f64)

    spans = [(0, B, 0, T)] if cu_seqlens is None else [(0, 1, bos, eos) for _, bos, eos in _sequences(B, T, cu_seqlens)]
    pieces, finals = [], []
    for n0, (b0, b1, t0, t1) in enumerate(spans):
        nb = b1 - b0
        if initial_state is None:
            S = torch.zeros(nb, H, K, V, dtype=f64, device=q.device)
        else:
            S = (initial_state[n0:n0 + nb] if cu_seqlens is not None else initial_state).to(f64)
        oc, S = _chunks(*(heads_first(x, b0, b1, t0, t1) for x in (q, k, v, g, beta)), S, scale, delta)
        pieces.append(oc.transpose(1, 2))
        finals.append(S)
    o = torch.cat(pieces, dim=1) if cu_seqlens is not None else pieces[0]
    return o, (torch.cat(finals) if output_final_state else None)


def fast_recurrence(q, k, v, g=None, beta=None, *, scale=None, initial_state=None,
                    output_final_state=True, cu_seqlens=None, delta=True):
    """``gdn.oracle.recurrence``'s result: by the closed form where it applies and its
    result is finite, else step by step."""
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens, delta=delta)
    if fast_path(q, k, v, g, beta, initial_state):
        o, final = closed_form(q, k, v, g, beta, **kw)
        if bool(torch.isfinite(o).all()) and (final is None or bool(torch.isfinite(final).all())):
            return o, final
    return recurrence(q, k, v, g, beta, **kw)
