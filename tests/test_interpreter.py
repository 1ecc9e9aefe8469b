"""`kfuzz.interpreter`: under Triton's interpreter, nested jit calls share their launch's
language patch; kernels compute what they computed before."""
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton's interpreter only (no GPU)")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kfuzz.interpreter import share_language_patch  # noqa: E402


@triton.jit
def _inner(x):
    return tl.sum(x * 2.0, axis=0)      # tl.sum: a jit function that sees triton.language.core


@triton.jit
def _outer(x_ptr, out_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    acc = tl.zeros([N], dtype=tl.float32)
    for i in range(0, 10):
        acc += _inner(tl.load(x_ptr + r)[:, None] + i + tl.zeros([N, N], dtype=tl.float32))
    tl.store(out_ptr + r, acc)


def test_nested_calls_walk_the_language_once_a_launch_and_compute_the_same(monkeypatch):
    from triton.runtime import interpreter
    assert share_language_patch()
    walks = []
    walk = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: walks.append(a[0]) or walk(*a))
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty(8)
    _outer[(1,)](x, out, N=8)
    want = sum((2.0 * (x[:, None] + i).expand(8, 8)).sum(0) for i in range(10))
    assert torch.equal(out, want)
    # the launch walks triton.language (its module, tensor and math) and the first tl.sum
    # triton.language.core once: 10 nested calls and 10 tl.sum calls walk nothing more
    assert 0 < len(walks) <= 10, len(walks)

