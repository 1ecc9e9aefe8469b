"""Sandboxed execution: the kernel runs in spawned worker processes, the oracle in kfuzz's.

A worker is forked by kfuzz's zygote (``kfuzz.launcher``): a fresh process, itself
exec'd, that imports torch and kfuzz once, never a target's module, and never touches
CUDA; so no worker inherits a CUDA context or a target's import-time state, and a restart
after a crash costs a fork, not a torch import. The worker makes its namespaces, imports
its target itself, confines itself (``kfuzz.sandbox``: limits, a private directory, no
network, no new processes, no reads or writes outside), then answers one case at a time.
What it tried and the sandbox caught reaches kfuzz over its violation channel
(``sandbox.Channel``), or as its death by ``SIGSYS``; docs/sandbox.md has the details.

kfuzz's process materializes each case's inputs once: it sends their storage
bytes to the worker and keeps them for the judge. The worker sees the case's
target, dtype and dims, never its seed. It runs a kernel program
(``kfuzz.programs``: a campaign's case is the ``call`` program, a gate's several
calls another) and sends back the outputs as raw bytes, or the verdict that
already ends the program (exception, contract, mutation). The oracle and the
trusted implementation run in kfuzz's processes (``execute.judge``), so their
outputs never enter the kernel's process. The executors that drive workers,
queue programs on them and turn their deaths into verdicts are in ``kfuzz.executor``.

What kills or stalls a worker becomes a verdict and the campaign goes on with
a fresh worker:

- the worker dies (segfault, abort, ``os._exit``, the OOM killer): ``crash``,
  its ``exc_type`` the signal name (``SIGSEGV``), ``exit-N``, or the limit it
  hit (``resource-cpu``, ``resource-filesize``);
- no answer within ``timeout`` seconds: the worker is killed, ``timeout``; the
  seconds the case spent in JIT compiles (the worker's compile notes, capped:
  ``kfuzz.jit``) do not count;
- an escape the sandbox stopped, an allocation past the memory limit, a CUDA
  error or out-of-memory inside the call: ``crash`` with its ``exc_type``
  (``sandbox-write``, ``sandbox-syscall``, ``resource-memory``, ...), and the worker is
  replaced;
- an answer that is not one (a kernel can reach its worker's pipe): ``crash``,
  ``malformed-answer``. Answers are JSON and raw bytes, never pickles, and a worker
  may report only the failures of the call itself (never a pass: kfuzz judges).

``fork_server_here`` lets a short-lived process that starts workers (an audited
kernel's oracle process) fork its zygote from itself instead of importing torch again.

Harness coverage (``kfuzz.coverage``): on request a worker records the edges it
executes in the target's own source file, as engines' feedback.
"""
from __future__ import annotations

import importlib
import multiprocessing
import os
import shutil
import tempfile
import time
from multiprocessing.connection import Connection

import torch

from kfuzz import jit, launcher, processes, sandbox
from kfuzz.case import Case
from kfuzz.coverage import HarnessCoverage, harness_files
from kfuzz.errors import WorkerStartError
from kfuzz.jit import Credit
from kfuzz.target import load_target, prepare_triton
from kfuzz.wire import Outbox, geometry, pack, unpack

# what a worker may report itself; a pass (or any judged kind) comes only from kfuzz's judge
WORKER_VERDICTS = frozenset({"exception", "contract", "mutation", "crash"})
STARTUP_TIMEOUT = 600.0     # importing torch and Triton targets on a loaded machine is slow
FULL_SCAN_EVERY = 32       # answers between scans of every process for the kernel's (else its tree's
                           # `children` files, which the kernel does not promise to be a consistent
                           # snapshot while processes start and exit); the first answer is scanned
EXIT_GRACE = 0.25          # seconds a process the kernel started may take to exit after the call
DEATH_GRACE = 2.0          # seconds a worker whose channel closed after an answer may take to be seen dead


