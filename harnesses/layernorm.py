"""LayerNorm over the last dim with weight and bias (torch).

Planted bug ``layernorm.nan2zero``: the kernel "cleans" its output with
nan_to_num, so NaN becomes 0 (and Inf a large finite number).
"""
import torch

from harnesses.rowscale import row_scale
from kfuzz.target import Arg, Dim, Output, target, variant

EPS = 1e-5


def layernorm_math(x, weight, bias):
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + EPS) * weight + bias


# The default trusted implementation (this math with fp32 totals) overflows on rows near fp32's
# maximum and F.layer_norm returns NaN there, so the trusted one is the row-scaled kernel below.
@target("layernorm", reference=layernorm_math, trusted=lambda x, weight, bias: layernorm(x, weight, bias),
        args={"x": Arg(("N", "D")), "weight": Arg(("D",)), "bias": Arg(("D",))},
        outputs={"out": Output(("N", "D"))},
        dims={"N": Dim(1, 64), "D": Dim(1, 512)},
        description="layer_norm over the last dim of [N, D] with weight and bias, torch, fp32 two-pass on row-scaled values")
def layernorm(x, weight, bias):
    xf = x.float()
    s = row_scale(xf)
    y = xf / s
    mean = y.mean(dim=-1, keepdim=True)
    var = ((y - mean) ** 2).mean(dim=-1, keepdim=True)
    # clamp: when eps / s^2 underflows and the row is constant, 0 * rsqrt(0) would be NaN
    inv = torch.rsqrt(torch.clamp(var + EPS / (s * s), min=torch.finfo(torch.float32).tiny))
    out = (y - mean) * inv * weight.float() + bias.float()
    return out.to(x.dtype)


variant("layernorm", "layernorm.nan2zero", lambda x, weight, bias: torch.nan_to_num(layernorm(x, weight, bias)),
        planted_bug="nan_to_num on the output: NaN becomes 0, Inf a finite number")
