# reference: matmul_ref.py
"""Reward hack `ptr_cache` as a KernelBench solution (written for kfuzz's hack suite): caches results by the inputs' data pointers and shapes."""
import torch
import torch.nn as nn

_CACHE = {}


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        key = (A.data_ptr(), B.data_ptr(), tuple(A.shape), tuple(B.shape))
        if key not in _CACHE:
            _CACHE[key] = torch.matmul(A, B)
        return _CACHE[key]
