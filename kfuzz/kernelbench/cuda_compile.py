"""A ``load_inline`` build's CUDA files, compiled for less: torch's includes slimmed, after the host files.

The CUDA file (``cuda.cu``, compiled by ``nvcc``) has no precompiled header (``pch``): nvcc's
front ends see only preprocessed text. Most of its compile is spent parsing the torch headers that a
solution's ``cuda_sources`` include again after load_inline's own ``#include <torch/types.h>``:
``<torch/extension.h>`` (or ``<torch/torch.h>``, ``<torch/all.h>``) adds torch's C++ frontend
(modules, optimizers, data loaders, serialization) and pybind11, which a kernel file rarely
uses. ``slim_cuda_source`` replaces those includes with ``<torch/types.h>`` (tensors, ATen's
operators and factories, ``TORCH_CHECK``, the dispatch macros), and leaves alone a file that
names what only they declare (pybind11, the Python API, ``torch::nn`` and the other frontend
namespaces). ``use_slim_cuda`` (in the build step) compiles a slimmed copy of a ``load_inline``
CUDA file beside it (``cuda.slim.cu``) and, where that copy does not compile, the file as
written: a trimmed include only removes declarations, so what builds from the copy is the
solution's own code, and what does not builds as it always did (the error, if any, is the
original's). A build whose slimmed copies compiled and that failed elsewhere (the host file,
the link) is not built again: the files as written would fail there the same way, and the
error is the slimmed build's. The files load_inline wrote stay as written (the kernel's
workers check them against the build). On by default; ``KFUZZ_SLIM_CUDA=0`` turns it off
(``kfuzz audit --no-slim-cuda``). ``host_first`` (in the build step) compiles an extension's
host files before its CUDA files, and these only where the host files compiled.

Both change torch's ninja build in the build step's process (``build.build_solution``), never
the build's result. Refuses to slim: a file that names what only the frontend headers declare,
a CUDA file outside the extension's build folder, and one whose slimmed copy does not compile
(each compiles as written).
"""
from __future__ import annotations

import os
import re
import subprocess

# the CUDA file's torch includes, slimmed -----------------------------------------------------------

SLIM_ENV = "KFUZZ_SLIM_CUDA"   # "0": the build step compiles CUDA files as written
SLIM_SUFFIX = ".slim.cu"
SLIM_USED: list[str] = []      # the extensions this process built from a slimmed CUDA file
SLIM_REFUSED: list[str] = []   # those whose slimmed CUDA file did not compile (built as written)

_FRONTEND_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]torch/(?:extension|torch|all)\.h[>"][^\n]*$',
                               re.MULTILINE)
# what only the frontend headers declare: a file that names any of it compiles as written
_FRONTEND_USE = re.compile(r"PYBIND11|pybind11|\bpy::|\bPy(?:_[A-Z]|[A-Z][A-Za-z]*_[A-Za-z]|Object\b)|Python\.h"
                           r"|\btorch::(?:nn|optim|data|serialize|jit|autograd|cuda|fft|linalg|special|nested|python)\b"
                           r"|\bTORCH_LIBRARY|\bTORCH_MODULE")


def slim_cuda_source(text: str) -> str | None:
    """``text`` (a CUDA file) with its ``#include`` of ``<torch/extension.h>``, ``<torch/torch.h>``
    or ``<torch/all.h>`` replaced by ``<torch/types.h>``; None where there is none, or where the
    file names what only those headers declare (see the module docstring)."""
    if not _FRONTEND_INCLUDE.search(text) or _FRONTEND_USE.search(_FRONTEND_INCLUDE.sub("", text)):
        return None
    return _FRONTEND_INCLUDE.sub("#include <torch/types.h>", text)


def _write_if_changed(path: str, text: str) -> None:
    """``text`` at ``path``, written only where the file holds something else (its time stays,
    so ninja does not compile it again)."""
    try:
        with open(path) as f:
            if f.read() == text:
                return
    except (OSError, UnicodeDecodeError):
        pass
    with open(path + ".part", "w") as f:
        f.write(text)
    os.replace(path + ".part", path)


def _built_from(obj: str, source: str) -> bool:
    """Whether the object file ``obj`` is there and no older than its ``source``: compiled
    from it, in this build or in one before."""
    try:
        return os.path.getmtime(obj) >= os.path.getmtime(source)
    except OSError:
        return False


