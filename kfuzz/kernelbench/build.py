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

Compile time. The build step precompiles nothing itself; it takes torch's header precompiled
by kfuzz's process (``pch``: ``use_pch`` where ``$KFUZZ_PCH`` names the headers' folder), and
compiles a CUDA file from a slimmed copy and only after the host files compiled
(``cuda_compile``: ``use_slim_cuda`` unless ``$KFUZZ_SLIM_CUDA`` is ``0``, ``host_first``).
"""
from __future__ import annotations

import ast
import hashlib
import inspect
import json
import os
import resource
import time

import torch

from kfuzz.kernelbench.cuda_compile import SLIM_ENV, SLIM_REFUSED, SLIM_USED, host_first, use_slim_cuda
from kfuzz.kernelbench.pch import PCH_ENV, PCH_USED, use_pch
from kfuzz.kernelbench.source import SEED, KernelBenchPair, pair_module, set_seed

_BUILDERS = ("load_inline", "load")
_LOADED: list[str] = []    # the extensions this process's build step built or found, and loaded


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
               "pch": PCH_USED[:], "slim": SLIM_USED[:], "slim_refused": SLIM_REFUSED[:],
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
