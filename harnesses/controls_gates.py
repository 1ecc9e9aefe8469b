"""Positive controls for the twelve gates: one planted bug per gate, each a variant of an
operator target whose correct kernel passes all twelve, and each built so that only its
gate's property can see it (``tools/gate_matrix.py`` checks that and writes reports/gate_matrix.md).

| variant | gate | the bug |
| --- | --- | --- |
| layernorm.hotpath | G01 | an inference fast path for the tuned (nominal) shape skips the normalization of rows that already look standardized, as randn rows do (when the affine parameters look sane) |
| softmax.clamp10 | G02 | clamps finite inputs to [-10, 10] before exp, which randn never exceeds |
| rowsum.droptail (rowsum.py) | G03 | drops the tail when D is not a multiple of the block |
| matmul.contig | G04 | reads its inputs' storage as if contiguous (transposed and strided inputs come out wrong) |
| layernorm.nan2zero (layernorm.py) | G05 | nan_to_num on the output |
| layernorm.onepass | G06 | one-pass fp32 variance without row scaling: near the largest magnitudes E[x^2] - E[x]^2 is inf - inf |
| cumsum.lowcarry | G07 | fp32 totals within blocks of 8, but the carry between blocks kept in the input dtype |
| rowsum.shuffled | G08 | sums in a random order each call (as atomics do) |
| rowsum.alias | G09 | for D = 1 returns a view of its input instead of a new tensor |
| rowsum.zeroassumed | G10 | accumulates into a fresh torch.empty workspace, assuming it is zeroed |
| matmul.ptrcache | G11 | caches results by input pointer, shape and strides |
| rmsnorm.badgrad | G12 | right forward, backward without the term through the mean of squares |
| causal_product.maskmul | G05 | applies the causal mask by multiplying after the product (a NaN at a later position reaches earlier outputs) |
| decay_scan.cumdiff | G05 | chunk decays as differences of cumulative log-gates (a -inf gate makes -inf - (-inf) = NaN across its chunk) |
| rmsnorm.pairs | G10 | rows in pairs: the last row of an odd count is never written |
| matmul.firstcache | G11 | returns its last result again for inputs of the same shapes and first elements |

``causal_product`` and ``decay_scan`` are targets of their own, defined here with their correct
kernels: a causal product whose mask selects before the sum, and a chunked decayed scan whose
decays are sums of the gates they span (kfuzz's G05 controls need a sequence and a log-space gate).
"""
import random
from collections import OrderedDict

import torch

import harnesses.cumsum  # noqa: F401  (registers the bases the variants extend)
import harnesses.matmul  # noqa: F401
from harnesses.layernorm import EPS as LN_EPS, layernorm
from harnesses.rmsnorm import EPS as RMS_EPS, rmsnorm
from harnesses.rowsum import rowsum
from harnesses.softmax import softmax_math
from kfuzz.gates.base import nominal_dims
from kfuzz.target import Arg, Dim, Output, target, variant


# G01 -----------------------------------------------------------------------------------------
def layernorm_hotpath(x, weight, bias):
    # the variant has layernorm's contract; looked up at import, not in the call (a worker that
    # loaded only this module would import every harness during the call)
    tuned = dict(zip(("N", "D"), x.shape)) == nominal_dims(HOTPATH)
    inference = not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, bias)))
    sane = all(bool((t.float().abs() < 1e4).all()) for t in (weight, bias))
    fast = tuned and inference and sane and all(t.is_contiguous() and t.storage_offset() == 0
                                                for t in (x, weight, bias))
    out = layernorm(x, weight, bias)
    if not fast:
        return out
    xf = x.float()
    mean, var = xf.mean(-1, keepdim=True), xf.var(-1, keepdim=True, unbiased=False)
    standard = (mean.abs() < 0.5) & (var > 0.5) & (var < 2.0)
    identity = (xf * weight.float() + bias.float()).to(x.dtype)
    return torch.where(standard, identity, out)


HOTPATH = variant("layernorm", "layernorm.hotpath", layernorm_hotpath,
        planted_bug="tuned-shape fast path treats rows that look standardized as already normalized")


