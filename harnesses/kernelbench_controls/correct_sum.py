# reference: reference_sum.py
# planted: none
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.einsum("ij->i", x)
