"""Confinement of a worker that runs an untrusted kernel: resource limits, a private
directory, no network, no new processes, no writes outside, and a verdict that names
the escape a kernel tried.

``confine`` is applied once in a worker process, after its target is loaded and before
the first case; ``start_case`` and ``violation`` bracket each call. What each layer
does, and where the operating system cannot do it:

- memory: ``RLIMIT_AS`` (address space), set to what the worker maps at confinement
  (torch, the target) plus ``Policy.memory``: the limit is on what the kernel adds. (An
  absolute 4 GiB failed on the H200 machine, whose torch build maps its CUDA libraries even
  in a CPU run: the worker could not start a thread.) An allocation past it fails inside
  the call and the case is a ``crash`` with ``exc_type`` ``resource-memory``. Not on CUDA:
  the driver reserves far more address space than any limit a user would set;
- CPU time: ``RLIMIT_CPU``, a budget for each case (at least the limit, at most twice);
  the kernel gets ``SIGXCPU`` (``resource-cpu``). The parent's wall-clock timeout stays
  the backstop;
- open files, file size, core dumps: ``RLIMIT_NOFILE`` (``resource-files``),
  ``RLIMIT_FSIZE`` (``resource-filesize``), ``RLIMIT_CORE`` 0;
- a private directory, made by the parent, is the cwd and ``TMPDIR``;
- network: a new network namespace where permitted (root), a Landlock TCP rule
  (ABI >= 4), and a seccomp filter that lets ``socket`` create only Unix sockets
  (``sandbox-network``);
- processes: a seccomp filter refuses fork, vfork, exec and every clone that is not a
  thread (``sandbox-fork``). ``RLIMIT_NPROC`` is no use here: it counts per user, and
  the kernel ignores it for root, whatever the capabilities;
- writes: Landlock (ABI >= 1) allows writing beneath the private directory, the Triton
  cache and /dev/null only (``sandbox-write``); without Landlock writes are detected
  (Python-level), not blocked;
- signals: Landlock's scope (ABI >= 6) stops the kernel from signalling kfuzz;
- capabilities: a root worker drops them all, so that it can lift none of its hard
  limits (``CAP_SYS_RESOURCE``) nor leave its namespace; ``no_new_privs`` is set.

The operating system blocks; a Python audit hook names. The hook sees the Python-level
attempt (``os.fork``, ``subprocess``, ``socket``, ``open`` for writing, ``os.kill``, and
libc's fork/socket/... looked up through ctypes), records it and raises ``SandboxViolation``,
a ``BaseException`` so that a kernel's ``except Exception`` fallback does not swallow it;
a record the kernel swallows anyway still ends the case. A kernel that calls the system
directly is blocked without a name (it sees ``EPERM``). On CUDA the path is permissive,
untested here: limits on open files, file size and CPU time, the private directory and
signals named; no memory, fork, network or write confinement and no privileges dropped
(the driver's address space, Triton's ptxas, the driver's and Triton's caches, the
driver's setuid helper).

Refuses nothing at import: every layer that the running kernel does not allow is
reported as such by ``confine`` instead of failing the worker.
"""
from __future__ import annotations

import ctypes
import errno
import math
import os
import platform
import resource
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass, field

MEMORY, CPU, FILES, FILE_SIZE = "resource-memory", "resource-cpu", "resource-files", "resource-filesize"
FORK, WRITE, NETWORK, SIGNAL = "sandbox-fork", "sandbox-write", "sandbox-network", "sandbox-signal"
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
    network: bool = False
    confine_writes: bool = True
    # the audit hook that names escapes runs on every audit event of the process; a kernel
    # contract that reads many functions' ``__code__`` (one event each) pays for it
    name_escapes: bool = True
    drop_privileges: bool = True     # no_new_privs, and a root worker drops its capabilities
    writable: tuple[str, ...] = field(default=())   # more directories the kernel may write beneath

    @classmethod
    def for_device(cls, device: str = "cpu", **overrides) -> "Policy":
        """The default policy for ``device``; on CUDA permissive (see the module docstring)."""
        base = {}
        if str(device).startswith("cuda"):
            # the driver may need setuid helpers (nvidia-modprobe) and its device files
            base = dict(memory=None, processes=True, network=True, confine_writes=False, drop_privileges=False)
        return cls(**{**base, **overrides})


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


_violations: list[tuple[str, str]] = []


# the Python-level guard -----------------------------------------------------------------------

_SPAWN_EVENTS = {"os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system",
                 "subprocess.Popen", "pty.spawn", "os.startfile"}
_NET_EVENTS = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
               "socket.gethostbyname", "socket.gethostbyaddr"}
