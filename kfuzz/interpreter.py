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
"""
from __future__ import annotations

import inspect

_INSTALLED = False


def share_language_patch() -> bool:
    """Install the shared patch once per process; whether it is installed."""
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
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
    _INSTALLED = True
    return True
