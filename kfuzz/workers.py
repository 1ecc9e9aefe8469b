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
target, dtype and dims, never its seed. It calls the kernel under the call
contract (``execute.kernel_stage``) and sends back the outputs as raw bytes, or
the verdict that already ends the case (exception, contract, mutation). The
oracle and the trusted implementation run in kfuzz's own process
(``execute.judge``), so their outputs never enter the kernel's process. Each
worker holds up to two cases, so kfuzz judges one while the kernel runs the next.

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

``InProcess`` runs the same kernel half in kfuzz's own process, without any of
this protection; it is for trusted kernels and measurements.

The same worker also runs the gates' kernel programs (``kfuzz.programs``: several calls
on inputs kfuzz sent, the results sent back for kfuzz to judge), one at a time, for
``kfuzz.programs.Sandboxed``. ``fork_server_here`` lets a short-lived process that
starts workers (an audited kernel's oracle process) fork its zygote from itself instead
of importing torch again.

Harness coverage (``kfuzz.coverage``): on request a worker records the edges it
executes in the target's own source file, as engines' feedback.
"""
from __future__ import annotations

import importlib
import multiprocessing
import os
import resource
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from queue import Queue
from typing import Iterator, Mapping

import torch

from kfuzz import jit, launcher, sandbox
from kfuzz.case import Case
from kfuzz.coverage import HarnessCoverage, harness_files
from kfuzz.errors import KfuzzError
from kfuzz.execute import kernel_stage
from kfuzz.jit import COMPILE_ALLOWANCE, Credit
from kfuzz.target import Target, get_target, prepare_triton
from kfuzz.tensors import materialize
from kfuzz.wire import dense_outputs, geometry, pack, rebuild, unpack
from kfuzz.verdict import Verdict

# what a worker may report itself; a pass (or any judged kind) comes only from kfuzz's judge
_WORKER_VERDICTS = frozenset({"exception", "contract", "mutation", "crash"})
STARTUP_TIMEOUT = 600.0     # importing torch and Triton targets on a loaded machine is slow
# bytes that may wait unread in a worker's pipe without blocking kfuzz's send (Linux buffers
# ~200 KiB); more goes through a sender thread, so that kfuzz never blocks on a worker
DIRECT_SEND = 64 << 10


@dataclass
class KernelResult:
    """The kernel's half of one execution, as kfuzz's process receives it."""

    case: Case
    outputs: dict[str, torch.Tensor] | None   # on the CPU; None when ``verdict`` ends the case
    verdict: Verdict | None
    coverage: frozenset[int] = frozenset()
    seconds: float = 0.0
    inputs: dict[str, torch.Tensor] | None = None   # kfuzz's own copy, for the judge


def resource_crash(verdict: Verdict | None) -> Verdict | None:
    """An exception that says a resource ran out (memory, open files) is a ``crash`` named
    after the resource, not the kernel's exception."""
    if verdict is not None and verdict.kind == "exception":
        kind = sandbox.resource_kind(verdict.exc_type, verdict.detail)
        if kind is not None:
            return Verdict(verdict.target, "crash", detail=verdict.detail, exc_type=kind)
    return verdict


def run_kernel(case: Case, target: Target, device: str = "cpu", coverage: HarnessCoverage | None = None,
               inputs: Mapping[str, torch.Tensor] | None = None
               ) -> tuple[dict, dict | None, Verdict | None, frozenset]:
    """One kernel half: (inputs, outputs, verdict, coverage); see ``execute.kernel_stage``."""
    if coverage is None:
        inputs, outputs, verdict = kernel_stage(case, target, device, inputs)
        edges = frozenset()
    else:
        with coverage:
            inputs, outputs, verdict = kernel_stage(case, target, device, inputs)
        edges = frozenset(coverage.edges)
    return inputs, outputs, resource_crash(verdict), edges


# the worker process ------------------------------------------------------------------------

def _load_target(name: str, module: str | None, resolve: dict | None = None) -> Target:
    """The target, importing only its own module when that registers it (a worker starts
    in a second instead of importing every harness), else through the entry points.
    ``resolve``: keyword arguments for the resolver of a name built on demand (``kb:``)."""
    prepare_triton()
    if resolve is not None:
        from kfuzz.target import RESOLVERS
        for prefix, resolver in RESOLVERS.items():
            if name.startswith(prefix):
                return importlib.import_module(resolver).resolve(name, **resolve)
    if module:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
        from kfuzz.target import _REGISTRY
        if name in _REGISTRY:
            return _REGISTRY[name]
    return get_target(name)


CUDA_UNAVAILABLE = 75     # a worker's exit code: CUDA does not start inside its namespaces
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


def start_worker(conn_fd: int, channel_fd: int, policy: sandbox.Policy | None, workdir: str | None,
                 device: str, level: str = "full") -> Connection:
    """A worker's first steps, before it imports its target: its namespaces (while it has one
    thread), its compile cache inside its directory (or kfuzz's campaign cache), and on CUDA
    the driver and Triton's launcher stubs initialised while exec is still allowed. A CUDA
    that does not start inside the namespaces ends the worker with ``CUDA_UNAVAILABLE``."""
    if policy is not None:
        sandbox.isolate(policy, level)
    if workdir is not None:
        sandbox.compile_cache(workdir)
    if str(device).startswith("cuda"):
        try:
            torch.zeros(1, device=device)
        except Exception:   # noqa: BLE001 - kfuzz retries with fewer namespaces
            if level != "none":
                os._exit(CUDA_UNAVAILABLE)
            raise
        try:
            from triton.runtime import driver
            driver.active.get_current_device()
            driver.active.utils     # noqa: B018  (builds Triton's stub with the C compiler, once)
        except Exception:   # noqa: BLE001 - no Triton, or its CUDA driver: a kernel of this target has none
            pass
    prepare_triton()
    return Connection(conn_fd)


def _worker_main(conn_fd: int, channel_fd: int, target_name: str, module: str | None, device: str,
                 with_coverage: bool, policy: sandbox.Policy | None = None, workdir: str | None = None,
                 resolve: dict | None = None, preload: tuple[str, ...] = (), level: str = "full") -> None:
    conn = start_worker(conn_fd, channel_fd, policy, workdir, device, level)
    for name in preload:    # before confinement (torch._dynamo makes a cache directory in /tmp)
        importlib.import_module(name)
    target = _load_target(target_name, module, resolve)
    jit.report_compiles(conn.send_bytes)
    coverage = HarnessCoverage(harness_files(target)) if with_coverage else None
    # confined after the target's import (the harness is trusted), before any kernel call
    confinement = sandbox.confine(policy, workdir, channel_fd) if policy is not None else {}
    cpu_seconds = policy.cpu_seconds if policy is not None else None
    conn.send_bytes(pack(("ready", os.getpid(), confinement), []))
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return
        header, storages = unpack(msg)
        kind, told = header[0], header[1]
        if kind == "stop":
            return
        case = Case(told[0], told[1], 0, tuple((k, int(v)) for k, v in told[2]))
        if kind == "program":
            from kfuzz.programs import answer    # here: a campaign's worker never needs it
            reply, crashed = answer(target, case, header[2], header[3], header[4], storages, device,
                                    policy.cpu_seconds if policy is not None else None)
            conn.send_bytes(reply)
            if crashed:
                return
            continue
        layouts = header[2]
        inputs = {name: rebuild(st, geo, device) for (name, geo), st in zip(layouts, storages)}
        sandbox.start_case(cpu_seconds)
        try:
            _, outputs, verdict, edges = run_kernel(case, target, device, coverage, inputs)
        except sandbox.SandboxViolation:
            outputs, verdict, edges = None, None, frozenset()
        escape = sandbox.violation()    # recorded even when the kernel caught it
        if escape is not None:
            outputs, verdict = None, Verdict(target.name, "crash", exc_type=escape[0], detail=escape[1])
        sent = [] if outputs is None else dense_outputs(outputs)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        conn.send_bytes(pack(("done", None if outputs is None else [(k, geometry(t)) for k, t in zip(outputs, sent)],
                              None if verdict is None else verdict.to_json(), sorted(edges),
                              usage.ru_utime + usage.ru_stime), sent))
        if verdict is not None and verdict.kind == "crash":
            return   # an escape, a CUDA error or OOM may leave the process unusable: start afresh


def _sender(conn: Connection, outbox: Queue) -> None:
    """Send what ``outbox`` holds, in order, until ``None``; a dead worker's messages are dropped
    (its cases go to a replacement)."""
    while True:
        msg = outbox.get()
        try:
            if msg is None:
                return
            conn.send_bytes(msg)
        except (OSError, ValueError, TypeError):   # the worker died or was killed (a connection closed
            # under this thread has no handle: TypeError); keep draining to None
            pass
        finally:
            outbox.task_done()


def _worker_case(case: Case) -> tuple:
    """What a worker is told of a case: enough for the contract (target, dtype, dims), not
    the seed that would let a kernel predict its inputs."""
    return case.target, case.dtype, case.dims


class _CudaUnavailable(Exception):
    pass


class Worker:
    """One worker process (forked by kfuzz's zygote, ``kfuzz.launcher``), its private
    directory, its violation channel (``sandbox.Channel``), and the cases queued on it (the
    head one is running) with the inputs kfuzz materialized for each."""

    def __init__(self, target_name: str, module: str | None, device: str, with_coverage: bool,
                 policy: sandbox.Policy | None = None, resolve: dict | None = None, preload: tuple[str, ...] = ()):
        while True:
            level = isolation_level(device)
            try:
                self._start(target_name, module, device, with_coverage, policy, resolve, preload, level)
                break
            except _CudaUnavailable:
                if not _isolation_failed(device, level):
                    raise RuntimeError(f"worker for {target_name!r}: CUDA does not start in a worker") from None

    def _start(self, target_name, module, device, with_coverage, policy, resolve, preload, level) -> None:
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
            raise RuntimeError(f"no worker for {target_name!r}: {e}") from None
        finally:
            child.close()
        self.channel.handed_over()
        self.queue: list[tuple[Case, dict, int]] = []   # case, kfuzz's inputs, message size
        self.started = 0.0            # when the head case began to run
        self.credit = Credit()        # the head case's compile time (kfuzz.jit)
        self.outbox: Queue | None = None                 # the sender thread's, once needed
        if not self.conn.poll(STARTUP_TIMEOUT):
            self.kill()
            raise RuntimeError(f"worker for {target_name!r} did not start within {STARTUP_TIMEOUT:.0f} s")
        try:
            (kind, _, self.confinement), _ = unpack(self.conn.recv_bytes())
        except EOFError:
            self.process.join(5)
            code = self.process.exitcode
            self.kill()
            if code == CUDA_UNAVAILABLE:
                raise _CudaUnavailable() from None
            raise RuntimeError(f"worker for {target_name!r} died while starting ({sandbox.death_name(code)})") from None
        assert kind == "ready"
        # where the kernel may start processes, none may outlive its call: the worker's own
        # tree is its relay, the init of its PID namespace and itself (kfuzz.sandbox.isolate)
        self.watch_tree = policy is not None and policy.processes
        self.own_tree = 2 if "pid" in str(self.confinement.get("isolation", "")).split("+") else 0

    def escape(self, answered: bool = True) -> tuple[str, str] | None:
        """The first attempt to leave the sandbox that the worker's channel reported, or None.
        ``answered``: the worker answered and goes on, so it must still hold its end; a closed
        or torn channel is then a violation too, and so is a process the kernel started that
        is still running."""
        found = self.channel.verdict(answered)
        if found is None and answered and self.watch_tree:
            left = len(launcher.descendants(self.process.pid)) - self.own_tree
            if left > 0:
                found = sandbox.FORK, f"{left} process(es) the kernel started outlived its call"
        return found

    def submit(self, case: Case, inputs: dict[str, torch.Tensor]) -> None:
        msg = pack(("case", _worker_case(case), [(k, geometry(t)) for k, t in inputs.items()]),
                   list(inputs.values()))
        if not self.queue:
            self.started = time.monotonic()
            self.credit.reset()
        unread = sum(size for _, _, size in self.queue)   # at most: the worker reads a case before its reply
        self.queue.append((case, inputs, len(msg)))
        self.post(msg, unread)

    def post(self, msg: bytes, unread: int = 0) -> None:
        """Send ``msg`` without ever blocking on the worker: directly while the pipe has room
        (``unread`` bytes may wait in it), else through a sender thread."""
        if unread + len(msg) <= DIRECT_SEND and (self.outbox is None or self.outbox.unfinished_tasks == 0):
            try:
                self.conn.send_bytes(msg)
            except OSError:   # the worker died on its head case: ``results`` finds out, requeues this
                pass
            return
        # a large message could fill the pipe while the worker blocks on sending its reply
        # (a deadlock) or hangs (kfuzz could not enforce the timeout): a thread sends it
        if self.outbox is None:
            self.outbox = Queue()
            threading.Thread(target=_sender, args=(self.conn, self.outbox), daemon=True,
                             name="kfuzz-worker-sender").start()
        self.outbox.put(msg)

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
        if self.outbox is not None:
            self.outbox.put(None)     # the sender, if blocked, fails now that the worker is gone
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


class WorkerPool:
    """``jobs`` sandboxed workers for one target; results come back as each finishes.

    Each worker holds up to ``depth`` cases: the next one waits in its pipe while kfuzz's
    process judges the last, so the two processes overlap. When a worker dies or hangs,
    the case it was running gets the verdict and the ones queued behind it go to its
    replacement. ``policy`` confines the workers (``kfuzz.sandbox``; by default
    ``Policy.for_device(device)``, its CPU time per case the timeout times the CPU count).
    A case's JIT compiles stop its clock for at most ``compile_allowance`` seconds (kfuzz.jit)."""

    def __init__(self, target: Target, jobs: int = 1, device: str = "cpu", timeout: float = 60.0,
                 coverage: bool = False, depth: int = 2, policy: sandbox.Policy | None = None,
                 compile_allowance: float = COMPILE_ALLOWANCE):
        if jobs < 1:
            raise ValueError("a worker pool needs jobs >= 1")
        self.target, self.device, self.timeout, self.coverage = target, device, timeout, coverage
        self.depth, self.compile_allowance = depth, compile_allowance
        self.policy = worker_policy(policy, device, timeout)
        self.workers: list[Worker | None] = [self._spawn() for _ in range(jobs)]
        self.confinement = self.workers[0].confinement
        self.restarts = 0
        self.cpu: dict[int, float] = {}   # worker pid -> CPU seconds it reported last

    @property
    def worker_cpu_seconds(self) -> float:
        """CPU time the workers used (kernel calls and their own share of kfuzz's work),
        as of each one's last answer."""
        return sum(self.cpu.values())

    def _spawn(self) -> Worker:
        worker = Worker(self.target.name, getattr(self.target.kernel, "__module__", None), self.device,
                        self.coverage, self.policy)
        worker.credit.allowance = self.compile_allowance
        return worker

    @property
    def idle(self) -> int:
        return sum(self.depth - (len(w.queue) if w is not None else 0) for w in self.workers)

    @property
    def busy(self) -> int:
        return sum(len(w.queue) for w in self.workers if w is not None)

    def submit(self, case: Case, inputs: dict[str, torch.Tensor] | None = None) -> None:
        """Queue ``case``; its inputs are materialized here (on the CPU) unless given."""
        if inputs is None:
            inputs = materialize(case, self.target, "cpu")
        i = min(range(len(self.workers)),
                key=lambda i: len(self.workers[i].queue) if self.workers[i] is not None else 0)
        if self.workers[i] is None:   # replaced lazily, so a campaign's end waits for no restart
            self.workers[i] = self._spawn()
            self.restarts += 1
        self.workers[i].submit(case, inputs)

    def _replace(self, worker: Worker) -> None:
        """Kill ``worker``; the cases queued behind its head go to a fresh one."""
        worker.kill()
        i = self.workers.index(worker)
        self.workers[i] = None
        for case, inputs, _ in worker.queue:
            self.submit(case, inputs)

    def _failed(self, worker: Worker, kind: str, exc_type: str | None, detail: str) -> KernelResult:
        seconds = time.monotonic() - worker.started
        case, inputs, _ = worker.queue.pop(0)
        self._replace(worker)
        return KernelResult(case, None, Verdict(self.target.name, kind, exc_type=exc_type, detail=detail),
                            seconds=seconds, inputs=inputs)

    def _died(self, worker: Worker) -> KernelResult:
        return self._failed(worker, "crash", *death(worker, self.policy))

    def results(self, until: float | None = None) -> Iterator[KernelResult]:
        """Wait for at least one busy worker to finish, die or time out (or for the clock to
        reach ``until``); yield what ended."""
        busy = [w for w in self.workers if w is not None and w.queue]
        if not busy:
            return
        wait_for = max(0.0, min([w.deadline(self.timeout) for w in busy] + ([until] if until else []))
                       - time.monotonic())
        if len(busy) == 1:    # one pipe: poll it directly, cheaper than a selector
            ready = [busy[0].conn] if busy[0].conn.poll(wait_for) else []
        else:
            ready = wait([w.conn for w in busy], timeout=wait_for)
        for w in busy:
            if w.conn in ready:
                try:
                    msg = w.conn.recv_bytes()
                except (EOFError, OSError):
                    yield self._died(w)
                    continue
                if w.compile_note(msg):
                    continue
                try:   # the worker's answer is data from the kernel's process: parsed, checked
                    (_, layouts, verdict_json, edges, cpu), storages = unpack(msg)
                    verdict = None if verdict_json is None else Verdict.from_json(self.target.name, verdict_json)
                    if verdict is not None and verdict.kind not in _WORKER_VERDICTS:
                        raise ValueError(f"a worker may not report {verdict.kind!r}; kfuzz judges")
                    outputs = None if layouts is None else {
                        name: rebuild(st, geo) for (name, geo), st in zip(layouts, storages)}
                    edges, cpu = frozenset(int(e) for e in edges), float(cpu)
                except (ValueError, TypeError, KeyError, RuntimeError, KfuzzError) as e:
                    yield self._failed(w, "crash", "malformed-answer", f"the worker's answer is malformed: {e}"[:2000])
                    continue
                seconds = time.monotonic() - w.started
                self.cpu[w.process.pid] = cpu
                case, inputs = w.finish_head()
                # seen by kfuzz, whatever the kernel did to its process's bookkeeping (a worker that
                # reported a crash ends itself: its channel's end closes with it)
                escape = w.escape(answered=verdict is None or verdict.kind != "crash")
                if escape is not None:
                    outputs, verdict = None, Verdict(self.target.name, "crash", exc_type=escape[0], detail=escape[1])
                if verdict is not None and verdict.kind == "crash":
                    self._replace(w)   # the worker ends itself after a crash verdict
                yield KernelResult(case, outputs, verdict, edges, seconds, inputs)
            elif time.monotonic() >= w.deadline(self.timeout):
                yield self._failed(w, "timeout", None,
                                   f"no answer within {self.timeout:g} s; the worker was killed")

    def abandon(self) -> int:
        """Kill the busy workers; their cases get no verdict. How many cases that was."""
        dropped = 0
        for i, w in enumerate(self.workers):
            if w is not None and w.queue:
                dropped += len(w.queue)
                w.kill()
                self.workers[i] = None
        return dropped

    def close(self) -> None:
        for w in self.workers:
            if w is not None:
                w.stop()


class InProcess:
    """The same interface as ``WorkerPool``, running the kernel in this process: no sandbox,
    no timeout. For trusted kernels and for measuring kfuzz's own overhead."""

    def __init__(self, target: Target, device: str = "cpu", coverage: bool = False):
        self.target, self.device = target, device
        self.coverage = HarnessCoverage(harness_files(target)) if coverage else None
        self.pending: list[Case] = []
        self.restarts = 0
        self.confinement: dict[str, str] = {}
        self.worker_cpu_seconds = 0.0

    idle = property(lambda self: 1 - len(self.pending))
    busy = property(lambda self: len(self.pending))

    def submit(self, case: Case) -> None:
        self.pending.append(case)

    def results(self, until: float | None = None) -> Iterator[KernelResult]:
        while self.pending:
            case = self.pending.pop(0)
            start = time.perf_counter()
            inputs, outputs, verdict, edges = run_kernel(case, self.target, self.device, self.coverage)
            if outputs is not None:
                outputs = {k: v.cpu() for k, v in outputs.items()}
            # the judge reuses the inputs instead of materializing them again
            yield KernelResult(case, outputs, verdict, edges, time.perf_counter() - start,
                               inputs if outputs is not None else None)

    def close(self) -> None:
        self.pending.clear()