# event -> positions of the paths it writes
_WRITE_EVENTS = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.mkdir": (0,),
                 "os.symlink": (1,), "os.link": (1,), "os.truncate": (0,), "os.chmod": (0,),
                 "os.chown": (0,), "os.utime": (0,), "shutil.rmtree": (0,)}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_LIBC_SPAWN = ("fork", "vfork", "clone", "clone3", "execve", "execv", "execvp", "system", "posix_spawn",
               "posix_spawnp", "popen")
_LIBC_NET = ("socket", "connect", "bind", "sendto", "getaddrinfo")


class _Auditor:
    """The audit hook of a confined worker (one per process; hooks cannot be removed)."""

    def __init__(self, policy: Policy, writable: list[str]):
        self.policy = policy
        self.writable = [os.path.realpath(p) for p in writable]
        self.pid = os.getpid()
        watched = {"open", "socket.__new__", "os.kill", "os.killpg", "ctypes.dlsym"} | _NET_EVENTS
        if not policy.processes:
            watched |= _SPAWN_EVENTS
        if policy.confine_writes:
            watched |= set(_WRITE_EVENTS)
        self.watched = frozenset(watched)

    def hook(self):
        """The audit hook: a closure, since it runs on every audit event of the process (a
        kernel's contract check reads functions' ``__code__``, one event each)."""
        watched, judge, record = self.watched, self._judge, _violations.append

        def audit(event: str, args: tuple) -> None:
            if event in watched:
                found = judge(event, args)
                if found is not None:
                    record(found)
                    raise SandboxViolation(*found)
        return audit

    def _judge(self, event: str, args: tuple) -> tuple[str, str] | None:
        if event in _SPAWN_EVENTS:
            return FORK, f"{event}{_short(args)}: a kernel may not start processes"
        if event == "socket.__new__":
            family = args[1] if len(args) > 1 else None
            if not self.policy.network and family not in (socket.AF_UNIX, -1):
                return NETWORK, f"socket({family!r}): a kernel may not use the network"
            return None
        if event in _NET_EVENTS:
            if not self.policy.network and (event.startswith("socket.get") or _is_inet(args)):
                return NETWORK, f"{event}{_short(args)}: a kernel may not use the network"
            return None
        if event in ("os.kill", "os.killpg"):
            pid = args[0] if args else None
            if event == "os.killpg" or pid not in (self.pid, 0):
                return SIGNAL, f"{event}{_short(args)}: a kernel may signal only itself"
            return None
        if event == "ctypes.dlsym":     # the lookup of a libc function through ctypes
            name = args[1] if len(args) > 1 else None
            if name in _LIBC_SPAWN and not self.policy.processes:
                return FORK, f"libc {name}() through ctypes: a kernel may not start processes"
            if name in _LIBC_NET and not self.policy.network:
                return NETWORK, f"libc {name}() through ctypes: a kernel may not use the network"
            return None
        if not self.policy.confine_writes:
            return None
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                     (isinstance(flags, int) and flags & _WRITE_FLAGS)
            paths = [path] if writes else []
        else:
            paths = [args[i] for i in _WRITE_EVENTS[event] if i < len(args)]
        for p in paths:
            if isinstance(p, (str, bytes, os.PathLike)) and not self.may_write(p):
                return WRITE, f"{event} {os.fsdecode(p)!r}: a kernel may write only beneath its own directory"
        return None

    def may_write(self, path) -> bool:
        real = os.path.realpath(os.fsdecode(path))
        return real == os.devnull or any(real == w or real.startswith(w + os.sep) for w in self.writable)


def _short(args: tuple) -> str:
    return "(" + ", ".join(repr(a)[:60] for a in args[:3]) + ")"


def _is_inet(args: tuple) -> bool:
    return any(isinstance(a, tuple) and a and isinstance(a[0], (str, bytes)) for a in args[1:2])


# the operating system's layers ------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_LINUX = sys.platform.startswith("linux")     # the OS layers are Linux's; elsewhere only limits and names
_X86_64 = _LINUX and platform.machine() in ("x86_64", "AMD64")
_SYS_LANDLOCK_CREATE, _SYS_LANDLOCK_ADD, _SYS_LANDLOCK_RESTRICT = 444, 445, 446   # the same on every arch
_PR_SET_NO_NEW_PRIVS, _CLONE_NEWNET = 38, 0x40000000


def _syscall(*args) -> int:
    r = _libc.syscall(*args)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return r


