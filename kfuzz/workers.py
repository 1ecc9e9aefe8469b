"""Sandboxed execution: the kernel runs in spawned worker processes, the oracle in kfuzz's.

A worker is started by ``multiprocessing``'s *forkserver*: a fresh process,
itself spawned (exec'd), that imports torch and the target's module once and
never touches CUDA; each worker is forked from it, so none inherits a CUDA
context (a fork of a process that has touched CUDA cannot use it), and a
restart after a crash costs a fork, not a torch import (4 s on a loaded CPU).
It loads its target itself, then answers one case at a time: it
materializes the inputs, calls the kernel under the call contract
(``execute.kernel_stage``) and sends back the outputs as plain bytes, or the
verdict that already ends the case (exception, contract, mutation). The
oracle and the trusted implementation run in kfuzz's own process
(``execute.judge``), so their outputs never enter the kernel's process.

What kills or stalls a worker becomes a verdict and the campaign goes on with
a fresh worker:

- the worker dies (segfault, abort, ``os._exit``, the OOM killer): ``crash``,
  its ``exc_type`` the signal name (``SIGSEGV``) or ``exit-N``;
- no answer within ``timeout`` seconds: the worker is killed, ``timeout``;
- a CUDA error or out-of-memory inside the call: ``crash``, and the worker is
  replaced, since its CUDA context may be unusable.

``InProcess`` runs the same kernel half in kfuzz's own process, without any of
this protection; it is for trusted kernels and measurements.

Harness coverage: on request a worker records the line-to-line edges it
executes in the target's own source file (the kernel, its launcher and, under
the Triton interpreter, the Triton kernel body), as stable integer ids. Engines
use it as feedback; torch itself is not traced.
"""
from __future__ import annotations

import importlib
import inspect
import json
import multiprocessing
import os
import signal
import sys
import time
import zlib
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Iterator

import torch

from kfuzz.case import Case
from kfuzz.execute import kernel_stage
from kfuzz.target import Target, get_target, prepare_triton
from kfuzz.tensors import decode_payload, encode_payload
from kfuzz.verdict import Verdict

STARTUP_TIMEOUT = 600.0     # importing torch and Triton targets on a loaded machine is slow
_MEMORY_ERRORS = ("OutOfMemoryError", "MemoryError")


@dataclass
class KernelResult:
    """The kernel's half of one execution, as kfuzz's process receives it."""

    case: Case
    outputs: dict[str, torch.Tensor] | None   # on the CPU; None when ``verdict`` ends the case
    verdict: Verdict | None
    coverage: frozenset[int] = frozenset()
    seconds: float = 0.0


# harness coverage -------------------------------------------------------------------------

def harness_files(target: Target) -> set[str]:
    """The source files whose lines count as the target's coverage."""
    files = set()
    for fn in (target.kernel, target.reference):
        try:
            files.add(inspect.getsourcefile(fn) or "")
        except TypeError:
            continue
    files.discard("")
    return {os.path.realpath(f) for f in files} | files


class HarnessCoverage:
    """Line-to-line edges executed in ``files``, as ids stable across processes."""

    def __init__(self, files: set[str]):
        self.ids = {f: zlib.crc32(os.path.basename(f).encode()) << 32 for f in files}
        self.edges: set[int] = set()

    def __enter__(self) -> "HarnessCoverage":
        self.edges = set()
        self._old = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(self._old)

    def _call(self, frame, event, arg):
        base = self.ids.get(frame.f_code.co_filename)
        if base is None:
            return None
        prev = [frame.f_lineno]

        def line(frame, event, arg):
            if event == "line":
                self.edges.add(base | (prev[0] << 16) | (frame.f_lineno & 0xFFFF))
                prev[0] = frame.f_lineno
            return line
        return line