# the worker process ------------------------------------------------------------------------

CUDA_UNAVAILABLE = 75     # a worker's exit code: CUDA does not start inside its namespaces
DEVICE_FULL = 76          # a worker's exit code: CUDA did not start for want of the GPU's memory
DEVICE_BUSY = 77          # a worker's exit code: the GPU said it is busy or unavailable, for now
DEVICE_WAITS = (1.0, 2.0, 4.0, 8.0)   # seconds before each new start of a worker whose GPU was busy or full
_levels: dict[str, list[str]] = {}     # device kind -> the isolation levels still to try, best first


def isolation_level(device: str) -> str:
    """The namespaces a worker for ``device`` gets (``sandbox.isolate``): all of them, unless a
    CUDA worker of this process could not start CUDA inside them."""
    return _levels.setdefault(str(device).split(":")[0], list(sandbox.ISOLATION_LEVELS))[0]


def _isolation_failed(device: str, level: str) -> bool:
    """Give up ``level`` for ``device``; whether a lesser one is left to try."""
    levels = _levels.setdefault(str(device).split(":")[0], list(sandbox.ISOLATION_LEVELS))
    if level in levels and len(levels) > 1:
        levels.remove(level)
        return True
    return False


def start_failure(e: Exception, level: str) -> int | None:
    """The exit code of a worker whose CUDA did not start at isolation ``level`` with ``e``:
    ``DEVICE_FULL`` where the GPU's memory is taken, ``DEVICE_BUSY`` where the GPU says it is
    busy or unavailable (many processes creating their contexts at once: a state of the GPU
    that passes, started again at the same level), ``CUDA_UNAVAILABLE`` where fewer namespaces
    are left to try; None (the error itself) at the last level."""
    kind = sandbox.resource_kind(type(e).__name__, str(e))
    if kind == sandbox.MEMORY:
        return DEVICE_FULL
    if kind == sandbox.BUSY:
        return DEVICE_BUSY
    return CUDA_UNAVAILABLE if level != sandbox.ISOLATION_LEVELS[-1] else None


def lap(phases: dict[str, float], name: str, since: float) -> float:
    """Add the seconds from ``since`` to now to ``phases[name]``; now (``time.monotonic``, one
    clock for every process of the machine)."""
    now = time.monotonic()
    phases[name] = round(phases.get(name, 0.0) + now - since, 4)
    return now


def add_seconds(total: dict[str, float], more: dict[str, float]) -> None:
    """Add ``more``'s seconds to ``total``'s, step by step (``Worker.start_phases``)."""
    for step, seconds in more.items():
        total[step] = round(total.get(step, 0.0) + seconds, 4)


def start_worker(conn_fd: int, channel_fd: int, policy: sandbox.Policy | None, workdir: str | None,
                 device: str, level: str = "full", phases: dict[str, float] | None = None) -> Connection:
    """A worker's first steps, before it imports its target: its namespaces (while it has one
    thread), its compile cache inside its directory (or kfuzz's campaign cache), and on CUDA
    the driver and Triton's launcher stubs initialised while exec is still allowed. A CUDA
    that does not start inside the namespaces ends the worker with ``CUDA_UNAVAILABLE``; one
    that does not start because the GPU's memory is taken, with ``DEVICE_FULL``, or because the
    GPU is busy, with ``DEVICE_BUSY`` (states of the GPU that other processes make, never a
    reason to give up namespaces). ``phases`` gets the
    seconds of each step (``isolation``, ``cuda``, ``triton_driver``)."""
    phases = {} if phases is None else phases
    t = time.monotonic()
    if policy is not None:
        sandbox.isolate(policy, level)
        if policy.processes:
            sandbox.adopt_orphans()
    if workdir is not None:
        sandbox.compile_cache(workdir)
    t = lap(phases, "isolation", t)
    if str(device).startswith("cuda"):
        try:
            torch.zeros(1, device=device)
        except Exception as e:   # noqa: BLE001 - kfuzz retries with fewer namespaces
            code = start_failure(e, level)
            if code is None:
                raise
            os._exit(code)
        t = lap(phases, "cuda", t)
        try:
            from triton.runtime import driver
            driver.active.get_current_device()
            driver.active.utils     # noqa: B018  (builds Triton's stub with the C compiler, once)
        except Exception:   # noqa: BLE001 - no Triton, or its CUDA driver: a kernel of this target has none
            pass
        lap(phases, "triton_driver", t)
    prepare_triton(device)
    return Connection(conn_fd)