def landlock_abi() -> int:
    """Landlock's ABI version on this kernel, 0 if it has none (the probe syscall 444)."""
    if not _LINUX:
        return 0
    try:
        return _syscall(_SYS_LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    except OSError:
        return 0


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _landlock(abi: int, writable: list[str], network: bool) -> list[str]:
    """Restrict writes to ``writable`` (and /dev/null), TCP if ``network`` is off, signals
    to kfuzz; returns what was restricted."""
    write_file, truncate = 1 << 1, 1 << 14
    fs = sum(1 << b for b in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))     # write, remove, make-*
    fs |= (1 << 13 if abi >= 2 else 0) | (truncate if abi >= 3 else 0)   # refer, truncate
    net = 0b11 if abi >= 4 and not network else 0                       # bind and connect TCP
    scoped = 0b11 if abi >= 6 else 0                                    # abstract unix sockets, signals
    attr = _RulesetAttr(fs, net, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = _syscall(_SYS_LANDLOCK_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    try:
        for path, rights in [(p, fs) for p in writable] + [(os.devnull, (write_file | truncate) & fs)]:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneath(rights, fd)
                _syscall(_SYS_LANDLOCK_ADD, ruleset, 1, ctypes.byref(rule), ctypes.c_uint32(0))
            finally:
                os.close(fd)
        _syscall(_SYS_LANDLOCK_RESTRICT, ruleset, ctypes.c_uint32(0))
    finally:
        os.close(ruleset)
    return ["writes"] + (["tcp"] if net else []) + (["signals"] if scoped else [])


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _bpf(program: list[tuple]) -> list[tuple[int, int, int, int]]:
    """Assemble (code, k, true-label, false-label) and ("label", name) entries into
    (code, jt, jf, k)-ordered tuples; jumps are relative and forward, labels become offsets."""
    where, n = {}, 0
    for ins in program:
        if ins[0] == "label":
            where[ins[1]] = n
        else:
            n += 1
    out, i = [], 0
    for ins in program:
        if ins[0] == "label":
            continue
        code, k, jt, jf = (tuple(ins) + (None, None))[:4]
        jumps = [where[j] - i - 1 if j else 0 for j in (jt, jf)]
        assert all(0 <= j < 256 for j in jumps), "classic BPF jumps forward only, by less than 256"
        out.append((code, *jumps, k))
        i += 1
    return out


def seccomp_program(processes: bool, network: bool) -> list[tuple[int, int, int, int]]:
    """The x86-64 filter: refuse starting processes and/or non-Unix sockets with EPERM."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    p: list[tuple] = [(ld, 4), (jeq, 0xC000003E, "native", "deny"), ("label", "native"),
                      (ld, 0), (jge, 0x40000000, "deny", "nr")]   # x32 and foreign ABIs are refused
    p.append(("label", "nr"))
    if not processes:
        for nr in (57, 58, 59, 322):                      # fork, vfork, execve, execveat
            p += [(jeq, nr, "deny", f"n{nr}"), ("label", f"n{nr}")]
        p += [(jeq, 435, "enosys", "c3"), ("label", "c3"),       # clone3: glibc falls back to clone
              (jeq, 56, "clone", "c")]
        p.append(("label", "c"))
    if not network:
        p += [(jeq, 41, "socket", "s"), ("label", "s"), (jeq, 425, "deny", "u"), ("label", "u")]  # io_uring
    p += [(jeq, 101, "deny", "p"), ("label", "p"), (jeq, 311, "deny", "allow")]   # ptrace, process_vm_writev
    p += [("label", "clone"), (ld, 16), (jset, 0x10000, "allow", "deny"),       # CLONE_THREAD: a thread
          ("label", "socket"), (ld, 16), (jeq, socket.AF_UNIX, "allow", "deny"),
          ("label", "allow"), (ret, allow), ("label", "deny"), (ret, eperm), ("label", "enosys"), (ret, enosys)]
    return _bpf(p)


def _seccomp(processes: bool, network: bool) -> None:
    prog = seccomp_program(processes, network)
    arr = (_SockFilter * len(prog))(*[_SockFilter(*ins) for ins in prog])
    fprog = _SockFprog(len(prog), ctypes.cast(arr, ctypes.POINTER(_SockFilter)))
    # seccomp(SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, prog): every thread
    _syscall(317, 1, 1, ctypes.byref(fprog))


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities() -> None:
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    _syscall(126 if _X86_64 else 91, ctypes.byref(header), data)   # capset


def _limit(which: int, value: int | None) -> None:
    if value is None:
        return
    soft, hard = resource.getrlimit(which)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (value, value))


def address_space() -> int:
    """Bytes of address space this process maps now (``VmSize``); 0 where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def triton_cache_dir() -> str:
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton")


def confine(policy: Policy, workdir: str) -> dict[str, str]:
    """Confine this process (a worker) to ``policy``, its private ``workdir`` as cwd and
    TMPDIR; returns what each layer got, in words (layers the OS refuses say so)."""
    report: dict[str, str] = {}
    os.chdir(workdir)
    os.environ["TMPDIR"] = tempfile.tempdir = workdir
    sys.dont_write_bytecode = True      # an import may not write __pycache__ outside
    report["directory"] = workdir
    mapped = address_space()
    _limit(resource.RLIMIT_AS, policy.memory and mapped + policy.memory)
    _limit(resource.RLIMIT_NOFILE, policy.open_files)
    _limit(resource.RLIMIT_FSIZE, policy.file_size)
    _limit(resource.RLIMIT_CORE, 0)
    report["memory"] = (f"RLIMIT_AS {mapped / GiB:.2f} GiB mapped + {policy.memory / GiB:g} GiB"
                        if policy.memory else "no limit")
    report["files"] = f"RLIMIT_NOFILE {policy.open_files}, RLIMIT_FSIZE " + \
        (f"{policy.file_size / GiB:g} GiB" if policy.file_size else "none")
    writable = [workdir, *(p for p in policy.writable if os.path.isdir(p))]
    if policy.confine_writes:
        try:
            os.makedirs(triton_cache_dir(), exist_ok=True)   # Triton creates it on first use
            writable.append(triton_cache_dir())
        except OSError:
            pass
    layers: dict[str, list[str]] = {"network": [], "writes": [], "processes": [], "signals": []}
    if _LINUX and not policy.network and _libc.unshare(_CLONE_NEWNET) == 0:
        layers["network"].append("namespace")
    # each layer on its own: one the kernel refuses leaves the others in place
    nnp = _LINUX and policy.drop_privileges and _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0   # Landlock, seccomp
    abi = landlock_abi() if nnp else 0
    if abi and policy.confine_writes:
        try:
            for what in _landlock(abi, writable, policy.network):
                layers["network" if what == "tcp" else what].append(f"landlock-{abi}")
        except OSError as e:
            report["landlock"] = f"refused: {e}"
    if nnp and _X86_64 and not (policy.processes and policy.network):
        try:
            _seccomp(policy.processes, policy.network)
            for key, allowed in (("processes", policy.processes), ("network", policy.network)):
                if not allowed:
                    layers[key].append("seccomp")
        except OSError as e:
            report["seccomp"] = f"refused: {e}"
    if _LINUX and policy.drop_privileges and os.geteuid() == 0:
        try:
            _drop_capabilities()
            report["capabilities"] = "dropped (root)"
        except OSError as e:
            report["capabilities"] = f"kept ({e})"
    if policy.name_escapes:
        sys.addaudithook(_Auditor(policy, writable).hook())
    named = " and named" if policy.name_escapes else ""
    for key, allowed in (("network", policy.network), ("writes", not policy.confine_writes),
                         ("processes", policy.processes), ("signals", False)):
        blocked = "+".join(layers[key])
        report[key] = "allowed" if allowed else (f"blocked ({blocked}){named}" if blocked else
                                                 "named, not blocked (no OS layer here)" if named else "not blocked")
    return report


# each case ---------------------------------------------------------------------------------------

_cpu_soft = [0]    # the RLIMIT_CPU soft limit as last set


def start_case(cpu_seconds: int | None) -> None:
    """No violation on record, and at least ``cpu_seconds`` of CPU time (at most twice that)
    before ``SIGXCPU``: re-arming the limit costs ~40 us, so it is re-armed only when less
    than one budget is left."""
    _violations.clear()
    if cpu_seconds:
        used = resource.getrusage(resource.RUSAGE_SELF)
        used = math.ceil(used.ru_utime + used.ru_stime)
        if _cpu_soft[0] - used < cpu_seconds:
            _cpu_soft[0] = used + 2 * int(cpu_seconds)
            resource.setrlimit(resource.RLIMIT_CPU, (_cpu_soft[0], resource.getrlimit(resource.RLIMIT_CPU)[1]))


def violation() -> tuple[str, str] | None:
    """The first escape the last call tried (even one the kernel caught), or None."""
    return _violations[0] if _violations else None


def resource_kind(exc_type: str | None, detail: str) -> str | None:
    """The resource an exception says ran out: memory, open files; None otherwise."""
    if exc_type in ("MemoryError", "OutOfMemoryError", "_ArrayMemoryError") or "can't allocate memory" in detail \
            or "Cannot allocate memory" in detail:
        return MEMORY
    if "Too many open files" in detail or f"[Errno {errno.EMFILE}]" in detail:
        return FILES
    return None


_DEATHS = {signal.SIGXCPU: CPU, signal.SIGXFSZ: FILE_SIZE}


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
