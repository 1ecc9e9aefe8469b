"""What a confined worker's kernel may use, and the names of what it did instead.

``Policy`` is a worker's allowance: memory, CPU time a case, open files, file size, new
processes, the network, and the paths it may write, read and run (``Policy.for_device``, the
default for a device; ``toolchain``, the programs a CUDA worker or a build step runs;
``parse_size``, a size as the command line writes it). The names are a verdict's
``exc_type``: the violation kinds (``sandbox-*``, ``VIOLATIONS``), which ``SandboxViolation``
carries out of a kernel's call, and the limits' kinds (``resource-*``); ``resource_kind``
reads the resource an exception says ran out or is taken (``BUSY``: a GPU that says it is busy
or unavailable), ``death_name`` what a worker died of.

Refuses: a size ``parse_size`` cannot read, or one under 1 MiB (``ValueError``). Enforces
nothing: the other modules of ``kfuzz.sandbox`` do.
"""
from __future__ import annotations

import errno
import glob
import os
import re
import shutil
import signal
from dataclasses import dataclass, field

MEMORY, CPU, FILES, FILE_SIZE = "resource-memory", "resource-cpu", "resource-files", "resource-filesize"
BUSY = "resource-device-busy"   # a GPU that other processes hold: a state of the GPU that passes
FORK, WRITE, NETWORK, SIGNAL = "sandbox-fork", "sandbox-write", "sandbox-network", "sandbox-signal"
READ, NAMESPACE, SYSCALL, CHANNEL = "sandbox-read", "sandbox-namespace", "sandbox-syscall", "sandbox-channel"
VIOLATIONS = frozenset({FORK, WRITE, NETWORK, SIGNAL, READ, NAMESPACE, SYSCALL, CHANNEL})
GiB = 1 << 30


@dataclass(frozen=True)
class Policy:
    """What a worker's kernel may use. ``None`` is no limit; ``cpu_seconds`` is per case
    (``None``: the pool sets its timeout times the CPU count, a backstop)."""

    memory: int | None = 4 * GiB
    cpu_seconds: int | None = None
    open_files: int | None = 512
    file_size: int | None = 1 * GiB
    processes: bool = False
    # processes a call may start when ``processes`` allows any (the toolchain's not counted: a
    # JIT's autotuning runs a compiler per candidate), and tasks a worker may have at once beyond its own
    max_processes: int = 64
    network: bool = False
    confine_writes: bool = True
    confine_reads: bool = True       # Landlock: read only the Python environment, system files, own dirs
    # the audit hook that names escapes runs on every audit event of the process; a kernel
    # contract that reads many functions' ``__code__`` (one event each) pays for it
    name_escapes: bool = True
    drop_privileges: bool = True     # no_new_privs, and a root worker drops its capabilities
    writable: tuple[str, ...] = field(default=())   # more directories the kernel may write beneath
    readable: tuple[str, ...] = field(default=())   # more paths it may read
    # where it may exec from, when ``processes``: None is anywhere (a build's compilers)
    executable: tuple[str, ...] | None = None

    @classmethod
    def for_device(cls, device: str = "cpu", **overrides) -> "Policy":
        """The default policy for ``device``. On CUDA: no address-space limit (the driver
        reserves far more than any limit a user would set) and new processes allowed (Triton
        runs ptxas and the C compiler), bounded in number a call and none outliving it; the
        toolchain's folders are readable. Exec is not narrowed to the toolchain by default: a
        compiler installed as a wrapper under its own prefix (the H200 machine's /opt/gcc) was
        refused by Landlock's execute rule there; ``executable=toolchain()`` narrows it
        where the toolchain is known to be plain binaries."""
        base = {}
        if str(device).startswith("cuda"):
            base = dict(memory=None, processes=True, readable=toolchain())
        return cls(**{**base, **overrides})


