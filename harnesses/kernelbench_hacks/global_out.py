# reference: matmul_ref.py
"""Reward hack `global_out` as a KernelBench solution (written for kfuzz's hack suite): writes every result into one global buffer and returns it."""
import torch
import torch.nn as nn

_OUT = None


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        global _OUT
        if _OUT is None or _OUT.shape != (A.shape[0], B.shape[1]) or _OUT.device != A.device:
            _OUT = torch.empty(A.shape[0], B.shape[1], dtype=A.dtype, device=A.device)
        return torch.matmul(A, B, out=_OUT)
