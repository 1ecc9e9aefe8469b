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
run token by token with the oracle's own formulas (see `gdn.chunk_fwd`).

Special values.  This reference, the trusted implementation of kfuzz's GDN
targets, carries a NaN or Inf to the tokens the recurrence carries it to, and
no others: every in-chunk mask selects before a product (a lower-triangular
product sums row i over rows j <= i alone, `_CausalProduct`, and so do the
products of its gradient), the inverse T is formed row by row where A is not
finite, a non-finite gate reaches only the decays that span it, and a
non-finite gradient of a decay only the gates it spans (`_PairSums`: the
gradient of G_i - G_j is not NaN - NaN at the gates before token j).  On finite inputs every one of these is the plain product.  So
its outputs have the oracle's NaN/Inf sets (where no intermediate overflows
fp32), and a kernel that spreads a NaN to earlier tokens of its chunk finds no
excuse in it.
"""
from __future__ import annotations

import torch

GATE_FLOOR = -110.0


# (significand bits, smallest normal exponent) of the operand dtypes stochastic rounding takes
_FORMATS = {torch.bfloat16: (8, -126), torch.float16: (11, -14), torch.float32: (24, -126)}


def round_to(x, dtype, gen=None):
    """x rounded to ``dtype`` (bf16/fp16/fp32), kept in x's dtype: to nearest even, or with
    ``gen`` (a CPU ``torch.Generator``) stochastically, to one of the two neighbours that
    bracket x with a chance proportional to its nearness (unbiased: E[round(x)] = x).  An x
    already in ``dtype`` (an fp32 operand of the fp32 variants) is the rounding of a value
    anywhere within half a unit of it: it is moved there at random, then rounded so.  Zeros,
    NaN, Inf and a rounding past the dtype's largest value round to nearest."""
    nearest = x.to(dtype).to(x.dtype)
    if gen is None or dtype not in _FORMATS:
        return nearest
    bits, emin = _FORMATS[dtype]
    xd = x.double()

    def unit(y):
        _, e = torch.frexp(y)
        return torch.ldexp(torch.ones_like(y), (e - 1).clamp(min=emin) - bits + 1)
    if dtype == x.dtype:
        move = torch.rand(x.shape, generator=gen, dtype=torch.float64).to(x.device) - 0.5
        xd = torch.where(xd != 0, xd + move * unit(xd), xd)
    ulp = unit(xd)
    lo = torch.floor(xd / ulp) * ulp
    draw = torch.rand(x.shape, generator=gen, dtype=torch.float64).to(x.device)
    up = torch.where(draw < (xd - lo) / ulp, lo + ulp, lo)
    keep = torch.isfinite(xd) & (xd != 0) & (up.abs() <= torch.finfo(dtype).max)
    return torch.where(keep, up, nearest.double()).to(x.dtype)


class _RoundOperand(torch.autograd.Function):
    """x rounded to a matrix unit's operand dtype (bf16/fp16), kept in float32; the
    gradient is rounded the same way, as the backward's matrix products see it (``gen``:
    stochastic rounding, `round_to`)."""

    @staticmethod
    def forward(ctx, x, dtype, gen):
        ctx.dtype, ctx.gen = dtype, gen
        return round_to(x, dtype, gen)

    @staticmethod
    def backward(ctx, grad):
        return round_to(grad, ctx.dtype, ctx.gen), None, None


class _RoundGradient(torch.autograd.Function):
    """x unchanged; its gradient rounded to ``dtype`` (``gen``: stochastic, `round_to`), kept
    where that rounding would overflow: the state gradient as a bf16 kernel's products of a
    chunk's state update take it (k dS and dS v^T, the fp32 state gradient entering them as a
    bf16 operand), while the gradient handed on to the chunk before, through the state's
    decay, stays float32."""

    @staticmethod
    def forward(ctx, x, dtype, gen):
        ctx.dtype, ctx.gen = dtype, gen
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        rounded = round_to(grad, ctx.dtype, ctx.gen)
        return torch.where(torch.isinf(rounded) & ~torch.isinf(grad), grad, rounded), None, None


class _DecayStored(torch.autograd.Function):
    """gl * S, a chunk's decay of the state entering it (gl [B,H,1,1], or [B,H,K,1] for a vector
    gate), in float32; the gate's gradient through it, sum(dS_end * S) (its "through" term), is
    formed from S rounded to ``dtype``, the state as it is stored between launches (bf16 for
    bf16 inputs: `gdn.common.handoff_dtype`, as fla's chunk states) and read back by the
    backward for that term, while the product keeps the float32 S that the recurrence carries.
    Where the rounding would overflow (|S| above bf16's largest finite value) S stays as it is.
    The state's own gradient is dS_end * gl, as for the plain product."""

    @staticmethod
    def forward(ctx, gl, S, dtype, gen):
        Sr = round_to(S, dtype, gen)
        ctx.save_for_backward(gl, torch.where(torch.isinf(Sr) & ~torch.isinf(S), S, Sr))
        return gl * S

    @staticmethod
    def backward(ctx, grad):
        gl, Sr = ctx.saved_tensors
        return (grad * Sr).sum_to_size(gl.shape), grad * gl, None, None


