"""kfuzz's own probe solution: a ReLU extension built with ``load_inline`` as solutions build
theirs (a host file with torch's extension header and, where CUDA is visible, a CUDA file for
nvcc, which includes no torch header so that the probe costs a host compile, not two). The
audit builds it in its confined build step before any solution's
(``kfuzz.audit.check_build_step``): where it does not build, no solution's build failure says
anything about the solution."""
from __future__ import annotations

from pathlib import Path

REFERENCE = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(64)]


def get_init_inputs():
    return []
'''

SOLUTION = '''# reference: reference_relu.py
# planted: none
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

HOST = r"""
#include <torch/extension.h>
torch::Tensor relu(torch::Tensor x) { return torch::clamp_min(x, 0); }
"""
HOST_CUDA = r"""
#include <torch/extension.h>
void relu_launch(const float* x, float* y, long n);
torch::Tensor relu(torch::Tensor x) {
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    relu_launch(xc.data_ptr<float>(), y.data_ptr<float>(), xc.numel());
    return y;
}
"""
DEVICE = r"""
__global__ void relu_kernel(const float* x, float* y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
void relu_launch(const float* x, float* y, long n) {
    if (n > 0) relu_kernel<<<(n + 255) / 256, 256>>>(x, y, n);
}
"""
if torch.cuda.is_available():
    ext = load_inline("kfuzz_probe_cuda", cpp_sources=HOST_CUDA, cuda_sources=DEVICE, functions=["relu"],
                      no_implicit_headers=True)
else:
    ext = load_inline("kfuzz_probe", cpp_sources=HOST, functions=["relu"], no_implicit_headers=True)


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu(x)
'''


def probe_entry(folder: str | Path):
    """The probe as a one-solution controls folder written at ``folder`` (``read_corpus``'s
    format, so that a worker resolves it by name as it resolves any solution)."""
    from kfuzz.kernelbench.corpus import read_corpus
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("reference_relu.py", REFERENCE), ("builds_relu.py", SOLUTION)):
        path = folder / name
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
    (entry,) = read_corpus(folder)
    return entry