def _memory_crash(verdict: Verdict | None) -> Verdict | None:
    if verdict is not None and verdict.kind == "exception" and verdict.exc_type in _MEMORY_ERRORS:
        return Verdict(verdict.target, "crash", detail=f"out of memory: {verdict.detail}"[:2000],
                       exc_type="OutOfMemory")
    return verdict


def run_kernel(case: Case, target: Target, device: str = "cpu",
               coverage: HarnessCoverage | None = None) -> tuple[dict, dict | None, Verdict | None, frozenset]:
    """One kernel half: (inputs, outputs, verdict, coverage); see ``execute.kernel_stage``."""
    if coverage is None:
        inputs, outputs, verdict = kernel_stage(case, target, device)
        edges = frozenset()
    else:
        with coverage:
            inputs, outputs, verdict = kernel_stage(case, target, device)
        edges = frozenset(coverage.edges)
    return inputs, outputs, _memory_crash(verdict), edges


# the worker process ------------------------------------------------------------------------

def _load_target(name: str, module: str | None) -> Target:
    """The target, importing only its own module when that registers it (a worker starts
    in a second instead of importing every harness), else through the entry points."""
    prepare_triton()
    if module:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
        from kfuzz.target import _REGISTRY
        if name in _REGISTRY:
            return _REGISTRY[name]
    return get_target(name)


def _worker_main(conn: Connection, target_name: str, module: str | None, device: str,
                 with_coverage: bool) -> None:
    target = _load_target(target_name, module)
    coverage = HarnessCoverage(harness_files(target)) if with_coverage else None
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        case = Case.from_json(json.loads(msg))
        _, outputs, verdict, edges = run_kernel(case, target, device, coverage)
        wire = None if outputs is None else {k: encode_payload(v) for k, v in outputs.items()}
        conn.send(("done", wire, None if verdict is None else verdict.to_json(), sorted(edges)))
        if verdict is not None and verdict.kind == "crash":
            return   # a CUDA error or OOM may leave the context unusable: start afresh


def _signal_name(exitcode: int | None) -> str:
    if exitcode is None:
        return "unknown"
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal-{-exitcode}"
    return f"exit-{exitcode}"


class Worker:
    """One worker process and the cases queued on it (the head one is running)."""

    def __init__(self, target_name: str, module: str | None, device: str, with_coverage: bool):
        ctx = multiprocessing.get_context("forkserver")
        # takes effect when the server first starts; it must stay free of CUDA
        ctx.set_forkserver_preload(["kfuzz.workers"] + ([module] if module else []))
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, target_name, module, device, with_coverage),
                                   daemon=True, name=f"kfuzz-worker-{target_name}")
        self.process.start()
        child.close()
        self.queue: list[Case] = []
        self.started = 0.0            # when the head case began to run
        if not self.conn.poll(STARTUP_TIMEOUT):
            self.kill()
            raise RuntimeError(f"worker for {target_name!r} did not start within {STARTUP_TIMEOUT:.0f} s")
        try:
            kind, _ = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"worker for {target_name!r} died while starting "
                               f"({_signal_name(self.process.exitcode)})") from None
        assert kind == "ready"

    def submit(self, case: Case) -> None:
        if not self.queue:
            self.started = time.monotonic()
        self.queue.append(case)
        self.conn.send(case.canonical())

    def finish_head(self) -> Case:
        case = self.queue.pop(0)
        self.started = time.monotonic()
        return case

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.process.join(5)
        self.kill()