# G02 -----------------------------------------------------------------------------------------
def softmax_clamp10(x):
    xf = x.float()
    xf = torch.where(torch.isfinite(xf), xf.clamp(-10.0, 10.0), xf)
    return softmax_math(xf).to(x.dtype)


variant("softmax", "softmax.clamp10", softmax_clamp10,
        planted_bug="clamps finite inputs to [-10, 10]: right on randn, wrong on scaled or heavy-tailed rows")


# G04 -----------------------------------------------------------------------------------------
def _as_if_contiguous(t):
    return t.as_strided(t.shape, torch.empty(t.shape, device="meta").stride())


def matmul_contig(a, b):
    return torch.matmul(_as_if_contiguous(a), _as_if_contiguous(b))


variant("matmul", "matmul.contig", matmul_contig,
        planted_bug="reads its inputs' storage as if contiguous: transposed and strided inputs go wrong")


# G06 -----------------------------------------------------------------------------------------
def layernorm_onepass(x, weight, bias):
    xf = x.float()
    mean = xf.mean(dim=-1, keepdim=True)
    k = xf[..., :1]     # the shifted-data one-pass formula: exact enough at any offset, not at any scale
    d = xf - k
    var = ((d * d).mean(dim=-1, keepdim=True) - (mean - k) ** 2).clamp(min=0)
    return ((xf - mean) * torch.rsqrt(var + LN_EPS) * weight.float() + bias.float()).to(x.dtype)


variant("layernorm", "layernorm.onepass", layernorm_onepass,
        planted_bug="one-pass fp32 variance E[x^2] - E[x]^2 without row scaling: inf - inf near the largest magnitudes")


# G07 -----------------------------------------------------------------------------------------
def cumsum_lowcarry(x, block=8):
    xf = x.float()
    d = xf.shape[-1]
    pad = (-d) % block
    blocks = torch.nn.functional.pad(xf, (0, pad)).reshape(*xf.shape[:-1], -1, block)
    inner = blocks.cumsum(-1)
    carry = torch.zeros(xf.shape[:-1] + (1,), dtype=x.dtype)
    outs = []
    for j in range(blocks.shape[-2]):
        outs.append(inner[..., j, :] + carry.float())
        carry = (carry.float() + inner[..., j, -1:]).to(x.dtype)   # the carry rounds to the input dtype
    return torch.cat(outs, -1)[..., :d].to(x.dtype)


variant("cumsum", "cumsum.lowcarry", cumsum_lowcarry,
        planted_bug="carry between blocks kept in the input dtype: long fp16/bf16 totals lose low bits")


# G08 -----------------------------------------------------------------------------------------
_order = random.Random()   # unseeded on purpose: a different order every call


def rowsum_shuffled(x):
    perm = torch.tensor(_order.sample(range(x.shape[-1]), x.shape[-1]), dtype=torch.long)
    return x.float()[:, perm].sum(-1).to(x.dtype)


variant("rowsum", "rowsum.shuffled", rowsum_shuffled,
        planted_bug="sums in a different order every call (as atomic adds do): not bitwise reproducible")


# G09 -----------------------------------------------------------------------------------------
def rowsum_alias(x):
    if x.shape[-1] == 1:
        return x[:, 0]
    return rowsum(x)


variant("rowsum", "rowsum.alias", rowsum_alias,
        planted_bug="for D = 1 returns a view of its input (the output aliases the input)")


# G10 -----------------------------------------------------------------------------------------
WORKSPACE = 10 << 20    # 40 MiB of fp32: above glibc's largest mmap threshold, so fresh pages are zero


def rowsum_zeroassumed(x):
    n, d = x.shape
    ws = torch.empty(WORKSPACE + n, dtype=torch.float32, device=x.device)
    acc = ws[:n]
    for start in range(0, d, 64):
        acc += x[:, start:start + 64].float().sum(-1)
    return acc.to(x.dtype).clone()


variant("rowsum", "rowsum.zeroassumed", rowsum_zeroassumed,
        planted_bug="accumulates into a fresh torch.empty workspace, assuming the memory is zeroed")


