"""Executors: where a kernel program (``kfuzz.programs.Program``) runs, one interface in two forms.

Campaigns, the gates, the minimizer and the audit all hand the kernel's side of their work
to an executor as ``Program`` objects and get ``ProgramResult`` objects back; the oracle
and every judgement stay with the caller, in kfuzz's process.

- ``InProcess``: the program runs in this process, on copies of kfuzz's inputs: no
  isolation, no timeout. For trusted kernels, measurements and tests.
- ``Pool``: ``jobs`` sandboxed workers (``kfuzz.workers.Worker``), each on a device of its
  own when several GPUs are visible (``kfuzz.devices.spread``). A worker that dies is that
  program's ``crash`` (its signal or the limit it hit), one that gives no answer within
  ``timeout`` seconds (its JIT compiles not counted, ``kfuzz.jit``) is killed, ``timeout``;
  an answer that is not one (a kernel can reach its worker's pipe) is ``crash``/
  ``malformed-answer``. A dead worker's slot gets a fresh worker at the next program, and
  the programs queued behind the one that killed it go to the replacement. A worker that
  does not start (its target's import fails; its GPU stays busy or full, other processes'
  state, past ``kfuzz.workers.DEVICE_WAITS`` or ``deadline``) raises ``WorkerStartError``
  from the call that needed it.
  ``Sandboxed`` is a pool of one for programs run one at a time; ``WorkerPool`` a pool
  that takes cases and yields each call's outputs (``KernelResult``).

Both forms offer the same calls: ``run(program)`` runs one program and waits for it;
``submit(program)`` queues one, ``results(until)`` yields those that ended (a campaign keeps
every worker busy, ``depth`` programs queued on each so that the next one waits in its pipe
while kfuzz judges the last); ``abandon()`` drops what is in flight, unjudged; ``close()``.
A ``ProgramResult`` carries its program, the harness coverage it reached (on request) and
the seconds its JIT compiles took, so that a campaign can account for them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Hashable, Iterator

from kfuzz import jit, sandbox
from kfuzz.case import Case
from kfuzz.coverage import HarnessCoverage, harness_files
from kfuzz.errors import KfuzzError, WorkerStartError
from kfuzz.jit import COMPILE_ALLOWANCE
from kfuzz.programs import (Program, ProgramResult, Tensors, answered, is_storage_role, replicate, resource_crash,
                            run_program, sendable, settled)
from kfuzz.target import Target
from kfuzz.tensors import materialize
from kfuzz.verdict import Verdict
from kfuzz.wire import rebuild, unpack
from kfuzz.workers import WORKER_VERDICTS, Worker, add_seconds, death, program_message, worker_policy

# what a program worker imports before it is confined: the programs, and torch._dynamo, which
# torch.use_deterministic_algorithms (G10) imports and which makes a directory in /tmp
PROGRAM_IMPORTS = ("kfuzz.programs", "torch._dynamo")


def as_program(item: Program | Case, target: Target) -> Program:
    """A case as the ``call`` program on inputs materialized here (on the CPU)."""
    if isinstance(item, Program):
        return item
    return Program("call", item, {"case": materialize(item, target, "cpu")})


class InProcess:
    """Runs programs in this process, on copies of kfuzz's inputs: no isolation, no timeout.
    For trusted kernels, measurements and tests."""

    def __init__(self, target: Target, device: str = "cpu", coverage: bool = False):
        self.target, self.device = target, device
        self.coverage = HarnessCoverage(harness_files(target)) if coverage else None
        self.pending: list[Program] = []
        self.restarts, self.spawned = 0, 0
        self.confinement: dict[str, str] = {}
        self.worker_cpu_seconds = 0.0
        self.jobs = 1
        self.credit = jit.Credit(allowance=float("inf"))     # the running program's compiles

    def _note(self, msg: bytes) -> None:
        self.credit.take(msg, time.monotonic())

    def run(self, program: Program | Case) -> ProgramResult:
        program = as_program(program, self.target)
        start = time.monotonic()
        self.credit.reset()
        inputs = {role: {k: replicate(v, self.device) for k, v in ts.items()} for role, ts in program.inputs.items()}
        told = Program(program.name, Case(program.case.target, program.case.dtype, 0, program.case.dims), {},
                       program.params)     # as a worker is told: no seed
        previous = jit.listen(self._note)    # this call's compile notes, kfuzz's state put back after
        try:
            if self.coverage is None:
                verdict, outputs, facts = run_program(self.target, told, inputs, self.device)
                edges = frozenset()
            else:
                with self.coverage:
                    verdict, outputs, facts = run_program(self.target, told, inputs, self.device)
                edges = frozenset(self.coverage.edges)
        finally:
            jit.listen(previous)
        verdict = resource_crash(verdict)
        # one copy on the CPU (a GPU tensor's .cpu() is a copy already; a CPU tensor's is itself)
        back = {role: {k: (replicate(v) if is_storage_role(role) else v.detach().to("cpu", copy=True))
                       for k, v in ts.items()} for role, ts in sendable(answered(verdict, outputs)).items()}
        return ProgramResult(verdict, back, facts, time.monotonic() - start, program, edges,
                             self.credit.extension(time.monotonic()), self.device, tuple(self.credit.compiled))

    idle = property(lambda self: 1 - len(self.pending))
    busy = property(lambda self: len(self.pending))

    def start(self) -> None:
        pass

    def submit(self, program: Program | Case, affinity: Hashable | None = None) -> None:
        self.pending.append(as_program(program, self.target))

    def results(self, until: float | None = None) -> Iterator[ProgramResult]:
        while self.pending:
            yield self.run(self.pending.pop(0))

    def abandon(self) -> int:
        dropped, self.pending = len(self.pending), []
        return dropped

    def restart(self) -> None:
        pass

    def close(self) -> None:
        self.pending.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Pool:
    """``jobs`` sandboxed workers for one target (see the module docstring). ``devices``: the
    device of each worker (default ``device`` for all; ``cuda:N`` pins a worker to GPU N).
    ``policy`` confines the workers (by default ``Policy.for_device(device)``, its CPU time
    per program the timeout times the CPU count); ``resolve``: options for a resolver such
    as ``kb:``'s, with which a worker finds the target by its name; ``preload``: modules the
    worker imports before it is confined. Workers start at the first program (or ``start``)."""

    def __init__(self, target: Target, jobs: int = 1, device: str = "cpu", timeout: float = 60.0,
                 coverage: bool = False, depth: int = 2, policy: sandbox.Policy | None = None,
                 compile_allowance: float = COMPILE_ALLOWANCE, resolve: dict | None = None,
                 preload: tuple[str, ...] = ("kfuzz.programs",), devices: list[str] | None = None):
        if jobs < 1:
            raise ValueError("a worker pool needs jobs >= 1")
        self.target, self.device, self.timeout, self.coverage = target, device, timeout, coverage
        self.depth, self.compile_allowance, self.resolve, self.preload = depth, compile_allowance, resolve, preload
        self.devices = list(devices) if devices is not None else [device] * jobs
        if len(self.devices) != jobs:
            raise ValueError(f"{len(self.devices)} device(s) for {jobs} worker(s)")
        self.jobs = jobs
        self.policy = worker_policy(policy, device, timeout)
        self.workers: list[Worker | None] = [None] * jobs
        self.started = [False] * jobs
        self.confinement: dict = {}
        self.restarts = 0          # workers started in place of one that died, hung or was dropped
        self.spawned = 0           # workers started in all
        self.start_seconds = 0.0   # spent waiting for workers to be ready, all of them
        self.start_phases: dict[str, float] = {}   # the workers' starts by step (``Worker.start_phases``), summed
        self.cpu: dict[int, float] = {}   # worker pid -> CPU seconds it reported last
        self.ran: list[set] = [set() for _ in range(jobs)]   # each worker's specializations (submit)
        self.deadline: float | None = None   # no start waits for a busy or full GPU past it (a campaign's end)
        self.start_error: WorkerStartError | None = None   # a replacement that did not start
        self.unsent: list[Program] = []   # the programs that were to go to it: raised, then dropped

    @property
    def worker_cpu_seconds(self) -> float:
        """CPU time the workers used, as of each one's last answer."""
        return sum(self.cpu.values())

    def _spawn(self, i: int, wait: bool = True) -> Worker:
        w = Worker(self.target.name, getattr(self.target.kernel, "__module__", None), self.devices[i],
                   self.coverage, self.policy, self.resolve, tuple(self.preload), wait=wait, give_up_at=self.deadline)
        w.credit.allowance = self.compile_allowance
        self.restarts += self.started[i]
        self.started[i] = True
        self.ran[i] = set()
        self.spawned += 1
        if wait:
            self.confinement = self.confinement or w.confinement
            self._started(w)
        return w

    def _started(self, w: Worker) -> None:
        self.start_seconds += w.start_seconds
        add_seconds(self.start_phases, w.start_phases)

    def start(self) -> None:
        """Start every worker now, all at once (a KeyboardInterrupt meanwhile leaves none running)."""
        try:
            for i, w in enumerate(self.workers):
                if w is None:    # the first on a GPU finds the isolation level CUDA starts in
                    self.workers[i] = self._spawn(i, wait=i == 0 and str(self.devices[i]).startswith("cuda"))
            for w in self.workers:
                if not hasattr(w, "confinement"):
                    w.ready()
                    self._started(w)
                self.confinement = self.confinement or w.confinement
        except BaseException:
            self.abandon()
            self.close()
            raise

    @property
    def idle(self) -> int:
        return sum(self.depth - (len(w.queue) if w is not None else 0) for w in self.workers)

    @property
    def busy(self) -> int:
        return sum(len(w.queue) for w in self.workers if w is not None) + len(self.unsent)

    def submit(self, program: Program | Case, affinity: Hashable | None = None) -> None:
        """Queue ``program`` (a case: the ``call`` program on its inputs, materialized here)
        on the least busy worker; with ``affinity`` (a JIT specialization, ``kfuzz.schedule``),
        on the least busy of the workers that ran one of it before, where one has room, so
        that a specialization is compiled, or loaded from the disk cache, by few workers."""
        if self.start_error is not None:
            raise self.start_error
        program = as_program(program, self.target)

        def load(i: int) -> int:
            return len(self.workers[i].queue) if self.workers[i] is not None else 0
        ran = [i for i in range(len(self.workers))
               if affinity is not None and affinity in self.ran[i] and load(i) < self.depth]
        i = min(ran or range(len(self.workers)), key=load)
        if self.workers[i] is None:   # replaced lazily, so a campaign's end waits for no restart
            self.workers[i] = self._spawn(i)
        if affinity is not None:
            self.ran[i].add(affinity)
        w = self.workers[i]
        msg = program_message(program.case, program.name, program.params, program.inputs)
        if not w.queue:
            w.started = time.monotonic()
            w.credit.reset()
        unread = sum(size for _, _, size in w.queue)   # at most: the worker reads one before its reply
        w.queue.append((program, None, len(msg)))
        w.post(msg, unread)

    def _replace(self, worker: Worker) -> None:
        """Kill ``worker``; the programs queued behind its head go to a fresh one. Where none
        starts, the head's result is still given, and the next call raises the error."""
        worker.kill()
        self.workers[self.workers.index(worker)] = None
        queued = [program for program, _, _ in worker.queue]
        for n, program in enumerate(queued):
            try:
                self.submit(program)
            except WorkerStartError as e:
                self.start_error, self.unsent = e, queued[n:]
                return

    def _failed(self, worker: Worker, kind: str, exc_type: str | None, detail: str) -> ProgramResult:
        now = time.monotonic()
        compiled, labels = worker.credit.extension(now), tuple(worker.credit.compiled)
        device = self.devices[self.workers.index(worker)]
        program, _, _ = worker.queue.pop(0)
        self._replace(worker)
        return ProgramResult(Verdict(self.target.name, kind, exc_type=exc_type, detail=detail),
                             seconds=now - worker.started, program=program, compile_seconds=compiled,
                             device=device, compiled=labels)

    def _answer(self, w: Worker, msg: bytes) -> ProgramResult:
        try:   # the answer is data from the kernel's process: parsed, checked
            (kind, back, verdict_json, facts, cpu, edges), storages = unpack(msg)
            if kind != "program-done" or not isinstance(facts, dict) or len(back) != len(storages):
                raise ValueError("not an answer to a program")
            verdict = None if verdict_json is None else Verdict.from_json(self.target.name, verdict_json)
            if verdict is not None and verdict.kind not in WORKER_VERDICTS:
                raise ValueError(f"a worker may not report {verdict.kind!r}; kfuzz judges")
            outputs: dict[str, Tensors] = {}
            for (role, arg, geo), st in zip(back, storages):
                if not isinstance(role, str) or not isinstance(arg, str):
                    raise ValueError("a role or a name is not a string")
                outputs.setdefault(role, {})[arg] = rebuild(st, geo)
            edges, cpu = frozenset(int(e) for e in edges), float(cpu)
        except (ValueError, TypeError, KeyError, RuntimeError, KfuzzError) as e:
            return self._failed(w, "crash", "malformed-answer", f"the worker's answer is malformed: {e}"[:2000])
        now = time.monotonic()
        seconds, compiled, labels = now - w.started, w.credit.extension(now), tuple(w.credit.compiled)
        self.cpu[w.process.pid] = cpu
        device = self.devices[self.workers.index(w)]
        program, _ = w.finish_head()
        # seen by kfuzz, whatever the kernel did to its process's bookkeeping (a worker that
        # reported a crash ends itself: its channel's end closes with it)
        escape = w.escape(answered=verdict is None or verdict.kind != "crash")
        if escape is not None:
            outputs, verdict = {}, Verdict(self.target.name, "crash", exc_type=escape[0], detail=escape[1])
        if verdict is not None and verdict.kind == "crash":
            self._replace(w)   # the worker ends itself after a crash verdict
        return ProgramResult(verdict, outputs, facts, seconds, program, edges, compiled, device, labels)

    def results(self, until: float | None = None) -> Iterator[ProgramResult]:
        """Wait for at least one busy worker to finish, die or time out (or for the clock to
        reach ``until``); yield what ended."""
        busy = [w for w in self.workers if w is not None and w.queue]
        if not busy:
            if self.start_error is not None:
                raise self.start_error
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
                    yield self._failed(w, "crash", *death(w, self.policy))
                    continue
                if w.compile_note(msg):
                    continue
                yield self._answer(w, msg)
            elif time.monotonic() >= w.deadline(self.timeout):
                yield self._failed(w, "timeout", None, f"no answer within {self.timeout:g} s; the worker was killed")

    def run(self, program: Program | Case) -> ProgramResult:
        """Run one program and wait for its result (the pool must hold no other)."""
        if self.busy:
            raise RuntimeError("run() on a pool with programs in flight")
        self.submit(program)
        while True:
            for r in self.results():
                return r

    def abandon(self) -> int:
        """Kill the busy workers; their programs get no result. How many programs that was."""
        dropped, self.unsent = len(self.unsent), []
        for i, w in enumerate(self.workers):
            if w is not None and w.queue:
                dropped += len(w.queue)
                w.kill()
                self.workers[i] = None
        return dropped

    def restart(self) -> None:
        """End the idle workers; the next program starts a fresh one (one that did not start
        before is tried again; the programs that were to go to it are dropped)."""
        self.start_error, self.unsent = None, []
        for i, w in enumerate(self.workers):
            if w is not None:
                w.stop()
                self.workers[i] = None

    def close(self) -> None:
        self.restart()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Sandboxed(Pool):
    """A pool of one sandboxed worker that runs programs one at a time (the gates, ``kfuzz
    verify``, the audit); it preloads ``PROGRAM_IMPORTS`` and ``preload``."""

    def __init__(self, target: Target, device: str = "cpu", timeout: float = 120.0,
                 policy: sandbox.Policy | None = None, resolve: dict | None = None, preload: tuple[str, ...] = ()):
        super().__init__(target, 1, device, timeout, policy=policy, resolve=resolve,
                         preload=PROGRAM_IMPORTS + tuple(preload))

    @property
    def worker(self) -> Worker | None:
        return self.workers[0]


@dataclass
class KernelResult:
    """A case's kernel side as ``WorkerPool`` yields it: the outputs to judge (on the CPU), or
    the verdict that ended the case."""

    case: Case
    outputs: Tensors | None
    verdict: Verdict | None
    coverage: frozenset = frozenset()
    seconds: float = 0.0
    inputs: Tensors | None = None     # kfuzz's own copy, for the judge


class WorkerPool(Pool):
    """A ``Pool`` for cases: each submitted case runs as the ``call`` program, and ``results``
    yields ``KernelResult`` objects (the call's outputs, or the verdict that ended it)."""

    def results(self, until: float | None = None) -> Iterator[KernelResult]:
        for r in super().results(until):
            outputs, verdict = settled(r, self.target, r.case, r.inputs)
            yield KernelResult(r.case, outputs, verdict, r.coverage, r.seconds, r.inputs)


def executor_for(target: Target, device: str = "cpu", executor=None):
    """``executor`` if given, else an in-process one (the library's default: the CLI sandboxes)."""
    return executor if executor is not None else InProcess(target, device)
