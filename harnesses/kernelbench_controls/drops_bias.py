# reference: reference_linear.py
# planted: drops the bias parameter (zero at initialization, so the standard test cannot tell)
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)

    def forward(self, x):
        return self.linear(x)
