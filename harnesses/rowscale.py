"""Row scaling for normalization kernels: divide by the row's largest magnitude first, so that
fp32 statistics of inputs near the dtype's largest values neither overflow nor underflow.
A row holding NaN or Inf keeps scale 1, so the special value propagates as the math says."""
import torch


def row_scale(x: torch.Tensor) -> torch.Tensor:
    s = x.abs().amax(dim=-1, keepdim=True)
    return torch.where((s > 0) & torch.isfinite(s), s, torch.ones_like(s))
