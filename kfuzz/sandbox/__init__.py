"""Confinement of a worker that runs an untrusted kernel: namespaces, resource limits, a
private directory, no network, no new processes, no reads or writes outside, and a verdict
that names the escape a kernel tried. docs/sandbox.md has the whole picture, per machine.

``isolate`` runs first in a worker, while it has one thread: a user, IPC, network and PID
namespace (the worker is the child of the namespace's init, so every process it starts dies
with it). ``confine`` runs once the worker's target is loaded, before the first case:

- limits: ``RLIMIT_AS`` (what the worker maps at confinement plus ``Policy.memory``; none on
  CUDA, whose driver reserves far more), ``RLIMIT_CPU`` per case, ``RLIMIT_NOFILE``,
  ``RLIMIT_FSIZE``, ``RLIMIT_CORE`` 0, and ``RLIMIT_NPROC`` where processes are allowed;
- Landlock: writes beneath the private directory and the compile cache only, reads of the
  Python environment and system files only, exec of ``Policy.executable`` only, TCP,
  signals and abstract sockets scoped (what the kernel's ABI has of these);
- a seccomp filter that kills the process (``SIGSYS``, seen by its parent) on a forbidden
  call: sockets, namespaces, ptrace, mounts, io_uring, and unless processes are allowed,
  fork/exec, a clone that is not a thread, a signal to another process;
- capabilities dropped, ``no_new_privs``;
- a Python audit hook that names the Python-level attempts and reports each to kfuzz over
  the worker's violation channel (``Channel``) before it raises ``SandboxViolation`` (a
  ``BaseException``): kfuzz's verdict rests on that channel and the exit status, never on
  this process's own record.

Refuses nothing at import: every layer that the running kernel does not allow is reported as
such by ``confine`` instead of failing the worker.
"""
from __future__ import annotations

import collections
import glob
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile

from kfuzz.sandbox.caches import STUBS_ENV, build_driver_stubs, compile_cache
from kfuzz.sandbox.channel import Channel, tell
from kfuzz.sandbox.landlock import (EXECUTE, IOCTL_DEV, READ_DIR, READ_FILE, REFER, TRUNCATE, WRITE_FILE,
                                    apply_landlock, landlock_abi)
from kfuzz.sandbox.linux import LINUX, X86_64, libc
from kfuzz.sandbox.namespaces import CLONE_NEWNET, ISOLATION_LEVELS, adopt_orphans, isolate, isolated
from kfuzz.sandbox.paths import beneath, python_environment, readable_paths
from kfuzz.sandbox.policy import (CHANNEL, CPU, FILE_SIZE, FILES, FORK, MEMORY, NAMESPACE, NETWORK, READ, SIGNAL,
                                  SYSCALL, VIOLATIONS, WRITE, GiB, Policy, SandboxViolation, death_name, parse_size,
                                  resource_kind, toolchain)
from kfuzz.sandbox.seccomp import FORBIDDEN, apply_seccomp, drop_capabilities, seccomp_program

__all__ = ["CHANNEL", "CPU", "FILE_SIZE", "FILES", "FORBIDDEN", "FORK", "ISOLATION_LEVELS", "MEMORY", "NAMESPACE",
           "NETWORK", "READ", "SIGNAL", "STUBS_ENV", "SYSCALL", "VIOLATIONS", "WRITE", "Channel", "GiB", "Policy",
           "SandboxViolation", "address_space", "adopt_orphans", "build_driver_stubs", "compile_cache", "confine",
           "death_name", "isolate", "landlock_abi", "parse_size", "python_environment", "readable_paths",
           "resource_kind", "seccomp_program", "start_case", "tell", "toolchain", "violation"]


_violations: list[tuple[str, str]] = []


# the Python-level guard -----------------------------------------------------------------------

_SPAWN_EVENTS = {"os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system",
                 "subprocess.Popen", "pty.spawn", "os.startfile"}
_NET_EVENTS = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
               "socket.gethostbyname", "socket.gethostbyaddr"}
_NS_EVENTS = {"os.unshare", "os.setns"}
# event -> positions of the paths it writes
_WRITE_EVENTS = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.mkdir": (0,),
                 "os.symlink": (1,), "os.link": (1,), "os.truncate": (0,), "os.chmod": (0,),
                 "os.chown": (0,), "os.utime": (0,), "shutil.rmtree": (0,)}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_LIBC_SPAWN = ("fork", "vfork", "clone", "clone3", "execve", "execv", "execvp", "system", "posix_spawn",
               "posix_spawnp", "popen")
