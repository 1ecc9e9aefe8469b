"""RMSNorm over the last dim with a weight (torch, fp32 internally).

Planted bug ``rmsnorm.lowsquare``: squares in the input dtype before the mean,
so in fp16 any |x| > 256 overflows to Inf and the row comes out as zeros.
"""
import torch

from harnesses.rowscale import row_scale
from kfuzz.target import Arg, Dim, Output, target, variant

EPS = 1e-6


def rmsnorm_math(x, weight):
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + EPS) * weight


@target("rmsnorm", reference=rmsnorm_math,
        args={"x": Arg(("N", "D")), "weight": Arg(("D",))}, outputs={"out": Output(("N", "D"))},
        dims={"N": Dim(1, 64), "D": Dim(1, 512)},
        description="rms_norm over the last dim of [N, D] with weight, torch, fp32 internally")
def rmsnorm(x, weight):
    xf = x.float()
    s = row_scale(xf)
    y = xf / s
    out = y * torch.rsqrt((y * y).mean(dim=-1, keepdim=True) + EPS / (s * s)) * weight.float()
    return out.to(x.dtype)


def rmsnorm_lowsquare(x, weight):
    ms = (x * x).float().mean(dim=-1, keepdim=True)
    return (x.float() * torch.rsqrt(ms + EPS) * weight.float()).to(x.dtype)


variant("rmsnorm", "rmsnorm.lowsquare", rmsnorm_lowsquare,
        planted_bug="squares in the input dtype: fp16 overflow for |x| > 256 zeroes the row")
