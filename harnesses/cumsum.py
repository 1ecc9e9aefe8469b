"""Inclusive prefix sum over the last dim (torch).

Planted bug ``cumsum.inplace``: computes in place in its input and returns it.
"""
import torch

from kfuzz.target import Arg, Dim, Output, target, variant


@target("cumsum", reference=lambda x: torch.cumsum(x, dim=-1),
        args={"x": Arg(("N", "D"))}, outputs={"out": Output(("N", "D"))},
        dims={"N": Dim(1, 64), "D": Dim(1, 1024)},
        description="inclusive prefix sum over the last dim of [N, D], torch")
def cumsum(x):
    return torch.cumsum(x, dim=-1)


def cumsum_inplace(x):
    return x.cumsum_(dim=-1)


variant("cumsum", "cumsum.inplace", cumsum_inplace,
        planted_bug="writes the result into its input")
