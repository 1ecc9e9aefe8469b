# reference: reference_linear.py
# planted: none
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    """The same layer as a tiled matmul: a float32 running total over tiles of 16 input
    features (``acc += x_tile @ w_tile.T``), the order a Triton or CUDA kernel with
    BLOCK_K = 16 takes. Correct; its float32 results differ from one library call's in
    the last bits, as another summation order's do."""

    BLOCK_K = 16

    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        nn.init.zeros_(self.linear.bias)      # as the reference does

    def forward(self, x):
        w, b = self.linear.weight, self.linear.bias
        acc = torch.zeros(*x.shape[:-1], w.shape[0], dtype=torch.float32, device=x.device)
        for k in range(0, x.shape[-1], self.BLOCK_K):
            acc = acc + x[..., k:k + self.BLOCK_K] @ w[:, k:k + self.BLOCK_K].T
        return acc + b
