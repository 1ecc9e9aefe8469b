"""torch's ``<torch/extension.h>`` precompiled once, for the host files of every ``load_inline`` build.

Every ``load_inline`` host file starts with ``#include <torch/extension.h>``, most of its compile
time. ``ensure_pch`` (kfuzz's own process, never a kernel's) precompiles that header once per
distinct host-compile flags into ``<root>/<key>/torch/extension.h.gch`` (``pch_key``: the compiler,
torch's version and install, and the solution's ``extra_cflags``, read statically by
``cflag_sets``; the header is compiled with the flags ninja gives the host file, less the
extension's name: ``host_flags``), with a copy of the header beside it; ``use_pch`` (in the build
step, ``build.build_solution`` where ``$KFUZZ_PCH`` names the folder) puts that folder first on
the host file's include path, where GCC takes the ``.gch`` in place of the header (and the copy
where a source includes the header again). A header about to be made is marked pending
(``mark_pending``), and a build that needs it waits for it, at most ``PCH_WAIT`` seconds. A
header whose flags differ (``-O3`` against none) is ignored by GCC and the header compiled as
usual: the precompiled header changes the build's time, never its result.

Refuses: a compiler other than GCC, and flags whose header does not compile (``ensure_pch``
returns None; a build then compiles torch's header itself). Torch's own ``use_pch=True`` is the
solution's argument, and writes beside torch's headers: not used.
"""
from __future__ import annotations

import ast
import fcntl
import hashlib
import inspect
import os
import shlex
import shutil
import subprocess
import tempfile
import time

import torch

PCH_ENV = "KFUZZ_PCH"     # the folder of precompiled headers the build step may use (set by the audit)
PCH_USED: list[str] = []  # the extensions this process built with a precompiled header


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
            PCH_USED.append(name)
            if "extra_include_paths" in kwargs:
                kwargs["extra_include_paths"] = [folder, *(kwargs["extra_include_paths"] or [])]
            elif len(args) >= 4:     # (extra_cuda_cflags, extra_sycl_cflags, extra_ldflags, extra_include_paths)
                args[3] = [folder, *(args[3] or [])]
        return build(name, sources, extra_cflags, *args, **kwargs)
    with_pch.kfuzz_pch = root
    with_pch.kfuzz_slim = getattr(build, "kfuzz_slim", False)
    ext._write_ninja_file_and_build_library = with_pch
