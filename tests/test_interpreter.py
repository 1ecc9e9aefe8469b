"""`kfuzz.interpreter`: under Triton's interpreter, nested jit calls share their launch's
language patch, and kernels compute what they computed before; bf16 converts and multiplies
as on a GPU (torch's conversions, bit for bit); a runtime scalar bounds a loop under any
NumPy."""
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton's interpreter only (no GPU)")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kfuzz.case import ArgCase, Case, Dist  # noqa: E402
from kfuzz.execute import execute  # noqa: E402
from kfuzz.interpreter import exact_bf16, scalar_index, share_language_patch, skip_dead_overflow_checks  # noqa: E402
from kfuzz.target import get_target  # noqa: E402


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


# a scalar as an index -----------------------------------------------------------------------------

@triton.jit
def _sum_in_blocks(x_ptr, out_ptr, n, B: tl.constexpr):
    i = tl.arange(0, B)
    acc = tl.zeros([B], dtype=tl.float32)
    for start in range(0, n, B):      # n: a runtime scalar, an index to Python's range
        acc += tl.load(x_ptr + start + i, mask=start + i < n, other=0.0)
    tl.store(out_ptr, tl.sum(acc, axis=0))


def test_a_runtime_scalar_bounds_a_loop_where_the_interpreter_converts_it_as_triton_before_3_7(monkeypatch):
    """Triton before 3.7 made a scalar an index with ``int(array)`` of a one-element array,
    which NumPy 2.4 refuses: planted here, the loop raises, and ``scalar_index`` repairs it."""
    import kfuzz.interpreter
    import numpy as np
    from triton.runtime import interpreter
    patch = interpreter._patch_lang_tensor

    def as_triton_before_3_7(tensor, *rest, **kwargs):
        patch(tensor, *rest, **kwargs)
        tensor.__index__ = lambda self: int(self.handle.data)   # outside the launch's scope: as it was
    # tl.tensor's own __index__ (none outside the interpreter) comes back after the test
    monkeypatch.setattr(tl.tensor, "__index__", getattr(tl.tensor, "__index__", None), raising=False)
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", as_triton_before_3_7)
    monkeypatch.setattr(kfuzz.interpreter, "_installed", kfuzz.interpreter._installed - {"scalar_index"})
    x, out = torch.arange(10, dtype=torch.float32), torch.empty(1)
    if tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 4):
        with pytest.raises(Exception, match="0-dimensional"):
            _sum_in_blocks[(1,)](x, out, 10, B=4)
    assert scalar_index()
    _sum_in_blocks[(1,)](x, out, 10, B=4)
    assert out.item() == 45.0


# integer overflow checks that nothing asserts -----------------------------------------------------

@triton.jit
def _offsets(x_ptr, out_ptr, base, B: tl.constexpr):
    i = tl.arange(0, B)
    tl.store(out_ptr + i, (base + i * 3 - 1) * 2 + tl.load(x_ptr + i))     # int32 +, -, *


def test_integer_arithmetic_builds_no_overflow_check_that_nothing_asserts_and_computes_the_same(monkeypatch):
    """Outside debug mode the interpreter drops an integer operation's overflow check: with
    ``skip_dead_overflow_checks`` none is built and the results are the same, an int32 overflow
    wrapping as before; in debug mode the check is built and asserts as Triton's does."""
    from triton.language import semantic
    from triton.runtime import interpreter
    import kfuzz.interpreter
    asserts = []
    device_assert = semantic.TritonSemantic.device_assert
    monkeypatch.setattr(semantic.TritonSemantic, "device_assert",
                        lambda self, *a: asserts.append(a[1]) or device_assert(self, *a))
    installed = semantic.TritonSemantic.binary_op_sanitize_overflow_impl
    shipped = getattr(installed, "__wrapped__", installed)      # Triton's own, where the patch is in
    x = torch.arange(8, dtype=torch.int32)
    for base in (5, 2 ** 30):              # 2**30 * 2 overflows int32 and wraps
        want = torch.empty(8, dtype=torch.int32)
        monkeypatch.setattr(semantic.TritonSemantic, "binary_op_sanitize_overflow_impl", shipped)
        monkeypatch.setattr(kfuzz.interpreter, "_installed",
                            kfuzz.interpreter._installed - {"skip_dead_overflow_checks"})
        _offsets[(1,)](x, want, base, B=8)
        assert len(asserts) == 5, asserts      # i * 3, base +, - 1, * 2, + x: each built a check
        assert skip_dead_overflow_checks()
        asserts.clear()
        got = torch.empty(8, dtype=torch.int32)
        _offsets[(1,)](x, got, base, B=8)
        assert asserts == [] and torch.equal(got, want), (asserts, got, want)
        expected = ((base + torch.arange(8, dtype=torch.int64) * 3 - 1) * 2 + x).to(torch.int64)
        assert torch.equal(got.to(torch.int64), (expected + 2 ** 31) % 2 ** 32 - 2 ** 31)
    monkeypatch.setattr(interpreter.interpreter_builder, "options", interpreter.InterpreterOptions(debug=True))
    with pytest.raises(Exception, match="int32 overflow detected"):
        _offsets[(1,)](x, torch.empty(8, dtype=torch.int32), 2 ** 30, B=8)
    assert asserts