_LIBC_NET = ("socket", "socketpair", "connect", "bind", "sendto", "getaddrinfo")
_LIBC_NS = ("unshare", "setns")
_LIBC_RAW = ("syscall", "ptrace", "process_vm_writev", "process_vm_readv", "kill", "tgkill", "pidfd_send_signal",
             "pidfd_getfd")


class _Auditor:
    """The audit hook of a confined worker (one per process; hooks cannot be removed). Each
    attempt it names goes to kfuzz over ``channel`` (a descriptor the worker was handed) the
    moment it happens, before the hook raises: a kernel that catches the exception, or clears
    this module's bookkeeping, cannot take it back."""

    def __init__(self, policy: Policy, writable: list[str], readable: list[str], channel: int | None):
        self.policy = policy
        self.writable = [os.path.realpath(p) for p in writable]
        self.readable = [os.path.realpath(p) for p in readable] + self.writable
        self.channel = channel
        self.pid = os.getpid()
        self.executable = None if policy.executable is None else [os.path.realpath(p) for p in policy.executable]
        self.tools = [os.path.realpath(p) for p in toolchain()] if policy.processes else []
        watched = {"open", "socket.__new__", "os.kill", "os.killpg", "ctypes.dlsym"} | _NET_EVENTS | _NS_EVENTS
        watched |= _SPAWN_EVENTS
        if policy.confine_writes:
            watched |= set(_WRITE_EVENTS)
        self.watched = frozenset(watched)

    def hook(self):
        """The audit hook: a closure, since it runs on every audit event of the process (a
        kernel's contract check reads functions' ``__code__``, one event each)."""
        watched, judge, record, channel = self.watched, self._judge, _violations.append, self.channel

        def audit(event: str, args: tuple) -> None:
            if event in watched:
                found = judge(event, args)
                if found is not None:
                    record(found)
                    if channel is not None and not _told[0]:   # the call's first attempt is its verdict
                        _told[0] = True
                        tell(channel, found)
                    raise SandboxViolation(*found)
        return audit

    def _judge(self, event: str, args: tuple) -> tuple[str, str] | None:
        if event in _SPAWN_EVENTS:
            if not self.policy.processes:
                return FORK, f"{event}{_short(args)}: a kernel may not start processes"
            return self._spawn(event, args)
        if event in _NS_EVENTS:
            return NAMESPACE, f"{event}{_short(args)}: a kernel may not enter or make namespaces"
        if event == "socket.__new__":
            family = args[1] if len(args) > 1 else None
            if not self.policy.network and family != -1:    # -1: an object around a descriptor it holds
                return NETWORK, f"socket({family!r}): a kernel may not open sockets"
            return None
        if event in _NET_EVENTS:
            if not self.policy.network:
                return NETWORK, f"{event}{_short(args)}: a kernel may not use the network"
            return None
        if event in ("os.kill", "os.killpg"):
            pid = args[0] if args else None
            if event == "os.killpg" or pid != self.pid:
                return SIGNAL, f"{event}{_short(args)}: a kernel may signal only itself"
            return None
        if event == "ctypes.dlsym":     # the lookup of a libc function through ctypes
            name = args[1] if len(args) > 1 else None
            if name in _LIBC_SPAWN and not self.policy.processes:
                return FORK, f"libc {name}() through ctypes: a kernel may not start processes"
            if name in _LIBC_NET and not self.policy.network:
                return NETWORK, f"libc {name}() through ctypes: a kernel may not use the network"
            if name in _LIBC_NS:
                return NAMESPACE, f"libc {name}() through ctypes: a kernel may not enter or make namespaces"
            if name in _LIBC_RAW:
                return SYSCALL, f"libc {name}() through ctypes: a kernel may not make raw system calls"
            return None
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                     (isinstance(flags, int) and flags & _WRITE_FLAGS)
            if not isinstance(path, (str, bytes, os.PathLike)):
                return None
            if writes and self.policy.confine_writes and not self.may_write(path):
                return WRITE, f"open {os.fsdecode(path)!r} for writing: a kernel may write only beneath its own directory"
            # a directory outside is not named (the import system lists every sys.path entry);
            # Landlock still refuses to list it
            if not writes and self.policy.confine_reads and not self.may_read(path) and not os.path.isdir(path):
                return READ, f"open {os.fsdecode(path)!r}: a kernel may read only its environment and its own directory"
            return None
        if not self.policy.confine_writes:
            return None
        for p in [args[i] for i in _WRITE_EVENTS[event] if i < len(args)]:
            if isinstance(p, (str, bytes, os.PathLike)) and not self.may_write(p):
                return WRITE, f"{event} {os.fsdecode(p)!r}: a kernel may write only beneath its own directory"
        return None

    def _spawn(self, event: str, args: tuple) -> tuple[str, str] | None:
        """A process start where processes are allowed: within their number (a start that runs
        a program of the toolchain, ``toolchain()``, is not counted), and exec only of what lies
        beneath ``policy.executable``."""
        name = _executable(event, args)
        real = None if name is None else os.path.realpath(name if os.sep in name else (shutil.which(name) or name))
        counted = _popen_pending[0] if event == "os.posix_spawn" else None
        _popen_pending[0] = real if event == "subprocess.Popen" else None
        if event in ("os.fork", "os.forkpty", "subprocess.Popen", "os.posix_spawn", "os.spawn", "os.system",
                     "pty.spawn") and not (real is not None and beneath(real, self.tools)) \
                and not (counted is not None and counted == real and _within_popen()):
            _spawned[real or "a fork"] += 1
            if _spawned.total() > self.policy.max_processes:
                started = ", ".join(f"{what} x{n}" for what, n in _spawned.most_common(3))
                return FORK, (f"{event}: more than {self.policy.max_processes} processes started in one call"
                              f" (most: {started})")
        if self.executable is not None and real is not None and not beneath(real, self.executable):
            return FORK, f"{event} {name!r}: a kernel may run only {len(self.executable)} allowed tools"
        return None

    def may_write(self, path) -> bool:
        real = os.path.realpath(os.fsdecode(path))
        return real == os.devnull or beneath(real, self.writable)

    def may_read(self, path) -> bool:
        return beneath(os.path.realpath(os.fsdecode(path)), self.readable)


