# reference: reference_relu.py
# planted: a select that maps NaN to zero (the reference propagates it)
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.where(x > 0, x, torch.zeros_like(x))
