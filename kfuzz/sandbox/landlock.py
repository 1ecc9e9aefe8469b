"""Landlock for a confined worker: the running kernel's ABI version (``landlock_abi``), and a
domain that restricts this process to rules of (path, rights) (``apply_landlock``; the rights,
``EXECUTE``, ``READ_FILE``, ..., are Landlock's), with TCP, signals and abstract sockets
scoped where the ABI has them. ``confine`` chooses the rules.

Refuses: once applied, whatever the domain handles and no rule grants, for this process and
every process it starts, for good. A kernel without Landlock has ABI 0 and gets no domain;
rights that the ABI lacks are left out, not failed.
"""
from __future__ import annotations

import ctypes
import os

from kfuzz.sandbox.linux import LINUX, syscall

_SYS_LANDLOCK_CREATE, _SYS_LANDLOCK_ADD, _SYS_LANDLOCK_RESTRICT = 444, 445, 446   # the same on every arch


def landlock_abi() -> int:
    """Landlock's ABI version on this kernel, 0 if it has none (the probe syscall 444)."""
    if not LINUX:
        return 0
    try:
        return syscall(_SYS_LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    except OSError:
        return 0


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_MAKE = sum(1 << b for b in range(4, 13))    # remove and make-* rights
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV   # what a rule on a file may carry


def apply_landlock(abi: int, rules: list[tuple[str, int]], handled: int, network: bool) -> list[str]:
    """A Landlock domain handling ``handled`` filesystem rights, granting each (path, rights)
    of ``rules`` (a path that does not exist is skipped), TCP if ``network`` is off, signals
    and abstract sockets scoped; returns what was restricted."""
    handled &= (1 << 13) - 1 | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0) | \
        (IOCTL_DEV if abi >= 5 else 0)
    net = 0b11 if abi >= 4 and not network else 0                       # bind and connect TCP
    scoped = 0b11 if abi >= 6 else 0                                    # abstract unix sockets, signals
    attr = _RulesetAttr(handled, net, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = syscall(_SYS_LANDLOCK_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    try:
        for path, rights in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                allowed = rights & handled & (_FILE_RIGHTS if not os.path.isdir(path) else ~0)
                if allowed:
                    syscall(_SYS_LANDLOCK_ADD, ruleset, 1, ctypes.byref(_PathBeneath(allowed, fd)), ctypes.c_uint32(0))
            finally:
                os.close(fd)
        syscall(_SYS_LANDLOCK_RESTRICT, ruleset, ctypes.c_uint32(0))
    finally:
        os.close(ruleset)
    return ["writes"] + (["reads"] if handled & READ_FILE else []) + (["exec"] if handled & EXECUTE else []) + \
        (["tcp"] if net else []) + (["signals"] if scoped else [])
