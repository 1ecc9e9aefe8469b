"""``confine``: a worker confines itself once its target is loaded, before its first case, and
reports what each layer got. It takes its private directory as cwd and TMPDIR, sets the
resource limits (``RLIMIT_AS`` on top of what it maps then, ``address_space``), and applies,
each on its own, Landlock, the seccomp filter, the capabilities' drop and the audit hook, as
its policy and the machine allow.

Refuses nothing of its own: a layer that the machine refuses is reported (``refused: ...``,
``kept``), and the others stay in place.
"""
from __future__ import annotations

import glob
import os
import resource
import sys
import tempfile

from kfuzz.sandbox.audit_hook import Auditor
from kfuzz.sandbox.caches import compile_cache
from kfuzz.sandbox.landlock import (EXECUTE, IOCTL_DEV, READ_DIR, READ_FILE, REFER, TRUNCATE, WRITE_FILE,
                                    apply_landlock, landlock_abi)
from kfuzz.sandbox.linux import LINUX, X86_64, libc
from kfuzz.sandbox.namespaces import CLONE_NEWNET, isolated
from kfuzz.sandbox.paths import readable_paths
from kfuzz.sandbox.policy import GiB, Policy
from kfuzz.sandbox.seccomp import apply_seccomp, drop_capabilities

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