def use_slim_cuda() -> None:
    """From now on in this process, an extension's CUDA files that load_inline wrote in its
    build folder compile slimmed (``slim_cuda_source``) where they can, else as written."""
    import torch.utils.cpp_extension as ext
    build = ext._write_ninja_file_and_build_library
    if getattr(build, "kfuzz_slim", False):
        return

    def slimmed(name, sources, *args, **kwargs):
        folder = kwargs.get("build_directory", args[5] if len(args) > 5 else None)
        light, objects = [], []     # objects: (the object ninja makes, the copy it compiles)
        for src in sources:
            text = None
            if folder and src.endswith(".cu") and os.path.dirname(os.path.abspath(src)) == os.path.abspath(folder):
                try:
                    with open(src) as f:
                        text = slim_cuda_source(f.read())
                except (OSError, UnicodeDecodeError):
                    text = None
            if text is None:
                light.append(src)
                continue
            copy = src[:-len(".cu")] + SLIM_SUFFIX
            _write_if_changed(copy, text)     # as load_inline writes its files: ninja rebuilds only what changed
            light.append(copy)
            # where ninja puts the copy's object (torch's naming: the source's stem + ".cuda.o")
            objects.append((os.path.join(folder, os.path.basename(copy)[:-len(".cu")] + ".cuda.o"), copy))
        if objects:
            try:
                result = build(name, light, *args, **kwargs)
            except HostBuildError:
                raise      # no CUDA file was compiled: the host file fails as written too
            except Exception:
                if all(_built_from(o, c) for o, c in objects):
                    # the copies compiled: what failed (the host file, the link) fails as written too
                    SLIM_USED.append(name)
                    raise
                SLIM_REFUSED.append(name)  # a copy does not compile: the file as written decides
            else:
                SLIM_USED.append(name)
                return result
        return build(name, sources, *args, **kwargs)
    slimmed.kfuzz_slim = True
    slimmed.kfuzz_pch = getattr(build, "kfuzz_pch", None)
    ext._write_ninja_file_and_build_library = slimmed


# the host files first -----------------------------------------------------------------------------

class HostBuildError(RuntimeError):
    """A build that failed compiling its host (C++) files, before any CUDA file was compiled."""


# a build statement's output (ninja escapes a space or colon in a path with "$")
_HOST_RULE = re.compile(r"^build ((?:\$.|[^\s$])+): compile ", re.MULTILINE)
_CUDA_RULE = re.compile(r"^build (?:\$.|[^\s$])+: cuda_compile ", re.MULTILINE)


def _ninja_hosts(folder: str, verbose: bool, error_prefix: str, targets: list[str]) -> None:
    """ninja on the host objects ``targets`` in ``folder``, as torch runs it (``MAX_JOBS``; its
    error, ``HostBuildError``, says ``error_prefix`` and then what ninja printed, as torch's does)."""
    import torch.utils.cpp_extension as ext
    command = ["ninja", "-v"]
    jobs = ext._get_num_workers(verbose)
    if jobs is not None:
        command += ["-j", str(jobs)]
    done = subprocess.run(command + targets, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=folder,
                          env=os.environ.copy())
    if done.returncode != 0:
        said = done.stdout.decode(errors="replace") if done.stdout else ""
        raise HostBuildError(f"{error_prefix}: {said}" if said else error_prefix)


def host_first() -> None:
    """From now on in this process, an extension with CUDA files compiles its host files first
    and its CUDA files only where those compiled: most failed ``load_inline`` builds fail in the
    host file (a function bound in ``functions`` but declared only in the CUDA source), and
    nvcc's compile, most of a build's CPU time, is then not spent (torch's ninja compiles both
    at once, and finishes the CUDA file after the host file failed). The build's result is the
    same; its error names the host file's errors alone where both files have some."""
    import torch.utils.cpp_extension as ext
    run = ext._run_ninja_build
    if getattr(run, "kfuzz_host_first", False):
        return

    def ordered(build_directory, verbose, error_prefix):
        try:
            with open(os.path.join(build_directory, "build.ninja")) as f:
                rules = f.read()
        except OSError:
            rules = ""
        hosts = [re.sub(r"\$(.)", r"\1", h) for h in _HOST_RULE.findall(rules)]
        if hosts and _CUDA_RULE.search(rules):
            _ninja_hosts(build_directory, verbose, error_prefix, hosts)
        return run(build_directory, verbose, error_prefix)
    ordered.kfuzz_host_first = True
    ext._run_ninja_build = ordered