# bf16 as on a GPU --------------------------------------------------------------------------------

@triton.jit
def _convert(x_ptr, y_ptr, n, B: tl.constexpr):
    i = tl.arange(0, B)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(y_ptr + i, x.to(y_ptr.dtype.element_ty), mask=i < n)


@triton.jit
def _dot(a_ptr, b_ptr, c_ptr, M: tl.constexpr):
    i = tl.arange(0, M)
    tile = i[:, None] * M + i[None, :]
    tl.store(c_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))


@triton.jit
def _arith(x_ptr, y_ptr, s_ptr, p_ptr, n_ptr, lt_ptr, m_ptr, B: tl.constexpr):
    i = tl.arange(0, B)
    x, y = tl.load(x_ptr + i), tl.load(y_ptr + i)
    tl.store(s_ptr + i, x + y)
    tl.store(p_ptr + i, x * y)
    tl.store(n_ptr + i, -x)
    tl.store(lt_ptr + i, (x < y).to(tl.int32))
    tl.store(m_ptr, tl.max(-tl.abs(x), axis=0))


def _same_bits(a, b):
    return bool(((a.view(torch.int16) == b.view(torch.int16)) | (a.isnan() & b.isnan())).all())


def test_bf16_converts_and_multiplies_as_torch_does():
    assert exact_bf16()
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(2000, generator=g) * 10.0 ** torch.randint(-45, 39, (2000,), generator=g).float(),
                   torch.tensor([1e30, 3.4e38, -3.39e38, 2.0 ** -133, 1e-39, float("nan"), float("inf"), 0.0, -0.0])])
    down = torch.empty(x.shape, dtype=torch.bfloat16)
    _convert[(1,)](x, down, x.numel(), B=4096)        # fp32 -> bf16: to nearest even, inf past the largest
    assert _same_bits(down, x.to(torch.bfloat16))
    up = torch.empty(x.shape)
    _convert[(1,)](down, up, x.numel(), B=4096)       # bf16 -> fp32: exact, subnormals included
    assert bool(((up == down.float()) | up.isnan()).all()) and up[x.numel() - 6] == 2.0 ** -133
    wide = torch.randn(100, dtype=torch.float64, generator=g) * 1e20
    narrow = torch.empty(100, dtype=torch.bfloat16)
    _convert[(1,)](wide, narrow, 100, B=128)           # float64 -> bf16: through fp32
    assert _same_bits(narrow, wide.float().to(torch.bfloat16))
    a, b = (torch.randn(16, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    c = torch.empty(16, 16)
    _dot[(1,)](a, b, c, M=16)
    assert torch.allclose(c, a.float() @ b.float(), rtol=1e-6, atol=1e-5)
    x, y = (torch.randn(64, generator=g).to(torch.bfloat16) for _ in range(2))
    s, p, n, m = (torch.empty(k, dtype=torch.bfloat16) for k in (64, 64, 64, 1))
    lt = torch.empty(64, dtype=torch.int32)
    _arith[(1,)](x, y, s, p, n, lt, m, B=64)      # arithmetic on the values, rounded to bf16
    assert _same_bits(s, x + y) and _same_bits(p, x * y) and _same_bits(n, -x)
    assert torch.equal(lt.bool(), x < y) and m.item() == (-x.abs()).max().item()


@pytest.mark.parametrize("name", ["rowsum", "softmax"])
def test_correct_triton_kernels_pass_bf16_subnormal_inputs(name):
    target = get_target(name)
    (arg,) = target.args
    for seed in range(12):
        dims = {d: 3 + 5 * seed % 29 for d in target.dims}
        case = Case.make(name, "bfloat16", seed, dims, {arg: ArgCase(dist=Dist("subnormal"))})
        v = execute(case, target)
        assert v.passed, f"{case.to_json()} -> {v.kind}: {v.detail}"
