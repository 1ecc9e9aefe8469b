"""What a confined worker may read besides its own directories (``readable_paths``): the
system's libraries and a few of its files, the Python environment its code comes from
(``python_environment``), what its policy adds; and ``beneath``, whether a path lies beneath
one of some roots. Landlock's read rules and the audit hook's read check both take this list.

Refuses nothing itself (Landlock refuses a read outside, the audit hook names it). Leaves out
the data beside the code on ``sys.path``: a project's saved cases, an audit's results.
"""
from __future__ import annotations

import glob
import os
import sys

from kfuzz.sandbox.policy import Policy


def beneath(real: str, roots: list[str]) -> bool:
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


# what any worker reads: the system's libraries and tools, a few files of /etc, the CPU's and
# memory's description in /proc and /sys
_SYSTEM_READS = ("/usr", "/lib", "/lib64", "/bin", "/sbin", "/sys", "/etc/ld.so.cache", "/etc/ld.so.conf",
                 "/etc/ld.so.conf.d", "/etc/localtime", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf",
                 "/etc/os-release", "/etc/alternatives", "/proc/cpuinfo", "/proc/meminfo", "/proc/stat",
                 "/proc/filesystems", "/proc/sys", "/proc/driver", "/dev/null", "/dev/zero", "/dev/urandom",
                 "/dev/random")


def python_environment() -> list[str]:
    """Where this interpreter's code lives: its prefixes, site-packages, the directory of each
    package imported from elsewhere (a target's module), and what the other ``sys.path``
    entries hold for Python (package directories and modules; not the data beside them, such
    as a project's saved cases or an audit's results)."""
    import site
    found = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    try:
        found.update(site.getsitepackages())
        found.add(site.getusersitepackages())
    except AttributeError:
        pass
    roots = [os.path.realpath(p) for p in found if p]
    for name, module in list(sys.modules.items()):
        if "." in name:
            continue
        where = getattr(module, "__file__", None)
        if not where:
            continue
        where = os.path.realpath(where)
        if os.path.basename(where) == "__init__.py":
            where = os.path.dirname(where)
        if not beneath(where, roots):
            found.add(where)
    for entry in sys.path:
        entry = os.path.realpath(entry or os.getcwd())
        if not os.path.isdir(entry) or beneath(entry, roots):
            continue
        try:
            names = os.listdir(entry)
        except OSError:
            continue
        for name in names:
            path = os.path.join(entry, name)
            # code, and the metadata of installed distributions (entry points: the target registry)
            if name.endswith((".py", ".pyc", ".so", ".pth", ".egg-info", ".dist-info")) \
                    or os.path.isfile(os.path.join(path, "__init__.py")):
                found.add(path)
    return sorted(found)


def readable_paths(policy: Policy) -> list[str]:
    """What a confined worker may read besides the directories it may write."""
    paths = [*_SYSTEM_READS, *python_environment(), *policy.readable, *(policy.executable or ()),
             os.path.realpath("/proc/self")]
    paths += glob.glob("/usr/local/cuda*") + glob.glob("/dev/nvidia*") + ["/opt/nvidia"]
    if policy.processes:     # its children read their own /proc entries (kfuzz's and the zygote are not dumpable)
        paths.append("/proc")
    return [p for p in paths if os.path.exists(p)]