# G11 -----------------------------------------------------------------------------------------
_cache: "OrderedDict[tuple, tuple]" = OrderedDict()


def matmul_ptrcache(a, b):
    key = tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in (a, b))
    if key not in _cache:
        # the inputs stay referenced, so their addresses cannot be reused while cached
        _cache[key] = (a, b, torch.matmul(a, b))
        if len(_cache) > 16:
            _cache.popitem(last=False)
    return _cache[key][2].clone()


variant("matmul", "matmul.ptrcache", matmul_ptrcache,
        planted_bug="caches results by input pointer: new values in the same buffers get the old result")


# G10: a tail row never written ------------------------------------------------------------------
def rmsnorm_pairs(x, weight):
    out = torch.empty_like(x)
    even = x.shape[0] - x.shape[0] % 2      # rows in pairs; the last row of an odd count is never written
    out[:even] = rmsnorm(x[:even], weight)
    return out


variant("rmsnorm", "rmsnorm.pairs", rmsnorm_pairs,
        planted_bug="normalizes rows in pairs: when the row count is odd the last row is never written")


# G11: a result cached by shape and one element ---------------------------------------------------
_last: dict = {}


def matmul_firstcache(a, b):
    inference = not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))
    key = (tuple(a.shape), tuple(b.shape), a.dtype, a.reshape(-1)[0].item(), b.reshape(-1)[0].item())
    if inference and _last.get("key") == key:
        return _last["out"].clone()
    out = torch.matmul(a, b)
    if inference:
        _last.update(key=key, out=out.clone())
    return out


variant("matmul", "matmul.firstcache", matmul_firstcache,
        planted_bug="returns its last result again when the shapes and the first elements of its inputs match")


# G12 -----------------------------------------------------------------------------------------
class _RMSNormBadGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return rmsnorm(x, weight)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        xf, gf = x.float(), g.float()
        r = torch.rsqrt((xf * xf).mean(-1, keepdim=True) + RMS_EPS)
        dx = gf * weight.float() * r            # missing: - x * r^3 * mean(g * w * x)
        dw = (gf * xf * r).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype)


variant("rmsnorm", "rmsnorm.badgrad", lambda x, weight: _RMSNormBadGrad.apply(x, weight),
        planted_bug="backward drops the term through the mean of squares (forward is right)")


# G05: causal products --------------------------------------------------------------------------
# o_t = sum over s <= t of (q_t . k_s) v_s. The oracle forms each term and keeps the causal ones by
# selection, so a NaN or Inf at position s reaches outputs t >= s only.
def causal_math(q, k, v):
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    terms = (q @ k.transpose(-1, -2))[..., None] * v[..., None, :, :]      # [N, t, s, E]
    return torch.where(causal[..., None], terms, torch.zeros((), dtype=terms.dtype)).sum(-2)


def _row_scaled(q):
    """q divided by each row's largest finite magnitude, and that scale: scores of rows near the
    largest magnitudes stay finite (the scale multiplies once at the end; the product is linear
    in q, so the scale is a constant to autograd)."""
    s = torch.where(torch.isfinite(q), q.abs(), torch.zeros((), dtype=q.dtype)).amax(-1, keepdim=True)
    s = torch.where(s > 0, s, torch.ones((), dtype=s.dtype)).detach()
    return q / s, s


@target("causal_product", reference=causal_math,
        args={"q": Arg(("N", "T", "D")), "k": Arg(("N", "T", "D")), "v": Arg(("N", "T", "E"))},
        outputs={"out": Output(("N", "T", "E"))},
        dims={"N": Dim(1, 8), "T": Dim(1, 128), "D": Dim(1, 64), "E": Dim(1, 64)},
        options={"nominal": {"N": 2, "T": 16, "D": 16, "E": 16}},
        description="causal product o_t = sum_{s<=t} (q_t . k_s) v_s of [N, T, D] and [N, T, E], torch, "
                    "fp32 with rows of q scaled, the mask applied by selection before the sum")
def causal_product(q, k, v):
    qs, s = _row_scaled(q.float())
    return (causal_math(qs, k.float(), v.float()) * s).to(q.dtype)


