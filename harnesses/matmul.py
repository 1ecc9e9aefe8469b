"""Matrix product [M, K] @ [K, N] (torch).

Planted bug ``matmul.lastresult``: returns its previous result when the output
shape repeats (a cache keyed by shape, as kernels that cache by shape or pointer do).
"""
import torch

from kfuzz.target import Arg, Dim, Output, target, variant


@target("matmul", reference=lambda a, b: a @ b,
        args={"a": Arg(("M", "K")), "b": Arg(("K", "N"))}, outputs={"out": Output(("M", "N"))},
        dims={"M": Dim(1, 128), "K": Dim(1, 128), "N": Dim(1, 128)},
        description="matrix product, torch")
def matmul(a, b):
    return torch.matmul(a, b)


_last: dict = {}


def matmul_lastresult(a, b):
    key = (a.shape[0], b.shape[1], a.dtype)
    if key not in _last:
        _last[key] = torch.matmul(a, b)
    return _last[key].clone()


variant("matmul", "matmul.lastresult", matmul_lastresult,
        planted_bug="reuses its last result when the output shape repeats")
