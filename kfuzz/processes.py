"""The processes of a worker's tree, read from /proc: who is below a process, what each runs,
whether one still runs (the same process, not a later one given its pid), and a kill that
does not fail on a process already gone.

It reads /proc and sends SIGKILL, nothing more: it refuses to start, wait for or reap a
process (the zygote, ``kfuzz.launcher``, starts and reaps workers) and to judge what it finds
(a process a kernel left running is a verdict of ``kfuzz.workers``). Without the kernel's
``children`` files (``CONFIG_PROC_CHILDREN``) it scans every process's parent instead.
"""
from __future__ import annotations

import os
import signal


def _stat(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first: field 3), or
    None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:].split()


def _parents() -> dict[int, tuple[int, str]]:
    """Every live process's parent and state (a scan of /proc)."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat(name)
            if fields is not None and len(fields) > 1:
                found[int(name)] = (int(fields[1]), fields[0].decode())
    return found


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    return [p for p, (parent, _) in _parents().items() if parent == pid]


def _kids(pid: int) -> list[int] | None:
    """``pid``'s children from its threads' ``children`` files (None where the kernel has none)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    kids: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                kids += [int(k) for k in f.read().split()]
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue                  # the thread ended meanwhile
            return None                   # no CONFIG_PROC_CHILDREN
        except OSError:
            continue
    return kids


def _state(pid: int) -> str:
    fields = _stat(pid)
    return "X" if fields is None else fields[0].decode()


def started_at(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, field 22; with the pid, it names
    one process, not a later one given the same pid), or None when it is gone."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def running(pid: int, started: int | None) -> bool:
    """Whether process ``pid`` that started at ``started`` (``started_at``) still runs: not gone,
    not a zombie, not a later process given the same pid."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in (b"Z", b"X") and int(fields[19]) == started


WALKS = 4     # walks of the children files that may disagree before the whole table is scanned


def _walk(pid: int) -> tuple[list[int], list[int]] | None:
    """Every process met below ``pid`` through the ``children`` files, and the live ones among
    them; None without those files."""
    met, below, todo = [], [], [pid]
    while todo:
        kids = _kids(todo.pop())
        if kids is None:
            return None
        todo += kids
        met += kids
        below += [k for k in kids if _state(k) not in "ZX"]
    return met, below


def descendants(pid: int, scan: bool = False) -> list[int]:
    """The live (not zombie) processes below ``pid`` in the process tree: from the processes'
    ``children`` files (a few reads), or with ``scan`` (or without those files) from a scan of
    every process's parent. The files are read one process at a time, so a walk can miss a
    process moved while it ran (a grandchild handed to ``pid`` as its parent exits after its
    list was read): walks repeat until two meet the same processes, else the table is scanned."""
    if not scan:
        last = None
        for _ in range(WALKS):
            got = _walk(pid)
            if got is None:
                break
            if got == last:
                return got[1]
            last = got
    tree = _parents()
    below, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for p, (pp, state) in tree.items():
            if pp == parent:
                todo.append(p)
                if state != "Z":
                    below.append(p)
    return below


def command(pid: int) -> str:
    """What process ``pid`` runs, for a message: its command line, else its name."""
    for name, sep in (("cmdline", b" "), ("comm", b"")):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                text = f.read().replace(b"\0", sep).strip()
        except OSError:
            continue
        if text:
            return text.decode(errors="replace")[:120]
    return "?"


def kill(pid: int) -> None:
    """SIGKILL to process ``pid``; nothing when it is gone or not this user's."""
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