def _say_failed(conn: Connection, step: str, e: Exception) -> None:
    """Tell kfuzz's process that the worker could not ``step`` (``Worker._await_ready`` reads it)."""
    conn.send_bytes(pack(("failed", os.getpid(), step, f"{type(e).__name__}: {e}"[:1500]), []))


def _worker_main(conn_fd: int, channel_fd: int, target_name: str, module: str | None, device: str,
                 with_coverage: bool, policy: sandbox.Policy | None = None, workdir: str | None = None,
                 resolve: dict | None = None, preload: tuple[str, ...] = (), level: str = "full") -> None:
    entered, phases = time.monotonic(), {}
    try:
        conn = start_worker(conn_fd, channel_fd, policy, workdir, device, level, phases)
    except Exception as e:      # kfuzz's process says why (a CUDA that does not start at any level)
        _say_failed(Connection(conn_fd), "start", e)
        raise
    t = time.monotonic()
    try:
        for name in preload:    # before confinement (torch._dynamo makes a cache directory in /tmp)
            importlib.import_module(name)
        t = lap(phases, "preload", t)
        target = load_target(target_name, module, resolve)
    except Exception as e:      # kfuzz's process says why (a GPU's memory taken while the target loads)
        _say_failed(conn, "load its target", e)
        raise
    t = lap(phases, "target", t)
    jit.report_compiles(conn.send_bytes)
    coverage = HarnessCoverage(harness_files(target)) if with_coverage else None
    # confined after the target's import (the harness is trusted), before any kernel call
    confinement = sandbox.confine(policy, workdir, channel_fd) if policy is not None else {}
    lap(phases, "confinement", t)
    cpu_seconds = policy.cpu_seconds if policy is not None else None
    conn.send_bytes(pack(("ready", os.getpid(), confinement, entered, phases), []))
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return
        header, storages = unpack(msg)
        if header[0] == "stop":
            return
        if header[0] == "program":
            from kfuzz.programs import answer    # preloaded by the pools that send programs
            case, name, params, layouts = read_program(header)
            reply, crashed = answer(target, case, name, params, layouts, storages, device, cpu_seconds, coverage)
            try:
                conn.send_bytes(reply)
            except OSError:     # kfuzz's process closed the pipe (an interrupt, a deadline): no one to answer
                return
            if crashed:
                return   # an escape, a CUDA error or OOM may leave the process unusable: start afresh


def worker_case(case: Case) -> tuple:
    """What a worker is told of a case: enough for the contract (target, dtype, dims), not
    the seed that would let a kernel predict its inputs."""
    return case.target, case.dtype, case.dims


def program_message(case: Case, name: str, params: dict, inputs: dict[str, dict[str, torch.Tensor]]) -> bytes:
    """The message that asks a worker to run program ``name`` on ``inputs`` (tensors by role
    and argument, their whole storages sent) for ``case`` (``worker_case``: no seed)."""
    layouts, tensors = [], []
    for role, ts in inputs.items():
        for arg, t in ts.items():
            layouts.append((role, arg, geometry(t)))
            tensors.append(t)
    return pack(("program", worker_case(case), name, params, layouts), tensors)


def read_program(header: list) -> tuple[Case, str, dict, list]:
    """The case (seed 0), program name, parameters and input layouts of a ``program_message``."""
    told = header[1]
    return Case(told[0], told[1], 0, tuple((k, int(v)) for k, v in told[2])), header[2], header[3], header[4]


