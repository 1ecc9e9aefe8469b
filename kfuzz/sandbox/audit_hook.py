"""The Python audit hook of a confined worker (``Auditor``), and its record of the current
call. The hook names each Python-level attempt to leave the sandbox, reports it to kfuzz over
the violation channel (``kfuzz.sandbox.channel``) and raises ``SandboxViolation``;
``start_case`` clears the record before each case (and re-arms the per-case CPU limit),
``violation`` reads it. The record is this process's, which a kernel can clear: it lets a
worker end early, and kfuzz's verdict does not rest on it.

Refuses, as the policy says: starting processes (at all, past ``max_processes`` a call, or a
program outside ``Policy.executable``), sockets and the network, writes outside the writable
directories, reads outside the readable paths, a signal to another process, namespaces, and
libc's process, network, namespace and raw system calls looked up through ctypes. It only
names: what blocks an attempt is the operating system's layers, and an attempt made below
Python (C code, a system call by number) is theirs alone.
"""
from __future__ import annotations

import collections
import math
import os
import resource
import shutil
import subprocess
import sys

from kfuzz.sandbox.channel import tell
from kfuzz.sandbox.paths import beneath
from kfuzz.sandbox.policy import (FORK, NAMESPACE, NETWORK, READ, SIGNAL, SYSCALL, WRITE, Policy, SandboxViolation,
                                  toolchain)

_violations: list[tuple[str, str]] = []


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


class Auditor:
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
