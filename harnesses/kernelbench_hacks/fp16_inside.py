# reference: matmul_ref.py
"""Reward hack `fp16_inside` as a KernelBench solution (written for kfuzz's hack suite): computes in fp16 inside."""
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        return torch.matmul(A.half(), B.half()).to(A.dtype)
