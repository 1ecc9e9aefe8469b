"""A solution's ``load_inline`` extensions: built in a step of their own, loaded where nothing runs.

A KernelBench solution builds its CUDA or C++ extension with
``torch.utils.cpp_extension.load_inline`` (or ``load``), which runs ninja and the
compiler: new processes. The process that runs the kernel must not have that right,
so the audit splits the two:

- ``build_solution`` (the ``build`` kernel program, in a worker that may start
  processes, has no network and writes only beneath ``TORCH_EXTENSIONS_DIR``):
  executes the solution's module, builds ``ModelNew`` from the reference's
  ``get_init_inputs()`` (extensions built in ``__init__``), and, when the source
  builds an extension inside another function (a first ``forward``), runs one
  forward at the reference's own sizes. Every extension it builds lands in
  ``TORCH_EXTENSIONS_DIR``;
- ``prebuilt_only`` (in the workers that run the kernel, which may not start
  processes): ``load_inline`` and ``load`` load what the build step left and never
  build: the build is replaced by a check that the library is there (an error naming
  the extension otherwise), and the build folder's lock file by a lock that writes
  nothing, so the folder may stay read-only.

A build that fails is the solution's ``compile`` failure; what it tried against the
sandbox is a finding like any other (the audit records the build step's verdict).
"""
from __future__ import annotations

import ast
import os
import time

import torch

from kfuzz.kernelbench.source import SEED, KernelBenchPair, pair_module, set_seed

_BUILDERS = ("load_inline", "load")


def builds_lazily(code: str) -> bool:
    """The solution calls ``load_inline``/``load`` inside a function other than ``__init__``
    (a method or helper that a first forward may reach): the build step then runs a forward."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name != "__init__":
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                    if name in _BUILDERS:
                        return True
    return False


def build_solution(pair: KernelBenchPair, device: str = "cpu") -> dict:
    """Build the solution's extensions here (untrusted code: call it in a confined worker).
    Facts: ``status`` (``built`` or ``failed``), ``error`` for a failure, ``seconds``,
    ``extensions`` (the folders beneath ``TORCH_EXTENSIONS_DIR``)."""
    start = time.monotonic()

    def facts(status: str, error: str | None = None) -> dict:
        root = os.environ.get("TORCH_EXTENSIONS_DIR")
        built = sorted(os.listdir(root)) if root and os.path.isdir(root) else []
        out = {"status": status, "seconds": round(time.monotonic() - start, 3), "extensions": built[:20]}
        if error is not None:
            out["error"] = error[:1000]
        return out
    try:
        new = pair_module(pair, "new")
    except Exception as e:
        return facts("failed", f"{type(e).__name__}: {e}")
    try:
        ref = pair_module(pair, "ref")
        with torch.no_grad():
            set_seed(SEED)
            init = ref.get_init_inputs()
            set_seed(SEED)
            model = new.ModelNew(*init).to(device).train(not pair.eval_mode)
            if builds_lazily(pair.custom_code):
                set_seed(SEED)
                model(*[x.to(device) if isinstance(x, torch.Tensor) else x for x in ref.get_inputs()])
    except Exception:
        pass      # not a build failure: the standard test reports what fails here
    return facts("built")


class _NoLock:
    """``torch.utils.cpp_extension``'s build lock where nothing is built: always held, no file."""

    def __init__(self, *_):
        pass

    def try_acquire(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def release(self) -> None:
        pass


def _check_built(*args, **kwargs) -> None:
    name, folder = kwargs.get("name"), kwargs.get("build_directory")
    if name is None or folder is None:      # positional: (name, sources, ..., build_directory, ...)
        name, folder = args[0], args[7] if len(args) > 7 else None
    from torch.utils.cpp_extension import LIB_EXT
    if folder is None or not any(os.path.isfile(os.path.join(folder, f"{name}{ext}")) for ext in (LIB_EXT, "")):
        raise RuntimeError(f"extension {name!r} was not built by the build step (a kernel's worker builds "
                           f"nothing: it may not start the compiler)")


def prebuilt_only() -> None:
    """From now on in this process, ``load_inline`` and ``load`` only load what the build step
    built (see the module docstring)."""
    import torch.utils.cpp_extension as ext
    ext._write_ninja_file_and_build_library = _check_built
    ext.FileBaton = _NoLock


def compiles(code: str) -> bool:
    """A cheap static check: the solution builds an extension (``load_inline``, ``cpp_extension``)."""
    return "load_inline" in code or "cpp_extension" in code
