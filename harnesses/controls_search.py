"""Control targets for the search engines: bugs that appear only under a combination.

``searchsum`` is a correct row sum (float64 totals) in plain PyTorch, cheap on the CPU.
Each variant carries a bug behind two or three conditions that must hold at once,
written as nested branches, the way such bugs sit in real kernels (a tail path, a
dtype-specific fast path, a layout-specific load):

- ``searchsum.tailinf``: when the last dim is over 16 and not a multiple of 16 *and*
  an Inf sits in the tail columns, the tail is summed with Inf replaced by 0 (nonfinite);
- ``searchsum.transbf16``: a transposed (column-major) bf16 input is read as if it
  were row-major (bound);
- ``searchsum.fp16max``: fp16 rows whose largest magnitude exceeds 1e4 take a "fast"
  path with an fp16 running total, which overflows where the answer is finite;
- ``searchsum.deep``: four conditions at once: a tail (last dim over 16, not a multiple
  of 16), a transposed input, an Inf in the tail, a 16-bit dtype; the Inf is dropped.
  Each condition alone is common; together they are rare for a blind sampler, and
  each one met is new harness coverage for a guided one;
- ``searchsum.crashhang``: segfaults (a null pointer read) when the input holds a NaN
  and hangs when the input is float16 with more than 100 columns: the sandbox's
  controls, not numerical bugs;
- ``searchsum.slowjit``: a JIT's first call, without a GPU to compile for: its first
  call in a process announces a compile (``kfuzz.jit.compiling``) and takes
  ``SLOW_JIT`` seconds, then it is correct; a float16 input wider than 100 columns
  announces a compile that never ends. The control of the compile allowance;
- ``searchsum.keyjit``: a JIT that compiles (``KEY_JIT`` seconds, announced) at the first call
  of each specialization it declares (dtype and D's next power of 2) in a process, then is
  correct: the control of compile-aware scheduling on the CPU;
- ``searchsum.misskey``: the same JIT, whose key also holds N's parity, which the
  declared specialization does not name: the control of the campaign's specialization
  misses (``kfuzz.schedule``);
- ``searchsum.oomrows``: runs out of memory (``torch.OutOfMemoryError``, as torch's
  allocator raises it) on every input of ``OOM_ROWS`` rows: the control of the campaign's
  out-of-memory rerun.
"""
import ctypes
import time

import torch

from kfuzz import jit
from kfuzz.target import Arg, Dim, Output, target, variant

TAIL = 16


def _total(x):
    # float64 totals: an fp32 total of values near fp32's maximum overflows where the answer
    # is finite, and the base of the controls must pass every case
    return x.double().sum(dim=-1).to(x.dtype)


@target("searchsum", reference=lambda x: x.sum(dim=-1),
        args={"x": Arg(("N", "D"))}, outputs={"out": Output(("N",))},
        dims={"N": Dim(1, 16), "D": Dim(1, 256)},
        description="row sum of [N, D] with float64 totals, PyTorch; the base of the search controls")
def searchsum(x):
    return _total(x)


def tailinf(x):
    tail = x.shape[-1] % TAIL
    if tail and x.shape[-1] > TAIL:
        t = x[:, x.shape[-1] - tail:]
        if torch.isinf(t).any():
            head = x[:, :x.shape[-1] - tail].float().sum(dim=-1)
            return (head + torch.nan_to_num(t.float(), posinf=0.0, neginf=0.0).sum(dim=-1)).to(x.dtype)
    return _total(x)


def transbf16(x):
    if x.dtype == torch.bfloat16:
        n, d = x.shape
        if n > 1 and d > 1 and x.stride() == (1, n):   # exactly the transpose of a dense tensor
            # reads the storage as if it were row-major
            raw = torch.as_strided(x, x.shape, (d, 1))
            return _total(raw)
    return _total(x)


def fp16max(x):
    if x.dtype == torch.float16:
        if x.numel() and x.abs().amax() > 1e4:
            acc = torch.zeros(x.shape[0], dtype=x.dtype)
            for j in range(x.shape[1]):     # the running total in fp16, rounded at every step
                acc = acc + x[:, j]
            return acc
    return _total(x)


def deep(x):
    n, d = x.shape
    if d > TAIL and d % TAIL:
        if n > 1 and x.stride() == (1, n):
            t = x[:, d - d % TAIL:]
            if torch.isinf(t).any():
                if x.dtype != torch.float32:
                    return tailinf(x)
    return _total(x)


def crashhang(x):
    if torch.isnan(x).any():
        ctypes.string_at(0)                  # a null pointer read: SIGSEGV
    if x.dtype == torch.float16 and x.shape[-1] > 100:
        while True:                          # never returns
            time.sleep(0.05)
    return _total(x)


SLOW_JIT = 2.0
_compiled = []


def slowjit(x):
    if x.dtype == torch.float16 and x.shape[-1] > 100:
        jit.compiling(True)
        while True:                          # a compile that never ends
            time.sleep(0.05)
    if not _compiled:
        jit.compiling(True)
        time.sleep(SLOW_JIT)
        _compiled.append(True)
        jit.compiling(False)
    return _total(x)


KEY_JIT = 0.3
_keys = set()


def keyjit_specialization(dims, dtype, layouts):
    return dtype, 1 << max(0, dims["D"] - 1).bit_length()


def _compile_once(kernel, key):
    """A JIT's call: the first at ``key`` in this process compiles (``KEY_JIT`` s, announced
    with its label as Triton's hook announces one)."""
    if (kernel, key) not in _keys:
        jit.compiling(True, jit.label(kernel, key))
        time.sleep(KEY_JIT)
        _keys.add((kernel, key))
        jit.compiling(False)


def keyjit(x):
    _compile_once("keyjit", keyjit_specialization({"D": x.shape[-1]}, str(x.dtype).removeprefix("torch."), {}))
    return _total(x)


def misskey(x):
    key = keyjit_specialization({"D": x.shape[-1]}, str(x.dtype).removeprefix("torch."), {})
    _compile_once("misskey", (*key, x.shape[0] % 2))
    return _total(x)


OOM_ROWS = 13


def oomrows(x):
    if x.shape[0] == OOM_ROWS:
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]}.00 GiB")
    return _total(x)


variant("searchsum", "searchsum.tailinf", tailinf,
        planted_bug="last dim > 16, not a multiple of 16, and an Inf in the tail: the Inf is dropped")
variant("searchsum", "searchsum.transbf16", transbf16,
        planted_bug="a transposed bf16 input is read as if row-major")
variant("searchsum", "searchsum.fp16max", fp16max,
        planted_bug="fp16 rows with a magnitude above 1e4 are summed with an fp16 running total")
variant("searchsum", "searchsum.deep", deep,
        planted_bug="a transposed 16-bit input with an Inf in the tail (last dim > 16, not a multiple of 16)")
variant("searchsum", "searchsum.crashhang", crashhang,
        planted_bug="segfaults on a NaN input; hangs on float16 inputs wider than 100 columns")
variant("searchsum", "searchsum.slowjit", slowjit,
        planted_bug="a compile that never ends on float16 inputs wider than 100 columns")
variant("searchsum", "searchsum.keyjit", keyjit, options={"specialization": keyjit_specialization})
variant("searchsum", "searchsum.misskey", misskey, options={"specialization": keyjit_specialization})
variant("searchsum", "searchsum.oomrows", oomrows,
        planted_bug="runs out of memory on every input of 13 rows")
