"""The namespaces of a worker, and the processes that keep its tree: ``isolate`` makes a user,
IPC, network and PID namespace while the worker has one thread (``ISOLATION_LEVELS``, what it
tries, most first). The PID namespace's init reaps and ends with the worker, taking every
process left in the namespace with it; the worker's first process relays how the worker ended,
so that kfuzz sees a death by ``SIGSYS`` or ``SIGXCPU`` as such. ``adopt_orphans`` keeps the
processes a worker's tree orphans below it, with a PID namespace or without one.

Refuses nothing: a namespace the machine refuses is reported, not fatal (``isolate``'s
``namespaces`` entry).
"""
from __future__ import annotations

import os
import resource
import signal

from kfuzz.sandbox.linux import LINUX, libc
from kfuzz.sandbox.policy import Policy

CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWIPC = 0x10000000, 0x20000000, 0x08000000
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


isolated: list[str] = []     # the namespaces ``isolate`` made


ISOLATION_LEVELS = ("full", "no-user", "none")   # what ``isolate`` tries, most first


def isolate(policy: Policy, level: str = "full") -> dict[str, str]:
    """Namespaces for a worker, called first thing after its fork, while it has one thread:
    a user namespace of its own (root inside maps to the same user outside; nothing of the
    host's privileges; ``RLIMIT_NPROC`` then counts this worker's tasks alone, even for root),
    a network namespace without ``policy.network`` (no interface but a down loopback), an IPC
    namespace, and a PID namespace for the processes it starts, whose init (a child of the
    worker that only reaps) dies with the worker: the kernel then kills every process in the
    namespace, ``setsid`` descendants included. ``level``: ``no-user`` leaves out the user
    namespace (root can make the others without it), ``none`` makes none (a machine whose
    CUDA driver does not start inside them). What the machine refuses is reported, not
    fatal. Returns the report's ``namespaces`` entry."""
    if not LINUX or level == "none":
        isolated[:] = []
        return {"namespaces": "none"}
    got = []
    uid, gid = os.geteuid(), os.getegid()
    if level == "full":
        if uid == 0:     # pinned memory (CUDA) past the default limit needs no capability then
            try:
                resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            except (ValueError, OSError):
                pass
        if libc.unshare(_CLONE_NEWUSER) == 0:
            try:
                _write("/proc/self/setgroups", "deny")
                _write("/proc/self/uid_map", f"{uid} {uid} 1")
                _write("/proc/self/gid_map", f"{gid} {gid} 1")
                got.append("user")
            except OSError:
                got.append("user (unmapped)")
    if libc.unshare(_CLONE_NEWIPC) == 0:
        got.append("ipc")
    if not policy.network and libc.unshare(CLONE_NEWNET) == 0:
        got.append("network")
    if libc.unshare(_CLONE_NEWPID) == 0:
        # a thread may not be made once the process's children go to another PID namespace:
        # the worker itself must be inside it, and not as its init (whose signals, SIGXCPU and
        # its own included, the kernel drops): this process relays, a child is the init, and
        # the init's child goes on as the worker
        r, w = os.pipe()
        init = os.fork()
        if init != 0:
            os.close(w)
            _relay(r, init)
        os.close(r)
        worker = os.fork()
        if worker != 0:
            _init(w, worker)
        os.close(w)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        got.append("pid")
    isolated[:] = got
    return {"namespaces": "+".join(got) if got else "none (the machine refuses them)"}


_PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> None:
    """Make this process the parent of every process its descendants orphan (a ``setsid``
    grandchild whose parent has exited): a worker's processes then stay below it, where kfuzz
    looks for those that outlive a call, with a PID namespace or without one (a GPU whose
    driver does not start inside one, ``isolate``'s ``none``)."""
    if LINUX:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _keep_only(*fds: int) -> None:
    lo, top = 0, os.sysconf("SC_OPEN_MAX") if os.sysconf("SC_OPEN_MAX") > 0 else 1 << 20
    for fd in sorted(fds) + [top]:
        if fd > lo:
            os.closerange(lo, fd)
        lo = fd + 1


def _relay(status: int, init: int) -> None:
    """The worker as its parent (kfuzz's zygote) sees it: waits for the worker's status from
    the init of its PID namespace and ends the same way (the same exit code, or the same
    signal), so that a death by ``SIGSYS`` or ``SIGXCPU`` reaches kfuzz as such."""
    try:
        _keep_only(2, status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        got = b""
        while len(got) < 4:
            chunk = os.read(status, 4 - len(got))
            if not chunk:
                break
            got += chunk
        try:
            os.waitpid(init, 0)
        except ChildProcessError:
            pass
        if len(got) == 4:
            code = os.waitstatus_to_exitcode(int.from_bytes(got, "little", signed=True))
            if code < 0:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, set(signal.Signals))
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
                os._exit(128 - code)
            os._exit(code)
        os.kill(os.getpid(), signal.SIGKILL)    # the init was killed: so was the worker
    finally:
        os._exit(1)


def _init(status: int, worker: int) -> None:
    """The init of a worker's PID namespace: it reaps, reports the worker's status, and
    ends with it; its end kills every process left in the namespace. It dies with its parent."""
    try:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        libc.prctl(_PR_SET_NAME, b"kfuzz-init", 0, 0, 0)
        _keep_only(2, status)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        while True:
            while True:
                try:
                    pid, st = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    os._exit(0)
                if pid == 0:
                    break
                if pid == worker:
                    os.write(status, st.to_bytes(4, "little", signed=True))
                    os._exit(0)
            signal.sigwait({signal.SIGCHLD})
    finally:
        os._exit(0)
