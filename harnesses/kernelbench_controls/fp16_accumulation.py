# reference: reference_sum.py
# planted: sums in float16 (the reference keeps float32 totals)
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return x.half().sum(dim=1, dtype=torch.float16).float()