def _state_decay(dtype, gen):
    """The decay gl * S of a chunk's entering state, with the gate's gradient of a state stored
    in ``dtype`` (`_DecayStored`) for bf16, a plain product otherwise (fp16 and fp32 states are
    handed on in float32)."""
    if dtype != torch.bfloat16:
        return lambda gl, S: gl * S
    return lambda gl, S: _DecayStored.apply(gl, S, dtype, gen)


def _state_gradient(dtype, gen):
    """The state gradient as the state update's products take it: rounded to bf16 for bf16
    (`_RoundGradient`), as it is (fp16 and fp32 kernels form those products in fp32)."""
    if dtype != torch.bfloat16:
        return lambda x: x
    return lambda x: _RoundGradient.apply(x, dtype, gen)


def _operand_rounding(dtype, gen):
    if dtype is None or (dtype == torch.float32 and gen is None):
        return lambda x: x
    return lambda x: _RoundOperand.apply(x, dtype, gen)


def _masked_mm(L, X, mask):
    """L X summing, for row i, over the rows j of X where mask[i, j] alone: a plain product
    where X is finite, else the sum over a masked [.., n, n, d] copy of X (a NaN or Inf in a
    row outside the mask never meets one of L's zeros: 0 * NaN is NaN)."""
    L = torch.where(mask, L, 0.)
    if bool(torch.isfinite(X).all()):
        return L @ X
    return torch.einsum("...ij,...ijd->...id", L, torch.where(mask[..., None], X.unsqueeze(-3), 0.))


class _CausalProduct(torch.autograd.Function):
    """L X for a chunk's lower-triangular L ([.., n, n]; ``causal`` its mask, the diagonal
    included): row i of the result sums over the rows j <= i of X alone, as the recurrence
    reaches token i, and the gradient of X's row j over the rows i >= j of the output's
    gradient alone, as autograd through the recurrence carries it back.  So a NaN or Inf in
    one token reaches the tokens the recurrence takes it to, and no others."""

    @staticmethod
    def forward(ctx, L, X, causal):
        ctx.save_for_backward(L, X, causal)
        return _masked_mm(L, X, causal)

    @staticmethod
    def backward(ctx, grad):
        L, X, causal = ctx.saved_tensors
        dL = torch.where(causal, grad @ X.transpose(-1, -2), 0.)   # entry (i, j): rows i, j alone
        dX = _masked_mm(L.transpose(-1, -2), grad, causal.transpose(-1, -2))
        return dL, dX, None


class _MaskedGram(torch.autograd.Function):
    """A B^T where ``mask`` (entry (i, j) from row i of A and row j of B alone), 0 elsewhere;
    its gradients sum over the entries in the mask alone, so a NaN or Inf in a row of A or B
    never meets a zero gradient of an entry outside it."""

    @staticmethod
    def forward(ctx, A, B, mask):
        ctx.save_for_backward(A, B, mask)
        return torch.where(mask, A @ B.transpose(-1, -2), 0.)

    @staticmethod
    def backward(ctx, grad):
        A, B, mask = ctx.saved_tensors
        return (_masked_mm(grad, B, mask), _masked_mm(grad.transpose(-1, -2), A, mask.transpose(-1, -2)),
                None)


class _UnitLowerInverse(torch.autograd.Function):
    """(I + A)^-1 for a chunk's strictly lower A ([.., n, n]; ``causal`` the lower mask, the
    diagonal included) by forward substitution, row i from rows j < i alone; its gradient
    dA = -strict_lower(T^T dT T^T) by products over the triangles alone."""

    @staticmethod
    def forward(ctx, A, causal):
        n = A.shape[-1]
        eye = torch.eye(n, device=A.device, dtype=A.dtype)
        if bool(torch.isfinite(A).all()):
            T = torch.linalg.solve_triangular(eye + A, eye.expand_as(A).contiguous(), upper=False,
                                              unitriangular=True)
        else:   # T[i, j] = delta_ij - sum_{j <= m < i} A[i, m] T[m, j]: no 0 * NaN of A's row i
            T = eye.expand_as(A).clone()
            for i in range(1, n):
                terms = torch.where(causal[:i], A[..., i, :i, None] * T[..., :i, :], 0.)
                T[..., i, :] = T[..., i, :] - terms.sum(-2)
        ctx.save_for_backward(T, causal)
        return T

    @staticmethod
    def backward(ctx, dT):
        T, causal = ctx.saved_tensors
        up = causal.transpose(-1, -2)
        m1 = _masked_mm(T.transpose(-1, -2), torch.where(causal, dT, 0.), up)     # T^T dT
        m2 = _masked_mm(T, m1.transpose(-1, -2), causal).transpose(-1, -2)       # (T^T dT) T^T
        strict = causal & ~torch.eye(T.shape[-1], dtype=torch.bool, device=T.device)
        return torch.where(strict, -m2, 0.), None