class _CudaUnavailable(Exception):
    pass


class _DeviceState(Exception):
    """CUDA did not start for a state of the GPU that other processes make and that passes."""

    def said(self, device: str) -> str:
        raise NotImplementedError


class _DeviceBusy(_DeviceState):
    def said(self, device: str) -> str:
        return f"{device} is busy or unavailable (cudaErrorDevicesUnavailable)"


class _DeviceFull(_DeviceState):
    def said(self, device: str) -> str:   # the words sandbox.resource_kind reads as a GPU's memory
        return f"CUDA out of memory on {device} (other processes hold the GPU's memory)"


class Worker:
    """One worker process (forked by kfuzz's zygote, ``kfuzz.launcher``), its private
    directory, its violation channel (``sandbox.Channel``), and the cases queued on it (the
    head one is running) with the inputs kfuzz materialized for each."""

    def __init__(self, target_name: str, module: str | None, device: str, with_coverage: bool,
                 policy: sandbox.Policy | None = None, resolve: dict | None = None, preload: tuple[str, ...] = (),
                 wait: bool = True, give_up_at: float | None = None):
        """Start the worker; with ``wait=False`` it starts in the background and ``ready``
        waits for it (so that several workers import their target at once). ``give_up_at``
        (``time.monotonic``): no wait for a busy or full GPU runs past it."""
        self.target_name, self.device, self.give_up_at = target_name, device, give_up_at
        self._args = (target_name, module, device, with_coverage, policy, resolve, preload)
        self.level = isolation_level(device)
        self._born = time.monotonic()
        self.start_seconds = 0.0      # from its start to ready: the fork, CUDA, the target's import
        self.start_phases: dict[str, float] = {}   # those seconds by step (``launch``: to its first line)
        self._start(*self._args, self.level)
        if wait:
            self.ready()

    def ready(self) -> None:
        """Wait until the worker has started (at a lower isolation level where CUDA does not
        start inside the namespaces; again at the same level, after ``DEVICE_WAITS``, where the
        GPU said it was busy or its memory was taken: the processes that share it, kfuzz's own
        workers and judges too, give it back as their cases end). No wait runs past
        ``give_up_at`` (a campaign's end)."""
        tries = 0
        while True:
            try:
                self._await_ready()
                self.start_seconds = time.monotonic() - self._born
                return
            except _DeviceState as e:
                late = (self.give_up_at is not None
                        and time.monotonic() + DEVICE_WAITS[min(tries, len(DEVICE_WAITS) - 1)] > self.give_up_at)
                if tries == len(DEVICE_WAITS) or late:
                    raise WorkerStartError(f"worker for {self.target_name!r} did not start: {e.said(self.device)}, "
                                           f"{tries + 1} {'try' if tries == 0 else 'tries'}") from None
                time.sleep(DEVICE_WAITS[tries])
                tries += 1
                self._start(*self._args, self.level)
            except _CudaUnavailable:
                _isolation_failed(self.device, self.level)
                lower = isolation_level(self.device)     # another worker may have given it up first
                if lower == self.level:
                    raise WorkerStartError(f"worker for {self.target_name!r}: CUDA does not start in a "
                                           "worker") from None
                self.level = lower
                self._start(*self._args, self.level)

    def _start(self, target_name, module, device, with_coverage, policy, resolve, preload, level) -> None:
        self._launched = time.monotonic()
        self.workdir = tempfile.mkdtemp(prefix="kfuzz-worker-")
        self.conn, child = multiprocessing.Pipe()
        self.channel = sandbox.Channel()
        try:
            self.process = launcher.start(("kfuzz.workers", "_worker_main"),
                                          (target_name, module, device, with_coverage, policy, self.workdir,
                                           resolve, tuple(preload), level),
                                          (child.fileno(), self.channel.theirs.fileno()),
                                          preload=("kfuzz.workers", *preload))
        except launcher.LaunchError as e:
            self.conn.close()
            self.channel.close()
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise WorkerStartError(f"no worker for {target_name!r}: {e}") from None
        finally:
            child.close()
        self.channel.handed_over()
        self.queue: list[tuple[Case, dict, int]] = []   # case, kfuzz's inputs, message size
        self.started = 0.0            # when the head case began to run
        self.credit = Credit()        # the head case's compile time (kfuzz.jit)
        self.suspects: dict[int, int | None] = {}   # pid -> start: running at the last answer, a case queued
        self.outbox = Outbox(self.conn, "kfuzz-worker-sender")

    def _await_ready(self) -> None:
        target_name, policy = self.target_name, self._args[4]
        if not self.conn.poll(STARTUP_TIMEOUT):
            self.kill()
            raise WorkerStartError(f"worker for {target_name!r} did not start within {STARTUP_TIMEOUT:.0f} s")
        try:
            header, _ = unpack(self.conn.recv_bytes())
            if header[0] == "failed":
                self.process.join(5)
                self.kill()
                raise WorkerStartError(f"worker for {target_name!r} could not {header[2]}: {header[3]}")
            kind, _, self.confinement, entered, phases = header
        except EOFError:
            self.process.join(5)
            code = self.process.exitcode
            self.kill()
            if code == CUDA_UNAVAILABLE:
                raise _CudaUnavailable() from None
            if code == DEVICE_BUSY:
                raise _DeviceBusy() from None
            if code == DEVICE_FULL:
                raise _DeviceFull() from None
            raise WorkerStartError(f"worker for {target_name!r} died while starting "
                                   f"({sandbox.death_name(code)})") from None
        assert kind == "ready"
        self.start_phases = {"launch": round(entered - self._launched, 4), **phases}
        # where the kernel may start processes, none may outlive its call: the worker's own
        # tree is its relay, the init of its PID namespace and itself (kfuzz.sandbox.isolate)
        self.watch_tree = policy is not None and policy.processes
        self.own_tree = 2 if "pid" in str(self.confinement.get("isolation", "")).split("+") else 0
        self.answers = 0

    def escape(self, answered: bool = True) -> tuple[str, str] | None:
        """The first attempt to leave the sandbox that the worker's channel reported, or None.
        ``answered``: the worker answered and goes on, so it must still hold its end; a closed
        or torn channel is then a violation too, and so is a process the kernel started that
        is still running (with a case already queued behind this one, which may have begun:
        one still running, the same process, at the next answer)."""
        found = self.channel.verdict(answered and not self._died_in_next_case())
        if found is None and answered and self.watch_tree:
            self.answers += 1
            left = self.started_processes(scan=self.answers % FULL_SCAN_EVERY == 1)
            if left and self.queue:
                # the worker may have begun its next case, whose processes (a JIT compiler) are
                # that call's: one seen now outlived this call if it still runs at the next answer
                born = {pid: processes.started_at(pid) for pid in left}
                left = [pid for pid in left if born[pid] is not None and self.suspects.get(pid) == born[pid]]
                self.suspects = born
            else:
                deadline = time.monotonic() + EXIT_GRACE     # one exiting as the answer was sent
                while left and time.monotonic() < deadline:
                    time.sleep(0.005)
                    left = self.started_processes()
                self.suspects = {}
            if left:
                names = "; ".join(f"{pid}: {processes.command(pid)}" for pid in left[:4])
                found = sandbox.FORK, f"{len(left)} process(es) the kernel started outlived its call ({names})"
        return found

    def _died_in_next_case(self) -> bool:
        """Whether the channel closed because the worker went on to a queued case and died in
        it: its end closes with the process, and that case's verdict is the death. A kernel
        that closes the channel and then ends its process is still a crash, of the next case."""
        if not self.queue or self.channel.read() or not self.channel.eof:
            return False
        self.process.join(DEATH_GRACE)
        return self.process.exitcode is not None

    def started_processes(self, scan: bool = False) -> list[int]:
        """The live processes below the worker other than its own tree (kfuzz.sandbox.isolate);
        ``scan``: from a scan of every process (``processes.descendants``)."""
        return processes.descendants(self.process.pid, scan)[self.own_tree:]

    def post(self, msg: bytes, unread: int = 0) -> None:
        """Send ``msg`` without ever blocking on the worker (``unread`` bytes may wait in its pipe):
        kfuzz must stay free to enforce the timeout of a worker that hangs."""
        self.outbox.post(msg, unread)

    def finish_head(self) -> tuple[Case, dict]:
        case, inputs, _ = self.queue.pop(0)
        self.started = time.monotonic()
        self.credit.reset()
        return case, inputs

    def compile_note(self, msg: bytes) -> bool:
        """Whether ``msg`` is a compile note about the head case (kfuzz.jit), now accounted for."""
        return self.credit.take(msg, time.monotonic())

    def deadline(self, timeout: float) -> float:
        """When the head case has run ``timeout`` seconds, its compiles not counted."""
        return self.started + timeout + self.credit.extension(time.monotonic())

    def kill(self) -> None:
        """Kill the worker (its PID namespace, and with it every process it started, dies with
        it) and remove its directory."""
        self.process.kill()
        self.process.join(10)
        self.process.release()
        self.outbox.close()     # the sender, if blocked, fails now that the worker is gone
        self.conn.close()
        self.channel.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def stop(self) -> None:
        if not self.queue:            # an idle worker's pipe is empty: the message cannot block
            try:
                self.conn.send_bytes(pack(("stop", None, None), []))
                self.process.join(5)
            except OSError:
                pass
        self.kill()