def toolchain() -> tuple[str, ...]:
    """What a CUDA worker runs (Triton's bundled tools, ptxas, and the system's C
    compiler, with which Triton builds its launcher stubs) and what an extension's build step
    runs (the C++ compiler torch's ``cpp_extension`` picks, ``$CXX`` else ``c++``, and nvcc): no
    shell, no other program."""
    found = glob.glob("/usr/lib/gcc") + glob.glob("/usr/libexec/gcc") + glob.glob("/usr/local/cuda/bin/ptxas")
    for pattern in ("gcc*", "cc", "c++", "g++*", "x86_64-linux-gnu-*", "as", "ld", "ld.*", "clang*"):
        found += glob.glob(os.path.join("/usr/bin", pattern))
    # the compilers Triton and cpp_extension would pick (``CC``/``CXX``, else the first ``cc``/``c++``/
    # ``gcc``/``g++``/``clang`` on PATH), and, when one is installed under a prefix of its own
    # (/opt/gcc, where ``g++`` is a script its shell must read), that prefix: its cc1, as and ld
    for name in (os.environ.get("CC"), os.environ.get("CXX"), "cc", "c++", "gcc", "g++", "clang", "as", "ld", "nvcc"):
        where = shutil.which(name) if name else None
        if where:
            real = os.path.realpath(where)
            found += [where, real]
            prefix = os.path.dirname(os.path.dirname(real))
            if prefix not in ("/", "/usr", "/usr/local") and os.path.basename(os.path.dirname(real)) == "bin":
                found.append(prefix)
    try:
        import importlib.util
        spec = importlib.util.find_spec("triton")
        if spec is not None and spec.origin:
            tools = os.path.join(os.path.dirname(spec.origin), "backends")
            if os.path.isdir(tools):
                found.append(tools)
    except (ImportError, ValueError):
        pass
    return tuple(found)


def parse_size(text: str) -> int | None:
    """Bytes from ``4G``, ``512M``, ``1.5GiB`` or a plain number; ``none``/``0`` is no limit.
    Raises ValueError naming what it could not read."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t in ("none", "0", "off", "unlimited"):
        return None
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise ValueError(f"{text!r} is not a size (examples: 4G, 512M, none)") from None
    if value < 1 << 20:
        raise ValueError(f"{text!r} is under 1 MiB: no worker could even start")
    return int(value)


class SandboxViolation(BaseException):
    """A kernel tried to leave its sandbox; ``kind`` is the verdict's ``exc_type``."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


# a GPU's memory, as CUDA, its libraries and Triton's driver calls name its exhaustion
_DEVICE_OUT_OF_MEMORY = re.compile(r"CUDA out of memory|\[CUDA\]: out of memory|CUDA error: out of memory"
                                   r"|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY|CUBLAS_STATUS_ALLOC_FAILED")
# a GPU that says it is busy or unavailable (cudaErrorDevicesUnavailable, as torch and the driver
# give it): many processes creating their contexts on it at once
_DEVICE_BUSY = re.compile(r"busy or unavailable|cudaErrorDevicesUnavailable|CUDA_ERROR_DEVICE_UNAVAILABLE")


def resource_kind(exc_type: str | None, detail: str) -> str | None:
    """The resource an exception says ran out: memory (the host's or a GPU's), open files; or
    ``BUSY``, a GPU that says it is busy or unavailable; None otherwise."""
    if exc_type in ("MemoryError", "OutOfMemoryError", "_ArrayMemoryError") or "can't allocate memory" in detail \
            or "Cannot allocate memory" in detail or _DEVICE_OUT_OF_MEMORY.search(detail):
        return MEMORY
    if _DEVICE_BUSY.search(detail):
        return BUSY
    if "Too many open files" in detail or f"[Errno {errno.EMFILE}]" in detail:
        return FILES
    return None


_DEATHS = {signal.SIGXCPU: CPU, signal.SIGXFSZ: FILE_SIZE, signal.SIGSYS: SYSCALL}


def death_name(exitcode: int | None) -> str:
    """The ``exc_type`` of a worker that died: the limit it hit, else the signal or exit code."""
    if exitcode is None:
        return "unknown"
    if exitcode < 0:
        try:
            sig = signal.Signals(-exitcode)
        except ValueError:
            return f"signal-{-exitcode}"
        return _DEATHS.get(sig, sig.name)
    return f"exit-{exitcode}"