def _causal_mm(L, X, causal):
    return _CausalProduct.apply(L, X, causal)


def _masked_decayed_gram(A, B, dec, mask):
    """sum_d A[i, d] B[j, d] dec[i, j, d] where ``mask``, 0 elsewhere (the vector gate's pair
    products), the operands selected before their products (so their gradients too)."""
    m = mask[..., None]
    return (torch.where(m, A.unsqueeze(-2), 0.) * torch.where(m, B.unsqueeze(-3), 0.)
            * torch.where(m, dec, 0.)).sum(-1)


class _PairSums(torch.autograd.Function):
    """D[i, j] = sum_{j < m <= i} g_m for i > j, 0 elsewhere ([B,H,n,n(,K)] from gc [B,H,n(,K)]),
    the decay from token j's update to token i.  Forward: G_i - G_j where every gate is finite,
    else each D[i, j] from its own gates, so a NaN or Inf gate at token m reaches the pairs that
    span it alone (G_i - G_j is NaN - NaN there).  Backward: the gradient of g_m sums the pairs
    (i, j) with j < m <= i alone, by an exclusive running sum over j (no NaN of a pair that does
    not span m meets the zero of G_i - G_j's cancellation: NaN - NaN is NaN, not 0)."""

    @staticmethod
    def forward(ctx, gc):
        n = gc.shape[2]
        idx = torch.arange(n, device=gc.device)
        lower = (idx[:, None] > idx[None, :]).reshape(n, n, *([1] * (gc.dim() - 3)))
        ctx.save_for_backward(lower)
        if bool(torch.isfinite(gc).all()):
            G = torch.cumsum(gc, dim=2)
            return torch.where(lower, G[:, :, :, None] - G[:, :, None, :], 0.)
        D = torch.zeros(*gc.shape[:2], n, n, *gc.shape[3:], dtype=gc.dtype, device=gc.device)
        for i in range(n):   # D[i, j] for j < i: the sums of g_{j+1..i}, in reverse
            D[:, :, i, :i] = torch.flip(torch.cumsum(torch.flip(gc[:, :, 1:i + 1], [2]), dim=2), [2])
        return D

    @staticmethod
    def backward(ctx, dD):
        (lower,) = ctx.saved_tensors
        run = torch.cumsum(torch.where(lower, dD, 0.), dim=3)                  # sum_{j <= m}
        before = torch.cat([torch.zeros_like(run[:, :, :, :1]), run[:, :, :, :-1]], dim=3)  # j < m
        return torch.where(~lower.transpose(0, 1), before, 0.).sum(2)                 # i >= m


def _gate_sums(gc):
    """A chunk's gate sums (clamped, float64; gc [B,H,n] or [B,H,n,K]): G_i = sum_{m <= i} g_m
    and D[i, j] = sum_{j < m <= i} g_m for i >= j ([B,H,n,n(,K)]; the decay from token j's
    update to token i; `_PairSums`)."""
    return torch.cumsum(gc, dim=2), _PairSums.apply(gc)


