"""Triton's interpreter, where kfuzz runs Triton kernels without a GPU (TRITON_INTERPRET=1).

A kernel launch under the interpreter patches ``triton.language`` for the launch (an
``inspect.getmembers`` walk of the module) and restores it at its end; every call of one
``@triton.jit`` function from another walks it again, although the launch already patched
it, which costs most in kernels built from many small jit functions (the GDN kernels'
step-by-step paths).  ``share_language_patch`` lets a nested call skip it where the launch, or an earlier call in it, already patched every
language module (``triton.language``, ``triton.language.core``) that the callee sees; what
runs is unchanged (`tools/bench_interpreter.py` measures the difference).  It needs the
interpreter's private ``_patch_lang``, ``GridExecutor`` and ``_LangPatchScope``; with a
Triton without them it does nothing.

``exact_bf16`` makes the interpreter's bf16 arithmetic the GPU's. Triton 3.9's interpreter
holds bf16 as its 16 bits and converts them by hand: fp32 to bf16 by truncation (a GPU's
``.to(tl.bfloat16)`` rounds to nearest even: ``1e30`` came out ``9.953e29``), bf16
subnormals to fp32 wrongly (``2**-133 -> 0``), float64 to bf16 as an integer cast of the
value; and it computes on the bits: ``tl.dot``, ``+``, ``*``, ``<``, ``-x``, ``tl.exp`` and
the rest on bf16 operands treat their bit patterns as integers (``-1.125 + -0.5703`` came out
``1.08e38``). The patch converts bf16 to fp32 by its bits (exact: bf16 is fp32's upper half),
fp32 to bf16 rounding to nearest even (NaN stays NaN, a value past bf16's largest rounds to
inf, as on a GPU), another type to bf16 through fp32, and computes every arithmetic,
comparison, unary, clamp and fma operation with a bf16 operand on the fp32 values, rounding
an fp32 result to bf16 (a select moves bits and stays as it is). It needs the interpreter's
``InterpreterBuilder`` and ``TensorHandle``; without them it does nothing.

``scalar_index`` makes a Triton scalar usable as a Python index with NumPy 2.4 or later. The
interpreter holds a scalar as a one-element array, and Triton before 3.7 converts it with
``int(array)`` (``range(n)``, a loop bound, a constexpr argument of a nested call), which NumPy
2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"); every such
kernel then raises under the interpreter. The patch converts the array's one element instead,
whatever the Triton. It needs the interpreter's ``_patch_lang_tensor``; without it it does
nothing.

``skip_dead_overflow_checks`` stops the interpreter from building integer overflow checks that
nothing asserts. Triton's integer ``+``, ``-`` and ``*`` build a check beside the operation
(the operation again in int64, two comparisons, their ``and``, a ``device_assert``), and the
assert does something only in a launch in debug mode, which the interpreter's launches never
are (its options' ``debug`` is False): every integer operation of a kernel (its offsets and
masks) computes the check and drops it, about half of the GDN kernels' time under the
interpreter. The patch skips building the check where the interpreter's builder is not in
debug mode; what a kernel computes, and what it asserts, is unchanged. It needs the
semantic's ``binary_op_sanitize_overflow_impl`` and the interpreter's ``InterpreterBuilder``;
without them it does nothing.
"""
from __future__ import annotations

import functools
import inspect

_installed: set[str] = set()    # the patches installed in this process, by installer's name


def _once(install):
    """An installer of a patch that runs until it has installed it once in this process, then
    says True at once; False where this Triton lacks what it patches (or there is no Triton)."""
    @functools.wraps(install)
    def once() -> bool:
        if install.__name__ not in _installed:
            try:
                if not install():
                    return False
            except ImportError:
                return False
            _installed.add(install.__name__)
        return True
    return once


@_once
def share_language_patch() -> bool:
    """Install the shared patch once per process; whether it is installed."""
    import triton.language as tl
    from triton.runtime import interpreter
    patch = getattr(interpreter, "_patch_lang", None)
    launch = getattr(interpreter, "GridExecutor", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if patch is None or launch is None or scope is None:
        return False
    patched: list = []   # per launch in progress: the language modules patched in it (None: none yet)
    seen: dict = {}      # jit function -> ids of the language modules it sees

    def langs(fn) -> frozenset:
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                 if inspect.ismodule(v) and v in (tl, tl.core))
        return seen[fn]

    def patch_once(fn):
        if patched and patched[-1] is not None and langs(fn) <= patched[-1]:
            return scope()
        if patched:
            patched[-1] = langs(fn) | (patched[-1] or frozenset())
        return patch(fn)

    run = launch.__call__

    def run_patched_once(self, *args, **kwargs):
        patched.append(None)
        try:
            return run(self, *args, **kwargs)
        finally:
            patched.pop()

    interpreter._patch_lang = patch_once
    launch.__call__ = run_patched_once
    return True


