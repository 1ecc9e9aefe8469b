"""Triton's interpreter, where kfuzz runs Triton kernels without a GPU (TRITON_INTERPRET=1).

A kernel launch under the interpreter patches ``triton.language`` for the launch (an
``inspect.getmembers`` walk of the module) and restores it at its end; every call of one
``@triton.jit`` function from another walks it again, although the launch already patched
it.  For kernels built from many small jit functions (the GDN kernels' step-by-step paths)
that walk was a third or more of the interpreted time.  ``share_language_patch`` lets a
nested call skip it where the launch, or an earlier call in it, already patched every
language module (``triton.language``, ``triton.language.core``) that the callee sees; what
runs is unchanged.  It also remembers the numpy dtype of each Triton element type (the
interpreter built a table of them on every operation).  It needs the interpreter's private
``_patch_lang``, ``GridExecutor``, ``_LangPatchScope`` and ``_get_np_dtype``; with a
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
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if patch is None or launch is None or scope is None or np_dtype is None:
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

    dtypes: dict = {}    # element type -> numpy dtype (a block's is its element type's)

    def np_dtype_once(tt):
        key = tt.element_ty if isinstance(tt, tl.block_type) else tt
        try:
            return dtypes[key]
        except KeyError:
            dtypes[key] = found = np_dtype(tt)
            return found
        except TypeError:   # an unhashable type: as the interpreter does
            return np_dtype(tt)

    interpreter._patch_lang = patch_once
    launch.__call__ = run_patched_once
    interpreter._get_np_dtype = np_dtype_once
    _INSTALLED = True
    return True
