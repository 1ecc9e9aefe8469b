# reference: ../../kernelbench_controls/reference_relu.py
# planted: none
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <pybind11/pybind11.h>
#include <cstdint>
static void relu(std::uintptr_t src, std::uintptr_t dst, std::int64_t n) {
    const float* x = reinterpret_cast<const float*>(src);
    float* y = reinterpret_cast<float*>(dst);
    for (std::int64_t i = 0; i < n; ++i) y[i] = x[i] > 0.f ? x[i] : (x[i] != x[i] ? x[i] : 0.f);
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("relu", &relu); }
"""
relu_cpp = load_inline("kfuzz_escapes_relu", cpp_sources=SOURCE, no_implicit_headers=True, extra_cflags=["-O1"])


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        relu_cpp.relu(x.data_ptr(), y.data_ptr(), x.numel())
        return y
