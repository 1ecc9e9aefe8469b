# reference: reference_sum.py
# planted: float32 sums of blocks of 32 columns added into a float16 running total
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    BLOCK = 32

    def __init__(self):
        super().__init__()

    def forward(self, x):
        total = torch.zeros(x.shape[0], dtype=torch.float16, device=x.device)
        for k in range(0, x.shape[1], self.BLOCK):
            total = (total.float() + x[:, k:k + self.BLOCK].float().sum(dim=1)).half()
        return total.float()
