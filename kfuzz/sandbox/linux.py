"""The Linux interface that the sandbox's operating-system layers share: the C library
(``libc``), a raw system call that raises ``OSError`` (``syscall``), and what this machine is:
Linux (``LINUX``; elsewhere a worker gets only limits and names), on x86-64 (``X86_64``, the
one architecture the seccomp filter is written for).

Refuses nothing: a machine without a layer gets none, and ``confine`` reports it.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys

libc = ctypes.CDLL(None, use_errno=True)
LINUX = sys.platform.startswith("linux")     # the OS layers are Linux's; elsewhere only limits and names
X86_64 = LINUX and platform.machine() in ("x86_64", "AMD64")


def syscall(*args) -> int:
    r = libc.syscall(*args)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return r
