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
from kfuzz.target import variant


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
