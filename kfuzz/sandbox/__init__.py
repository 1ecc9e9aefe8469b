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

import glob
import os
import resource
import sys
import tempfile

from kfuzz.sandbox.audit_hook import Auditor, start_case, violation
from kfuzz.sandbox.caches import STUBS_ENV, build_driver_stubs, compile_cache
from kfuzz.sandbox.channel import Channel, tell
from kfuzz.sandbox.landlock import (EXECUTE, IOCTL_DEV, READ_DIR, READ_FILE, REFER, TRUNCATE, WRITE_FILE,
                                    apply_landlock, landlock_abi)
from kfuzz.sandbox.linux import LINUX, X86_64, libc
from kfuzz.sandbox.namespaces import CLONE_NEWNET, ISOLATION_LEVELS, adopt_orphans, isolate, isolated
from kfuzz.sandbox.paths import python_environment, readable_paths
from kfuzz.sandbox.policy import (CHANNEL, CPU, FILE_SIZE, FILES, FORK, MEMORY, NAMESPACE, NETWORK, READ, SIGNAL,
                                  SYSCALL, VIOLATIONS, WRITE, GiB, Policy, SandboxViolation, death_name, parse_size,
                                  resource_kind, toolchain)
from kfuzz.sandbox.seccomp import FORBIDDEN, apply_seccomp, drop_capabilities, seccomp_program

__all__ = ["CHANNEL", "CPU", "FILE_SIZE", "FILES", "FORBIDDEN", "FORK", "ISOLATION_LEVELS", "MEMORY", "NAMESPACE",
           "NETWORK", "READ", "SIGNAL", "STUBS_ENV", "SYSCALL", "VIOLATIONS", "WRITE", "Channel", "GiB", "Policy",
           "SandboxViolation", "address_space", "adopt_orphans", "build_driver_stubs", "compile_cache", "confine",
           "death_name", "isolate", "landlock_abi", "parse_size", "python_environment", "readable_paths",
           "resource_kind", "seccomp_program", "start_case", "tell", "toolchain", "violation"]


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
        sys.addaudithook(Auditor(policy, writable, readable, channel).hook())
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