def causal_maskmul(q, k, v):
    t = q.shape[-2]
    mask = torch.ones(t, t, device=q.device).tril()
    qs, s = _row_scaled(q.float())
    return ((((qs @ k.float().transpose(-1, -2)) * mask) @ v.float()) * s).to(q.dtype)


variant("causal_product", "causal_product.maskmul", causal_maskmul,
        planted_bug="applies the causal mask by multiplying the scores by 0/1 and then a matrix product: "
                    "a NaN or Inf at a later position reaches earlier outputs (0 * NaN = NaN)")


# G05: chunked decays --------------------------------------------------------------------------
# y_t = exp(g_t) y_{t-1} + x_t along T, with g a log-space gate (g = -softplus(u) <= 0, so g = -inf is
# a complete forget and the true answer stays finite).
CHUNK = 8


def decay_math(x, g):
    ys, y = [], torch.zeros_like(x[..., 0])
    for t in range(x.shape[-1]):
        y = torch.exp(g[..., t]) * y + x[..., t]
        ys.append(y)
    return torch.stack(ys, -1)


def decay_domain(values, dims):
    return {**values, "g": -torch.nn.functional.softplus(values["g"])}


def _chunked_decay(x, g, segment):
    """The chunked form: within a chunk y_i = sum_{s<=i} exp(G(s, i]) x_s (the sum of g over (s, i]),
    by selection; between chunks the carry decays by exp(G(start-1, i]). ``segment(g)`` gives
    G(s, i] as [..., i, s] for one chunk of gates, and [..., i] over the whole chunk."""
    xf, gf = x.float(), g.float()
    outs, carry = [], torch.zeros_like(xf[..., 0])
    for start in range(0, xf.shape[-1], CHUNK):
        xc, gc = xf[..., start:start + CHUNK], gf[..., start:start + CHUNK]
        n = xc.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        within, whole = segment(gc)
        terms = torch.exp(within) * xc[..., None, :]                      # [..., i, s]
        y = torch.where(causal, terms, torch.zeros(())).sum(-1) + torch.exp(whole) * carry[..., None]
        outs.append(y)
        carry = y[..., -1]
    return torch.cat(outs, -1).to(x.dtype)


def _segsum(gc):
    """G(s, i] as a sum over (s, i] of the gates themselves, kept by selection (no difference of totals)."""
    r = torch.arange(gc.shape[-1], device=gc.device)
    span = (r[None, None, :] > r[None, :, None]) & (r[None, None, :] <= r[:, None, None])   # [i, s, r]
    within = torch.where(span, gc[..., None, None, :], torch.zeros(())).sum(-1)
    return within, gc.cumsum(-1)


def _cumdiff(gc):
    """G(s, i] as a difference of cumulative gates: G_i - G_s (-inf - -inf = NaN after a -inf gate)."""
    total = gc.cumsum(-1)
    return total[..., :, None] - total[..., None, :], total


@target("decay_scan", reference=decay_math,
        args={"x": Arg(("N", "T")), "g": Arg(("N", "T"), dtype="float32")},
        outputs={"out": Output(("N", "T"))},
        dims={"N": Dim(1, 16), "T": Dim(1, 256)}, domain=decay_domain,
        trusted=lambda x, g: decay_math(x.float(), g).to(x.dtype),
        options={"nominal": {"N": 4, "T": 32},
                 "no_exact_answers": "the domain sends every gate through softplus, so no output is exact "
                                     "by construction"},
        description="decayed running sum y_t = exp(g_t) y_{t-1} + x_t along T of [N, T] with log-space gates "
                    "g <= 0, torch, chunks of 8, each decay a sum of the gates it spans")
def decay_scan(x, g):
    return _chunked_decay(x, g, _segsum)


variant("decay_scan", "decay_scan.cumdiff", lambda x, g: _chunked_decay(x, g, _cumdiff),
        planted_bug="forms each chunk's decays as differences of cumulative log-gates: one -inf gate makes "
                    "-inf - (-inf) = NaN across the rest of its chunk (the true answer is finite)")