_POPEN_SPAWN = getattr(getattr(subprocess.Popen, "_posix_spawn", None), "__code__", None)
_popen_pending: list = [None]     # the program of the last process-start event, if subprocess.Popen's


def _within_popen(depth: int = 8) -> bool:
    """Whether the ``os.posix_spawn`` being audited is subprocess's own (``Popen(close_fds=False)``
    starts its process so, right after its ``subprocess.Popen`` event has counted it, which
    ``_spawn`` checks too): its code object, taken when kfuzz imported this module, among the
    nearest callers."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code is _POPEN_SPAWN:
            return True
        frame = frame.f_back
    return False


def _executable(event: str, args: tuple) -> str | None:
    """The program a process-start audit event runs (None for a fork, or where not named)."""
    if event == "os.system":
        return "/bin/sh"
    if event not in ("subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn"):
        return None
    program = args[0] if args else None
    if event == "subprocess.Popen" and program is None and len(args) > 1:
        argv = args[1]
        program = argv if isinstance(argv, (str, bytes, os.PathLike)) else (argv[0] if argv else None)
    return os.fsdecode(program) if isinstance(program, (str, bytes, os.PathLike)) else None


_told = [False]    # whether the current call's first attempt went to kfuzz


def _short(args: tuple) -> str:
    return "(" + ", ".join(repr(a)[:60] for a in args[:3]) + ")"


# the operating system's layers ------------------------------------------------------------------

_PR_SET_NO_NEW_PRIVS = 38


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


def confine(policy: Policy, workdir: str, channel: int | None = None) -> dict[str, str]:
    """Confine this process (a worker) to ``policy``, its private ``workdir`` as cwd and
    TMPDIR; returns what each layer got, in words (layers the OS refuses say so). ``channel``:
    the descriptor on which the audit hook reports each attempt it names (``Channel``)."""
    report: dict[str, str] = {}
    os.chdir(workdir)
    os.environ["TMPDIR"] = tempfile.tempdir = workdir
    sys.dont_write_bytecode = True      # an import may not write __pycache__ outside
    report["directory"] = workdir
    report["isolation"] = "+".join(isolated) or "none"
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
        writable.append(compile_cache(workdir))
    readable = readable_paths(policy) if policy.confine_reads else ["/"]
    layers: dict[str, list[str]] = {"network": [], "writes": [], "reads": [], "processes": [], "signals": [],
                                    "namespaces": []}
    if policy.processes and "user" in isolated:
        # counted in the worker's own user namespace: its tasks (threads included) alone;
        # outside one it would count every process of the user, and of root none
        tasks = len(os.listdir("/proc/self/task")) + 2     # the relay and the init
        _limit(resource.RLIMIT_NPROC, tasks + policy.max_processes)
        report["process limit"] = f"RLIMIT_NPROC {tasks} tasks + {policy.max_processes}"
    if "network" in isolated:
        layers["network"].append("namespace")
    elif LINUX and not policy.network and libc.unshare(CLONE_NEWNET) == 0:
        layers["network"].append("namespace")
    if "pid" in isolated:
        layers["processes"].append("pid-namespace")
    # each layer on its own: one the kernel refuses leaves the others in place
    nnp = LINUX and policy.drop_privileges and libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0   # Landlock, seccomp
    abi = landlock_abi() if nnp else 0
    if abi and (policy.confine_writes or policy.confine_reads):
        full = (1 << 13) - 1 | REFER | TRUNCATE | IOCTL_DEV
        read = READ_FILE | READ_DIR
        handled = (full & ~read if not policy.confine_reads else full)
        if policy.processes and policy.executable is None:
            handled &= ~EXECUTE
        if not policy.confine_writes:
            handled &= read | EXECUTE
        rules = [(p, full) for p in writable] + [(os.devnull, read | WRITE_FILE | TRUNCATE)]
        rules += [(p, read) for p in readable]
        rules += [(p, WRITE_FILE | read | IOCTL_DEV) for p in glob.glob("/dev/nvidia*")]
        rules += [(p, read | EXECUTE) for p in policy.executable or ()] if policy.processes else []
        try:
            for what in apply_landlock(abi, rules, handled, policy.network):
                layers["network" if what == "tcp" else "processes" if what == "exec" else what].append(f"landlock-{abi}")
        except OSError as e:
            report["landlock"] = f"refused: {e}"
    if nnp and X86_64:
        try:
            apply_seccomp(policy.processes, policy.network)
            for key, allowed in (("processes", policy.processes), ("network", policy.network),
                                 ("signals", policy.processes), ("namespaces", False)):
                if not allowed:
                    layers[key].append("seccomp-kill")
        except OSError as e:
            report["seccomp"] = f"refused: {e}"
    if LINUX and policy.drop_privileges:
        try:
            drop_capabilities()
            report["capabilities"] = "dropped"
        except OSError as e:
            report["capabilities"] = f"kept ({e})"
    if policy.name_escapes:
        if channel is not None:
            os.set_blocking(channel, False)
        sys.addaudithook(_Auditor(policy, writable, readable, channel).hook())
    named = " and named" if policy.name_escapes else ""
    for key, allowed in (("network", policy.network), ("writes", not policy.confine_writes),
                         ("reads", not policy.confine_reads), ("processes", policy.processes),
                         ("signals", False), ("namespaces", False)):
        blocked = "+".join(layers[key])
        report[key] = "allowed" if allowed else (f"blocked ({blocked}){named}" if blocked else
                                                 "named, not blocked (no OS layer here)" if named else "not blocked")
    if policy.processes:
        execs = "of any program" if policy.executable is None else f"only of {len(policy.executable)} tools"
        tree = ", killed with the worker (pid-namespace)" if "pid" in isolated else ""
        report["processes"] = f"allowed: {policy.max_processes} at most, exec {execs}{tree}" + \
            ("" if policy.executable is None or abi else " (named only: no Landlock here)")
    return report


# each case ---------------------------------------------------------------------------------------

_cpu_soft = [0]    # the RLIMIT_CPU soft limit as last set
_spawned: collections.Counter = collections.Counter()   # processes the current call started, by program


def start_case(cpu_seconds: int | None) -> None:
    """No violation on record, and at least ``cpu_seconds`` of CPU time (at most twice that)
    before ``SIGXCPU``: re-arming the limit costs ~40 us, so it is re-armed only when less
    than one budget is left."""
    _violations.clear()
    _spawned.clear()
    _popen_pending[0] = None
    _told[0] = False
    if cpu_seconds:
        used = resource.getrusage(resource.RUSAGE_SELF)
        used = math.ceil(used.ru_utime + used.ru_stime)
        if _cpu_soft[0] - used < cpu_seconds:
            _cpu_soft[0] = used + 2 * int(cpu_seconds)
            resource.setrlimit(resource.RLIMIT_CPU, (_cpu_soft[0], resource.getrlimit(resource.RLIMIT_CPU)[1]))


def violation() -> tuple[str, str] | None:
    """The first escape the last call tried (even one the kernel caught), or None, as this
    process recorded it: what lets a worker end early. kfuzz's verdict does not rest on it
    (a kernel can clear it); it reads the worker's ``Channel``."""
    return _violations[0] if _violations else None
