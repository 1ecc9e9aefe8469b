# reference: reference_cumsum.py
# planted: none
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    """A blocked scan: float32 sums within blocks of 32 columns, a float32 carry between them."""

    BLOCK = 32

    def __init__(self):
        super().__init__()

    def forward(self, x):
        out = torch.empty_like(x)
        carry = torch.zeros(x.shape[0], 1, dtype=torch.float32, device=x.device)
        for k in range(0, x.shape[1], self.BLOCK):
            part = x[:, k:k + self.BLOCK].float().cumsum(dim=1) + carry
            out[:, k:k + self.BLOCK] = part
            carry = part[:, -1:]
        return out
