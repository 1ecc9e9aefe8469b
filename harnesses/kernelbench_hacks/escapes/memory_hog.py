# reference: ../../kernelbench_controls/reference_relu.py
# planted: resource-memory (reserves 20 GiB of address space in forward)
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        hoard = torch.empty(20 << 30, dtype=torch.uint8)     # reserved, never touched
        return torch.relu(x) + 0 * hoard[0]
