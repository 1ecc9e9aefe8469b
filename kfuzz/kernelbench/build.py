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

A solution that names its own ``build_directory`` outside the cache builds and loads beneath
the cache instead (``in_cache``): where it chose to build is no escape, and no write
outside the cache is needed. A solution that names its extension or its folder anew in each
process (the time, the process id, a temporary folder) gets, in the kernel's worker, the name
and folder that the build step gave the same sources (``kfuzz-built/<digest>.json`` beneath
the cache, written by the build step): it loads what was built, or fails as its build failed.
A failed build's facts keep the compiler's message (its start, its error lines and its end,
``clip``; the build runs quietly so that torch puts that message in its error).

A build that fails is the solution's ``compile`` failure; what it tried against the
sandbox is a finding like any other (the audit records the build step's verdict).

Compile time. Every ``load_inline`` host file starts with ``#include <torch/extension.h>``,
most of its compile time. ``ensure_pch`` (kfuzz's own process, never a kernel's) precompiles
that header once per distinct host-compile flags into ``<root>/<key>/torch/extension.h.gch``
(``pch_key``: the compiler, torch's version and install, and the solution's ``extra_cflags``;
the header is compiled with the flags ninja gives the host file, less the extension's name),
with a copy of the header beside it; ``use_pch`` (in the build step) puts that folder first on
the host file's include path, where GCC takes the ``.gch`` in place of the header (and the copy
where a source includes the header again). A header whose flags
differ (``-O3`` against none) is ignored by GCC and the header compiled as usual: the
precompiled header changes the build's time, never its result. Torch's own ``use_pch=True``
is the solution's argument, and writes beside torch's headers: not used.

The CUDA file (``cuda.cu``, compiled by ``nvcc``) has no precompiled header: nvcc's front ends
see only preprocessed text. Most of its compile is spent parsing the torch headers that a
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
"""
from __future__ import annotations

import ast
import fcntl
import hashlib
import inspect
import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import tempfile
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


def _children_cpu() -> float:
    """User and system seconds of this process's ended children (the compilers a build ran)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def build_solution(pair: KernelBenchPair, device: str = "cpu") -> dict:
    """Build the solution's extensions here (untrusted code: call it in a confined worker).
    Facts: ``status`` (``built`` or ``failed``), ``error`` for a failure, ``seconds``,
    ``extensions`` (the folders beneath ``TORCH_EXTENSIONS_DIR``), ``pch`` (the extensions
    built with a precompiled header: ``$KFUZZ_PCH``, ``use_pch``), ``cpu_seconds`` (the CPU time
    of the processes the build started and waited for: ninja and the compilers), ``loaded`` (the extensions
    its calls loaded), and ``caught``: the errors of ``load_inline``/``load`` calls that the
    solution's own code caught (a solution that falls back to PyTorch when its extension does
    not build is ``built`` and runs its fallback: what the gates then judge is not its
    extension, ``fell_back``)."""
    start, cpu = time.monotonic(), _children_cpu()
    if os.environ.get(PCH_ENV):
        use_pch(os.environ[PCH_ENV])
    if os.environ.get(SLIM_ENV, "1") != "0":
        use_slim_cuda()
    host_first()
    raised = _record_build_errors()

    def facts(status: str, error: str | None = None) -> dict:
        root = os.environ.get("TORCH_EXTENSIONS_DIR")
        built = sorted(set(os.listdir(root)) - {BUILT}) if root and os.path.isdir(root) else []
        out = {"status": status, "seconds": round(time.monotonic() - start, 3),
               "cpu_seconds": round(_children_cpu() - cpu, 3), "extensions": built[:20],
               "pch": _PCH_USED[:], "slim": _SLIM_USED[:], "slim_refused": _SLIM_REFUSED[:],
               "loaded": _LOADED[:20]}
        if error is not None:
            out["error"] = clip(error, 2000)
        elif raised:
            out["caught"] = [clip(e, 1000) for e in raised[:5]]
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


def fell_back(build: dict | None) -> bool:
    """Whether the build step's facts say the solution caught an error of its own build and
    loaded no extension: what runs is its fallback (PyTorch), not an extension. Facts without
    ``loaded`` count every caught error."""
    build = build or {}
    return bool(build.get("caught")) and not build.get("loaded")


def clip(text: str, n: int) -> str:
    """``text`` cut to about ``n`` characters: its start (the command ninja ran), the compiler's
    first lines that say ``error`` (up to half of ``n``; ninja may print another command's long
    line after them), and its end."""
    if len(text) <= n:
        return text
    head = min(300, n // 4)
    errors = ""
    for line in text[head:].splitlines():
        if "error" in line.lower() and len(errors) + len(line) < n // 2:
            errors += line + "\n"
    tail = text[-(n - head - len(errors)):]
    errors = "".join(line + "\n" for line in errors.splitlines() if line not in tail)
    return f"{text[:head]} [...] {errors}[...] {tail}" if errors else f"{text[:head]} [...] {tail}"


def in_cache(build_directory):
    """A solution's own ``build_directory`` outside ``TORCH_EXTENSIONS_DIR`` (``~/.cache/
    torch_extensions``, ``/tmp/torch_extensions``), moved to a folder beneath it named by the
    path's hash (made if missing): where the build step may write and the kernel's workers
    read, the same folder in both. A folder already beneath it, or none given, stays as it is."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not build_directory or not root:
        return build_directory
    real, base = os.path.realpath(os.fspath(build_directory)), os.path.realpath(root)
    if real == base or real.startswith(base + os.sep):
        return build_directory
    moved = os.path.join(root, "build_directory-" + hashlib.sha256(real.encode()).hexdigest()[:16])
    if not os.path.isdir(moved):
        os.makedirs(moved, exist_ok=True)
    return moved


def _wrap_builders(raised: list[str] | None = None) -> None:
    """From now on in this process, ``load_inline`` and ``load`` build in a solution's own
    ``build_directory`` moved into the cache (``in_cache``); with ``raised``, they also build
    quietly (``verbose=False``: torch then puts the compiler's output in the error it raises,
    where ``verbose=True`` prints it) and append each error they raise to ``raised``. Installed
    before the solution's module runs, so that its ``from torch.utils.cpp_extension import
    load_inline`` binds these."""
    import torch.utils.cpp_extension as ext

    def wrapped(real):
        signature = inspect.signature(real)

        def call(*args, **kwargs):
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return real(*args, **kwargs)      # torch's own error for a call it does not take
            given = bound.arguments
            record = _built_path(real.__name__, given)
            built = _built_before(record)
            if built is not None:
                given["name"], given["build_directory"] = built
            else:
                if given.get("build_directory"):
                    given["build_directory"] = in_cache(given["build_directory"])
                if raised is not None:
                    _record_built(record, given)
            if raised is not None and given.get("verbose"):
                given["verbose"] = False
            try:
                module = real(*bound.args, **bound.kwargs)
            except Exception as e:
                if raised is not None:
                    raised.append(f"{type(e).__name__}: {e}")
                raise
            if raised is not None:
                _LOADED.append(given["name"])
            return module
        call.kfuzz_builder = real
        return call
    for name in _BUILDERS:
        real = getattr(ext, name)
        setattr(ext, name, wrapped(getattr(real, "kfuzz_builder", real)))


BUILT = "kfuzz-built"     # beneath TORCH_EXTENSIONS_DIR: a file a build call, named by its sources


def _sources_digest(builder: str, given: dict) -> str:
    """A digest of a ``load_inline``/``load`` call's arguments other than its extension's name
    and folder (``load``'s source files by their text): the same for the same extension built
    under another name (one made of the time, the process id, a temporary folder)."""
    args = {k: v for k, v in given.items() if k not in ("name", "build_directory", "verbose")}
    if builder == "load":
        paths = [args["sources"]] if isinstance(args.get("sources"), str) else list(args.get("sources") or [])
        texts = []
        for path in paths:
            try:
                with open(path, "rb") as f:
                    texts.append(hashlib.sha256(f.read()).hexdigest())
            except OSError:
                texts.append(str(path))
        args["sources"] = texts
    text = json.dumps([builder, args], sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _built_path(builder: str, given: dict) -> str | None:
    """Where the build step records the call's extension (beneath ``TORCH_EXTENSIONS_DIR``,
    named by ``_sources_digest``); None without that folder."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return os.path.join(root, BUILT, _sources_digest(builder, given) + ".json") if root else None


def _record_built(path: str | None, given: dict) -> None:
    """The build step: the call's extension name and folder, at ``path`` (``_built_path``); the
    first call of those sources kept."""
    import torch.utils.cpp_extension as ext
    if path is None or os.path.exists(path):
        return
    folder = given.get("build_directory") or ext._get_build_directory(given["name"], False)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".part", "w") as f:
        json.dump({"name": given["name"], "build_directory": os.fspath(folder)}, f)
    os.replace(path + ".part", path)


def _built_before(path: str | None) -> tuple[str, str] | None:
    """The name and folder that the build step gave a call of the same sources, where it
    recorded one at ``path`` (``_record_built``): a solution that names its extension anew in
    each process loads, in the kernel's worker, what the build step built (or fails as it
    failed there), and writes no new folder."""
    if path is None:
        return None
    try:
        with open(path) as f:
            built = json.load(f)
        return str(built["name"]), str(built["build_directory"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _record_build_errors() -> list[str]:
    """The errors that ``load_inline`` and ``load`` raise from now on in this process
    (``_wrap_builders``)."""
    raised: list[str] = []
    _wrap_builders(raised)
    return raised


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
    _wrap_builders()
    ext._write_ninja_file_and_build_library = _check_built
    ext.FileBaton = _NoLock


def compiles(code: str) -> bool:
    """A cheap static check: the solution builds an extension (``load_inline``, ``cpp_extension``)."""
    return "load_inline" in code or "cpp_extension" in code


# a precompiled torch/extension.h shared by the builds --------------------------------------------

PCH_ENV = "KFUZZ_PCH"     # the folder of precompiled headers the build step may use (set by the audit)
_PCH_USED: list[str] = []  # the extensions this process built with a precompiled header
_LOADED: list[str] = []    # the extensions this process's build step built or found, and loaded


def cflag_sets(code: str) -> list[tuple[str, ...]]:
    """The ``extra_cflags`` of the solution's ``load_inline`` calls, read statically (a literal
    list, empty flags dropped; none given is ``()``); a call whose flags are not a literal is left out."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        f = node.func if isinstance(node, ast.Call) else None
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name != "load_inline":
            continue
        flags: tuple[str, ...] | None = ()
        for kw in node.keywords:
            if kw.arg == "extra_cflags":
                try:
                    value = ast.literal_eval(kw.value)
                except ValueError:
                    flags = None
                    break
                flags = tuple(str(v) for v in value) if isinstance(value, (list, tuple)) else None
        if flags is not None:
            out.append(tuple(_normal(flags)))
    return list(dict.fromkeys(out))


def _normal(extra_cflags) -> list[str]:
    return [f.strip() for f in (extra_cflags or []) if f.strip()]


def host_flags(extra_cflags=()) -> tuple[str, list[str]]:
    """The compiler and the flags ninja gives a ``load_inline`` host file (``main.cpp``) with
    ``extra_cflags``, less the extension's name: read from the ninja file torch writes."""
    import torch.utils.cpp_extension as ext
    with tempfile.TemporaryDirectory(prefix="kfuzz-pch-") as d:
        path = os.path.join(d, "build.ninja")
        args = dict(path=path, name="kfuzz_pch", sources=[os.path.join(d, "main.cpp")],
                    extra_cflags=_normal(extra_cflags), extra_cuda_cflags=[], extra_sycl_cflags=[], extra_ldflags=[],
                    extra_include_paths=[], with_cuda=False, with_sycl=False, is_standalone=False)
        takes = inspect.signature(ext._write_ninja_file_to_build_library).parameters   # torch versions differ
        ext._write_ninja_file_to_build_library(**{k: v for k, v in args.items() if k in takes})
        with open(path) as f:
            line = next(x for x in f if x.startswith("cflags = "))
    flags = [a for a in shlex.split(line[len("cflags = "):]) if not a.startswith("-DTORCH_EXTENSION_NAME=")]
    return ext.get_cxx_compiler(), flags


def pch_key(extra_cflags=()) -> str:
    """The precompiled header's folder name for ``extra_cflags``: a hash of the compiler, torch's
    version and install, and the flags (empty ones dropped, as ninja's file shows them)."""
    import torch.utils.cpp_extension as ext
    text = "\0".join([ext.get_cxx_compiler(), torch.__version__, ext._TORCH_PATH, *_normal(extra_cflags)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _header() -> str:
    import torch.utils.cpp_extension as ext
    return os.path.join(ext._TORCH_PATH, "include", "torch", "extension.h")


def ensure_pch(root: str | os.PathLike, extra_cflags=(), timeout: float = 600.0) -> str | None:
    """``torch/extension.h`` precompiled for host files built with ``extra_cflags``, beneath
    ``root`` (once: concurrent callers wait for the first); the folder to put first on the
    include path, or None where it cannot be made (not GCC, the compiler failed). Trusted:
    kfuzz's process runs the compiler on torch's own header, never a solution's code."""
    import torch.utils.cpp_extension as ext
    if not ext.check_compiler_is_gcc(ext.get_cxx_compiler()):
        return None
    folder = os.path.join(os.fspath(root), pch_key(extra_cflags))
    target = os.path.join(folder, "torch", "extension.h.gch")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(os.path.join(folder, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        beside = os.path.join(folder, "torch", "extension.h")
        if not os.path.isfile(beside):
            # the header itself beside its .gch: a source that includes it a second time (its own
            # ``#include <torch/extension.h>`` after load_inline's) finds it in the folder where GCC
            # found the .gch, as GCC looks there and nowhere else once it has used one
            shutil.copyfile(_header(), beside + ".part")
            os.replace(beside + ".part", beside)
        if not os.path.isfile(target):
            if os.path.isfile(target + ".failed"):
                return None
            cxx, flags = host_flags(extra_cflags)
            part = target + f".{os.getpid()}.part"
            try:
                subprocess.run([cxx, "-x", "c++-header", *flags, _header(), "-o", part], check=True,
                               capture_output=True, timeout=timeout)
                os.replace(part, target)
            except (subprocess.SubprocessError, OSError) as e:
                with open(target + ".failed", "w") as f:
                    f.write(f"{type(e).__name__}: {getattr(e, 'stderr', b'') or e}"[:2000])
                return None
            finally:
                if os.path.exists(part):
                    os.remove(part)
    return folder


PENDING = "pending"   # in a header's folder while kfuzz's process is to make it (``mark_pending``)
PCH_WAIT = 300.0      # seconds a build waits for a header marked pending


def mark_pending(root: str | os.PathLike, extra_cflags=()) -> str:
    """Mark the header of ``extra_cflags`` beneath ``root`` as about to be made (a file
    ``pending`` in its folder, which the maker removes when it is made or has failed): a build
    that needs it waits for it (``use_pch``) instead of compiling torch's header itself.
    Returns the marker's path."""
    folder = os.path.join(os.fspath(root), pch_key(extra_cflags))
    os.makedirs(folder, exist_ok=True)
    marker = os.path.join(folder, PENDING)
    with open(marker, "w"):
        pass
    return marker


def use_pch(root: str | os.PathLike) -> None:
    """From now on in this process, a host file built with flags that have a precompiled header
    beneath ``root`` (``ensure_pch``) finds it first on its include path; where that header is
    marked pending (``mark_pending``), the build first waits for it, at most ``PCH_WAIT``
    seconds."""
    import torch.utils.cpp_extension as ext
    build = ext._write_ninja_file_and_build_library
    if getattr(build, "kfuzz_pch", None) is not None:
        return

    def with_pch(name, sources, extra_cflags, *args, **kwargs):
        args = list(args)
        folder = os.path.join(os.fspath(root), pch_key(extra_cflags))
        header = os.path.join(folder, "torch", "extension.h.gch")
        deadline = time.monotonic() + PCH_WAIT
        while not os.path.isfile(header) and os.path.isfile(os.path.join(folder, PENDING)) \
                and time.monotonic() < deadline:
            time.sleep(0.5)     # being made (``precompile_headers``): a build without it costs more
        if os.path.isfile(header):
            _PCH_USED.append(name)
            if "extra_include_paths" in kwargs:
                kwargs["extra_include_paths"] = [folder, *(kwargs["extra_include_paths"] or [])]
            elif len(args) >= 4:     # (extra_cuda_cflags, extra_sycl_cflags, extra_ldflags, extra_include_paths)
                args[3] = [folder, *(args[3] or [])]
        return build(name, sources, extra_cflags, *args, **kwargs)
    with_pch.kfuzz_pch = root
    with_pch.kfuzz_slim = getattr(build, "kfuzz_slim", False)
    ext._write_ninja_file_and_build_library = with_pch


# the CUDA file's torch includes, slimmed -----------------------------------------------------------

SLIM_ENV = "KFUZZ_SLIM_CUDA"   # "0": the build step compiles CUDA files as written
SLIM_SUFFIX = ".slim.cu"
_SLIM_USED: list[str] = []     # the extensions this process built from a slimmed CUDA file
_SLIM_REFUSED: list[str] = []  # those whose slimmed CUDA file did not compile (built as written)

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
                    _SLIM_USED.append(name)
                    raise
                _SLIM_REFUSED.append(name)  # a copy does not compile: the file as written decides
            else:
                _SLIM_USED.append(name)
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
