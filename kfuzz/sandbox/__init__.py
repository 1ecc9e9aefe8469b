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

Where each part is, one a module:

- ``policy``: ``Policy``, what a kernel may use, and the names in a verdict (the violation
  and limit kinds, ``SandboxViolation``, ``resource_kind``, ``death_name``);
- ``namespaces``: ``isolate``, the init and the relay of a worker's PID namespace, and
  ``adopt_orphans``;
- ``confinement``: ``confine``, the limits and the layers applied in order, each reported;
- ``landlock``, ``seccomp`` (with the capabilities' drop), ``paths`` (what a worker may
  read), ``caches`` (the compile caches it may write): the parts ``confine`` applies;
- ``audit_hook``: the hook and its record of the current call (``start_case``,
  ``violation``);
- ``channel``: both ends of the violation channel (``tell``, ``Channel``);
- ``linux``: the C library and the system calls that the layers share.
"""
from kfuzz.sandbox.audit_hook import start_case, violation
from kfuzz.sandbox.caches import STUBS_ENV, build_driver_stubs, compile_cache
from kfuzz.sandbox.channel import Channel, tell
from kfuzz.sandbox.confinement import address_space, confine
from kfuzz.sandbox.landlock import landlock_abi
from kfuzz.sandbox.namespaces import ISOLATION_LEVELS, adopt_orphans, isolate
from kfuzz.sandbox.paths import python_environment, readable_paths
from kfuzz.sandbox.policy import (BUSY, CHANNEL, CPU, FILE_SIZE, FILES, FORK, MEMORY, NAMESPACE, NETWORK, READ,
                                  SIGNAL, SYSCALL, VIOLATIONS, WRITE, GiB, Policy, SandboxViolation, death_name,
                                  parse_size, resource_kind, toolchain)
from kfuzz.sandbox.seccomp import FORBIDDEN, seccomp_program

__all__ = ["BUSY", "CHANNEL", "CPU", "FILE_SIZE", "FILES", "FORBIDDEN", "FORK", "ISOLATION_LEVELS", "MEMORY",
           "NAMESPACE", "NETWORK", "READ", "SIGNAL", "STUBS_ENV", "SYSCALL", "VIOLATIONS", "WRITE", "Channel", "GiB",
           "Policy", "SandboxViolation", "address_space", "adopt_orphans", "build_driver_stubs", "compile_cache", "confine",
           "death_name", "isolate", "landlock_abi", "parse_size", "python_environment", "readable_paths",
           "resource_kind", "seccomp_program", "start_case", "tell", "toolchain", "violation"]