@_once
def scalar_index() -> bool:
    """Install the index patch once per process (see the module docstring); whether it is."""
    from triton.runtime import interpreter
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None:
        return False

    def index(self):
        return int(self.handle.data.item())     # a one-element array, whatever its number of dims

    def patch_lang_tensor(tensor, *rest, **kwargs):
        patch(tensor, *rest, **kwargs)
        scope = rest[0] if rest else kwargs.get("scope")
        if hasattr(scope, "set_attr"):     # restored with the launch's other patches
            scope.set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


@_once
def skip_dead_overflow_checks() -> bool:
    """Install the overflow-check patch once per process (see the module docstring); whether it is."""
    from triton.language import semantic
    from triton.runtime import interpreter
    cls = getattr(semantic, "TritonSemantic", None)
    check = getattr(cls, "binary_op_sanitize_overflow_impl", None)
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if check is None or builder is None:
        return False

    @functools.wraps(check)
    def sanitize_overflow(self, lhs, rhs, binary_op):
        if isinstance(self.builder, builder) and not self.builder.options.debug:
            return None     # device_assert would drop the check: nothing asserts it
        return check(self, lhs, rhs, binary_op)

    cls.binary_op_sanitize_overflow_impl = sanitize_overflow
    return True


def bf16_to_f32(bits):
    """bf16 values held as their 16 bits (uint16) as float32: exact."""
    import numpy as np
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """float32 values rounded to nearest even as bf16, held as their 16 bits (uint16)."""
    import numpy as np
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    quiet = ((u >> 16) | np.uint32(0x40)).astype(np.uint16)
    return np.where(np.isnan(x), quiet, rounded)


@_once
def exact_bf16() -> bool:
    """Install the bf16 patch once per process (see the module docstring); whether it is."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if builder is None or handle is None or np_dtype is None or not hasattr(builder, "cast_impl"):
        return False
    cast, to_fp, dot = builder.cast_impl, builder.create_fp_to_fp, builder.create_dot
    bf16 = tl.bfloat16

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if s == bf16 and d != bf16:
            value = bf16_to_f32(src.data)
            return handle(value if d == tl.float32 else value.astype(np_dtype(d)), d)
        if d == bf16 and s != bf16:
            return handle(f32_to_bf16(np.asarray(src.data).astype(np.float32)), d)
        return cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        s, d = src.dtype.scalar, dst_type.scalar
        if s == bf16 and d == tl.float32:
            return handle(bf16_to_f32(src.data), d)
        if s == tl.float32 and d == bf16 and rounding_mode == interpreter._ir.ROUNDING_MODE.RTNE:
            return handle(f32_to_bf16(src.data), d)
        return to_fp(self, src, dst_type, rounding_mode)

    def widened(h):
        return handle(bf16_to_f32(h.data), tl.float32) if h.dtype.scalar == bf16 else h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    def narrowed(h):
        """An fp32 result of bf16 operands as bf16, rounded to nearest even (a comparison's
        booleans as they are)."""
        if np.asarray(h.data).dtype == np.float32:
            return handle(f32_to_bf16(h.data), bf16)
        return h

    def binary_op(self, lhs, rhs, op):
        if op in BITWISE or bf16 not in (lhs.dtype.scalar, rhs.dtype.scalar):
            return binary(self, lhs, rhs, op)
        return narrowed(binary(self, widened(lhs), widened(rhs), op))

    def unary_op(self, arg, op):
        if arg.dtype.scalar != bf16:
            return unary(self, arg, op)
        return narrowed(unary(self, widened(arg), op))

    def ternary_op(self, lhs, rhs, other, op):
        if op is np.where or bf16 not in (lhs.dtype.scalar, rhs.dtype.scalar, other.dtype.scalar):
            return ternary(self, lhs, rhs, other, op)    # a select moves bits: bf16's are right
        return narrowed(ternary(self, widened(lhs), widened(rhs), widened(other), op))

    def create_fma(self, x, y, z):
        if bf16 not in (x.dtype.scalar, y.dtype.scalar, z.dtype.scalar):
            return fma(self, x, y, z)
        return narrowed(fma(self, widened(x), widened(y), widened(z)))

    BITWISE = (np.bitwise_and, np.bitwise_or, np.bitwise_xor, np.left_shift, np.right_shift)
    binary, unary, ternary, fma = builder.binary_op, builder.unary_op, builder.ternary_op, builder.create_fma
    builder.cast_impl, builder.create_fp_to_fp, builder.create_dot = cast_impl, create_fp_to_fp, create_dot
    builder.binary_op, builder.unary_op, builder.ternary_op, builder.create_fma = binary_op, unary_op, ternary_op, create_fma
    # the cast lambdas (create_fp_trunc, create_fp_ext, ...) look cast_impl up on the instance
    return True