class WorkerPool:
    """``jobs`` sandboxed workers for one target; results come back as each finishes.

    Each worker holds up to ``depth`` cases: the next one waits in its pipe while kfuzz's
    process judges the last, so the two processes overlap. When a worker dies or hangs,
    the case it was running gets the verdict and the ones queued behind it go to its
    replacement."""

    def __init__(self, target: Target, jobs: int = 1, device: str = "cpu", timeout: float = 60.0,
                 coverage: bool = False, depth: int = 2):
        if jobs < 1:
            raise ValueError("a worker pool needs jobs >= 1")
        self.target, self.device, self.timeout, self.coverage = target, device, timeout, coverage
        self.depth = depth
        self.workers: list[Worker | None] = [self._spawn() for _ in range(jobs)]
        self.restarts = 0

    def _spawn(self) -> Worker:
        return Worker(self.target.name, getattr(self.target.kernel, "__module__", None), self.device,
                      self.coverage)

    @property
    def idle(self) -> int:
        return sum(self.depth - (len(w.queue) if w is not None else 0) for w in self.workers)

    @property
    def busy(self) -> int:
        return sum(len(w.queue) for w in self.workers if w is not None)

    def submit(self, case: Case) -> None:
        i = min(range(len(self.workers)),
                key=lambda i: len(self.workers[i].queue) if self.workers[i] is not None else 0)
        if self.workers[i] is None:   # replaced lazily, so a campaign's end waits for no restart
            self.workers[i] = self._spawn()
            self.restarts += 1
        self.workers[i].submit(case)

    def _replace(self, worker: Worker) -> None:
        """Kill ``worker``; the cases queued behind its head go to a fresh one."""
        worker.kill()
        i = self.workers.index(worker)
        self.workers[i] = None
        for case in worker.queue:
            self.submit(case)

    def _failed(self, worker: Worker, kind: str, exc_type: str | None, detail: str) -> KernelResult:
        seconds = time.monotonic() - worker.started
        case = worker.queue.pop(0)
        self._replace(worker)
        return KernelResult(case, None, Verdict(self.target.name, kind, exc_type=exc_type, detail=detail),
                            seconds=seconds)

    def results(self) -> Iterator[KernelResult]:
        """Wait for at least one busy worker to finish, die or time out; yield what ended."""
        busy = [w for w in self.workers if w is not None and w.queue]
        if not busy:
            return
        now = time.monotonic()
        wait_for = max(0.0, min(w.started + self.timeout for w in busy) - now)
        ready = wait([w.conn for w in busy], timeout=wait_for)
        for w in busy:
            if w.conn in ready:
                try:
                    _, wire, verdict_json, edges = w.conn.recv()
                except (EOFError, OSError):
                    w.process.join(10)
                    sig = _signal_name(w.process.exitcode)
                    yield self._failed(w, "crash", sig, f"the worker died ({sig}) while running the kernel")
                    continue
                seconds = time.monotonic() - w.started
                case = w.finish_head()
                verdict = None if verdict_json is None else Verdict.from_json(self.target.name, verdict_json)
                outputs = None if wire is None else {k: decode_payload(v, k) for k, v in wire.items()}
                if verdict is not None and verdict.kind == "crash":
                    self._replace(w)   # the worker ends itself after a CUDA error or OOM
                yield KernelResult(case, outputs, verdict, frozenset(edges), seconds)
            elif time.monotonic() >= w.started + self.timeout:
                yield self._failed(w, "timeout", None,
                                   f"no answer within {self.timeout:g} s; the worker was killed")

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
        self.inputs: dict[Case, dict] = {}

    idle = property(lambda self: 1 - len(self.pending))
    busy = property(lambda self: len(self.pending))

    def submit(self, case: Case) -> None:
        self.pending.append(case)

    def results(self) -> Iterator[KernelResult]:
        while self.pending:
            case = self.pending.pop(0)
            start = time.perf_counter()
            inputs, outputs, verdict, edges = run_kernel(case, self.target, self.device, self.coverage)
            if outputs is not None:
                outputs = {k: v.cpu() for k, v in outputs.items()}
                self.inputs[case] = inputs   # the judge reuses them instead of materializing again
            yield KernelResult(case, outputs, verdict, edges, time.perf_counter() - start)

    def take_inputs(self, case: Case) -> dict | None:
        return self.inputs.pop(case, None)

    def close(self) -> None:
        self.pending.clear()