def fork_server_here(close: tuple[int, ...] = ()) -> bool:
    """Make this process's zygote (``kfuzz.launcher``) a fork of this process as it is now,
    instead of a fresh interpreter that imports torch again (seconds a process): for a
    short-lived process that starts workers and has imported what they need. Call it before
    touching CUDA and before holding anything a kernel must not see: every worker is a copy of
    this moment. The zygote keeps no descriptor but its socket to this process (``close`` is
    accepted for callers that name descriptors to drop; all are). False (nothing done) where a
    fork now would be unsafe; workers then come from a fresh zygote, as usual."""
    return launcher.zygote_here()


def worker_policy(policy: sandbox.Policy | None, device: str, timeout: float) -> sandbox.Policy:
    """``policy`` (by default ``Policy.for_device(device)``) with a CPU-time budget per case,
    when it names none: the timeout times the CPU count."""
    policy = policy or sandbox.Policy.for_device(device)
    if policy.cpu_seconds is None:
        policy = sandbox.Policy(**{**policy.__dict__, "cpu_seconds": int(timeout * (os.cpu_count() or 1)) + 1})
    return policy


def death(worker: Worker, policy: sandbox.Policy) -> tuple[str, str]:
    """The ``exc_type`` and detail of a worker that died while running the kernel: the first
    attempt its channel reported, else how it died (``sandbox-syscall`` for a call the
    system-call filter forbids)."""
    worker.process.join(10)
    escape = worker.escape(answered=False)
    if escape is not None:
        return escape
    name = sandbox.death_name(worker.process.exitcode)
    if name == sandbox.SYSCALL:
        return name, ("the system-call filter killed the worker: the kernel made a call the sandbox forbids "
                      "(a new process, a socket, a namespace, ptrace, a signal to another process)")
    why = {sandbox.CPU: f" past its CPU-time limit of {policy.cpu_seconds} s a case",
           sandbox.FILE_SIZE: " writing a file past its size limit"}.get(name, "")
    return name, f"the worker died ({name}){why} while running the kernel"

