"""A KernelBench-format reference problem, written for kfuzz's hack suite: row softmax of
inputs drawn by torch.rand (in [0, 1))."""
import torch
import torch.nn as nn

batch_size = 16
dim = 64


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.softmax(x, dim=1)


def get_inputs():
    return [torch.rand(batch_size, dim)]


def get_init_inputs():
    return []
