# reference: reference_linear.py
# planted: none
import torch
import torch.nn as nn
import torch.nn.functional as F


class ModelNew(nn.Module):
    """The same layer with its parameters renamed (loaded by position)."""

    def __init__(self, in_features, out_features):
        super().__init__()
        layer = nn.Linear(in_features, out_features)
        self.w = nn.Parameter(layer.weight.detach().clone())
        self.b = nn.Parameter(torch.zeros(out_features))

    def forward(self, x):
        return F.linear(x, self.w, self.b)