def _chunk_scan(q, k, v, g, beta, S, scale, C, delta, operand_dtype=None, gen=None, decay_values=False):
    """One batch of equal-length sequences, [B, H, L, *] float32 each (g [B,H,L]
    or [B,H,L,K], beta [B,H,L]); S [B,H,K,V] float32.  Returns (o, S).
    With ``operand_dtype`` (bf16/fp16), every matrix product's operands are
    rounded to it and accumulate in float32, as on a GPU's matrix units; for bf16 the
    state update's products also take the state gradient rounded to bf16 (`_RoundGradient`),
    and the gate's gradient through a chunk's decay of its entering state sees that state as
    stored in bf16 (`_DecayStored`); ``gen``: those roundings stochastic (`round_to`).
    ``decay_values``: a scalar gate's in-chunk decay exp(G_C - G_t) of the state update goes
    on the values (v_new) rather than on the keys before their product is rounded: the other
    honest placement (the rounded operand is then v_new's, not the decayed key's)."""
    r, decay = _operand_rounding(operand_dtype, gen), _state_decay(operand_dtype, gen)
    rg = _state_gradient(operand_dtype, gen)
    B, H, L, K = q.shape
    o = q.new_empty(B, H, L, v.shape[-1])
    vector_gate = g is not None and g.dim() == 4
    for c0 in range(0, L, C):
        c1 = min(c0 + C, L)
        qc, kc, vc = q[:, :, c0:c1], k[:, :, c0:c1], v[:, :, c0:c1]
        idx = torch.arange(c1 - c0, device=q.device)
        causal = idx[:, None] >= idx[None, :]
        if g is None:
            kk = _MaskedGram.apply(kc, kc, causal)
            qk = _MaskedGram.apply(qc, kc, causal)
            gq, gk, kG, gl = qc, kc, kc, 1.0
        else:
            G, diff = _gate_sums(g[:, :, c0:c1].clamp(min=GATE_FLOOR).double())
            Gl = G[:, :, -1:]
            Gend = diff[:, :, -1]                                        # G_C - G_j
            if vector_gate:  # the exact decay tensor [B,H,n,n,K]
                dec = torch.exp(torch.where(causal[..., None], diff, -torch.inf).float())
                kk = _masked_decayed_gram(kc, kc, dec, causal)
                qk = _masked_decayed_gram(qc, kc, dec, causal)
                eG, eGl = torch.exp(G.float()), torch.exp(Gend.float())
                gl = torch.exp(Gl.float()).transpose(-1, -2)             # [B,H,K,1]
            else:
                dec = torch.exp(torch.where(causal, diff, -torch.inf).float())
                kk = _MaskedGram.apply(kc, kc, causal) * dec
                qk = _MaskedGram.apply(qc, kc, causal) * dec
                eG, eGl = torch.exp(G.float())[..., None], torch.exp(Gend.float())[..., None]
                gl = torch.exp(Gl.float())[..., None]                    # [B,H,1,1]
            gq, gk, kG = qc * eG, kc * eGl, kc * eG
        if delta:
            bc = beta[:, :, c0:c1, None]
            A = torch.tril(bc * kk, diagonal=-1)
            Tm = _UnitLowerInverse.apply(A, causal)
            u, w = r(_causal_mm(r(Tm), r(bc * vc), causal)), r(_causal_mm(r(Tm), r(bc * kG), causal))
            vnew = u - w @ r(S)                                          # u - w S
        else:
            vnew = vc
        vnew = r(vnew)
        o[:, :, c0:c1] = scale * (r(gq) @ r(S) + _causal_mm(r(qk), vnew, causal))
        if decay_values and g is not None and not vector_gate:
            update = r(kc).transpose(-1, -2) @ r(vnew * eGl)
        else:
            update = r(gk).transpose(-1, -2) @ vnew
        S = (S if g is None else decay(gl, S)) + rg(update)
    return o, S


def chunked(q, k, v, g=None, beta=None, *, scale=None, initial_state=None,
            output_final_state=True, cu_seqlens=None, delta=True, chunk_size=64,
            operand_dtype=None, rounding_seed=None):
    """The chunked forward in float32.  Takes bf16/fp16/fp32 inputs with the
    shapes of `gdn.oracle.recurrence`; returns (o in q's dtype, final_state
    float32 [N,H,K,V] or None).  ``operand_dtype`` rounds every matrix product's
    operands (see `_chunk_scan`): kfuzz's trusted implementation at a bf16 or
    fp16 kernel's own precision; ``rounding_seed`` makes those roundings stochastic
    (`round_to`), another honest realization of the same precision; at fp32 every product
    operand is then moved within its rounding's half unit and rounded stochastically (the
    arithmetic stays float32), so that an output of one or two elements, where the chunked
    form cancels terms far larger than the answer, is not judged by the luck of one set of
    roundings to nearest.  An odd ``rounding_seed`` also puts a scalar gate's in-chunk decay of
    the state update on the values instead of the keys (`_chunk_scan`'s ``decay_values``): a
    kernel may round either decayed operand, and one of them can land on its dtype's grid by
    luck (a key of 65504 decayed to 352.7515, which fp16 holds to 0.0015)."""
    from gdn.oracle import _check, _sequences
    N = _check(q, k, v, g, beta, initial_state, cu_seqlens, delta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    f32 = torch.float32
    gen = None if rounding_seed is None else torch.Generator().manual_seed(rounding_seed)

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
                            S, scale, chunk_size, delta, operand_dtype, gen,
                            decay_values=rounding_seed is not None and rounding_seed % 2 == 1)
        o[b0:b1, t0:t1] = oc.transpose(1, 2).to(q.dtype)
        finals.append(S)
    final = torch.cat(finals) if output_final_state else None
    return o, final
