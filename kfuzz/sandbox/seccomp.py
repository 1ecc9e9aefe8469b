"""The system calls a confined worker may not make, and the privileges it gives up:
``seccomp_program`` assembles the x86-64 classic-BPF filter, ``apply_seccomp`` installs it on
every thread, ``drop_capabilities`` empties the capability sets.

Refuses, by killing the whole process (``SIGSYS``, which its parent sees: ``sandbox-syscall``):
namespaces, ptrace and other processes' memory, mounts, io_uring, keys and BPF always; sockets
without the network; without processes, fork, vfork, exec, a clone that is not a thread and a
signal to another process; with processes, a clone into new namespaces; x32 and foreign ABIs.
``clone3`` gets ``ENOSYS`` (glibc falls back to ``clone``, whose flags the filter reads).
"""
from __future__ import annotations

import ctypes
import errno
import os

from kfuzz.sandbox.linux import X86_64, syscall


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


# x86-64 system call numbers the filter names
_NR = dict(socket=41, connect=42, accept=43, bind=49, listen=50, socketpair=53, clone=56, fork=57, vfork=58,
           execve=59, kill=62, ptrace=101, rt_sigqueueinfo=129, pivot_root=155, chroot=161, mount=165,
           umount2=166, tkill=200, tgkill=234, add_key=248, request_key=249, keyctl=250, unshare=272,
           accept4=288, rt_tgsigqueueinfo=297, open_by_handle_at=304, setns=308, process_vm_readv=310,
           process_vm_writev=311, bpf=321, execveat=322, userfaultfd=323, pidfd_send_signal=424,
           io_uring_setup=425, io_uring_enter=426, io_uring_register=427, open_tree=428, move_mount=429,
           fsopen=430, fsconfig=431, fsmount=432, fspick=433, clone3=435, pidfd_getfd=438)
_ALWAYS = ("ptrace", "process_vm_readv", "process_vm_writev", "unshare", "setns", "pidfd_getfd", "mount", "umount2",
           "pivot_root", "chroot", "bpf", "userfaultfd", "keyctl", "add_key", "request_key", "open_by_handle_at",
           "io_uring_setup", "io_uring_enter", "io_uring_register", "open_tree", "move_mount", "fsopen",
           "fsconfig", "fsmount", "fspick")
_SOCKETS = ("socket", "socketpair", "connect", "bind", "listen", "accept", "accept4")
_SPAWN = ("fork", "vfork", "execve", "execveat", "tkill", "pidfd_send_signal")
_SELF_SIGNALS = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")    # the first argument: a pid
_CLONE_THREAD = 0x10000
_CLONE_NAMESPACES = 0x7E020080     # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
FORBIDDEN = "killed"    # what the filter does to a process that makes a forbidden call


def seccomp_program(processes: bool, network: bool, pid: int | None = None) -> list[tuple[int, int, int, int]]:
    """The x86-64 filter. It kills the whole process (``SIGSYS``, which its parent sees) on a
    forbidden call: namespaces, ptrace and other processes' memory, mounts, io_uring, keys,
    BPF; sockets unless ``network``; unless ``processes``, fork/vfork/exec, a clone that is not
    a thread, and a signal to any process but ``pid`` (this one). With ``processes``, a clone
    into new namespaces. ``clone3`` gets ENOSYS (glibc falls back to ``clone``, whose flags the
    filter can read); x32 and foreign ABIs are killed."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill, enosys = 0x7FFF0000, 0x80000000, 0x00050000 | errno.ENOSYS
    p: list[tuple] = [(ld, 4), (jeq, 0xC000003E, "native", "kill"), ("label", "native"),
                      (ld, 0), (jge, 0x40000000, "kill", "nr"), ("label", "nr")]
    names = list(_ALWAYS) + ([] if network else list(_SOCKETS)) + ([] if processes else list(_SPAWN))
    for i, name in enumerate(names):
        p += [(jeq, _NR[name], "kill", f"k{i}"), ("label", f"k{i}")]
    p += [(jeq, _NR["clone3"], "enosys", "c3"), ("label", "c3"), (jeq, _NR["clone"], "clone", "cl"), ("label", "cl")]
    if not processes and pid is not None:
        for name in _SELF_SIGNALS:
            p += [(jeq, _NR[name], "self", f"s{name}"), ("label", f"s{name}")]
    p += [(ret, allow)]
    p += [("label", "clone"), (ld, 16)]
    if processes:
        p += [(jset, _CLONE_NAMESPACES, "kill", "allow")]
    else:
        p += [(jset, _CLONE_THREAD, "allow", "kill")]
    if not processes and pid is not None:
        p += [("label", "self"), (ld, 16), (jeq, pid & 0xFFFFFFFF, "allow", "kill")]
    p += [("label", "allow"), (ret, allow), ("label", "kill"), (ret, kill), ("label", "enosys"), (ret, enosys)]
    return _bpf(p)


def apply_seccomp(processes: bool, network: bool) -> None:
    prog = seccomp_program(processes, network, os.getpid())
    arr = (_SockFilter * len(prog))(*[_SockFilter(*ins) for ins in prog])
    fprog = _SockFprog(len(prog), ctypes.cast(arr, ctypes.POINTER(_SockFilter)))
    # seccomp(SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, prog): every thread
    syscall(317, 1, 1, ctypes.byref(fprog))


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_capabilities() -> None:
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    syscall(126 if X86_64 else 91, ctypes.byref(header), data)   # capset
