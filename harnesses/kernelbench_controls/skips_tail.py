# reference: reference_sum.py
# planted: sums whole blocks of 256 columns only, dropping the tail
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        n = x.shape[1] // 256 * 256
        return x[:, :n].reshape(x.shape[0], -1, 256).sum(dim=2).sum(dim=1)
