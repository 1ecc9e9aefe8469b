"""A fuzzing campaign: an engine proposes cases, sandboxed workers run the kernel, kfuzz's
judges compare each result with the oracle, and every failure with a signature that has no
open failure in the corpus is saved (a signature whose kept cases are all fixed bugs,
``expect: pass``, does not hide a new one: `Corpus.has_open_failure`), then minimized.

``jobs`` workers run at once (``jobs=0`` runs the kernel in this process, unprotected); on
a GPU machine they are spread over the GPUs visible (``kfuzz.devices.spread``), and
``judges`` processes run the oracle and the trusted implementation beside them, on the
kernel's device (``kfuzz.judges``). A worker that crashes or hangs yields a ``crash`` or
``timeout`` verdict whose case is saved like any other failure; the campaign goes on
until its time or run limit. A crash for want of memory (``resource-memory``) is run once
more first, alone: the memory is shared (a GPU's by every worker and judge on it), so another
process's peak can take it from a case that needs little. The campaign sends no new case
until every worker and judge is idle, then runs the case again in a fresh worker, and sends
new cases once it is back; a second out-of-memory crash is the verdict.

A worker that cannot start (``kfuzz.errors.WorkerStartError``: its GPU still full or busy
after ``DEVICE_WAITS``, its target's import failing) stops the campaign early, as its time
limit would: ``stopped`` names the error, the cases in flight are dropped, what was saved
stays, and the new failures are still minimized.

Deadlines: at ``seconds`` the campaign ends, compiles included. The cases still in flight
(in a worker or waiting for a judge) are dropped and counted (``unfinished``), never judged
or saved.

Minimizing (``kfuzz.minimize``) has a budget of its own, ``minimize_seconds``, spent after
the campaign's time: each new failure is saved as found the moment it is judged (nothing is
lost to an interrupt), then minimized to a fixed point on the device where it was found, in
a sandboxed worker when the campaign's were, and the minimized case takes its place. A
failure whose signature already had an open case saved before the campaign is counted in
``known`` and not saved again.

Compile-aware scheduling (``kfuzz.schedule``): a case whose specialization is not compiled
yet costs a JIT compile; the scheduler opens new ones one (or ``compile_share`` of the
workers) at a time, and only while compiling has taken at most ``compile_share`` of the
workers' time; the other cases reuse specializations already opened. A GPU campaign's first
case is the target's smallest (the cheapest compile), and until it has come back no other is
sent, to any worker (the others then find its kernels in the JIT cache; a second case queued
behind it on the same worker would open a second specialization before any compile is seen).

Cases that an engine keeps in its corpus (new coverage or, for the atheris engine, a new
divergence feature) are saved under ``seeds/<target>/``.

The library never prints: progress reaches the caller through ``on_progress``, called after
each judged case and at least every ``tick`` seconds (with ``None`` for the verdict).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kfuzz.case import Case, encode
from kfuzz.corpus import Corpus, make_record, write_atomic
from kfuzz.devices import spread, visible_gpus
from kfuzz.errors import WorkerStartError
from kfuzz.executor import InProcess, Pool
from kfuzz.judges import Judges
from kfuzz.minimize import DEFAULT_BUDGET, minimize_failure
from kfuzz.programs import Program, settled
from kfuzz.sandbox import MEMORY, Policy
from kfuzz.schedule import CompileHistory, Scheduler, specialization
from kfuzz.target import Target
from kfuzz.tensors import materialize
from kfuzz.verdict import Verdict

MINIMIZE_SECONDS = 120.0     # the minimizer's default budget, all new failures together
COMPILE_LOG = 200            # compiles the stats keep one by one (when, where, how long, what)
MISS_LOG = 20                # specialization misses the stats keep one by one


@dataclass
class CampaignStats:
    target: str
    engine: str
    jobs: int = 1
    executions: int = 0            # judged cases
    seconds: float = 0.0
    failures: Counter = field(default_factory=Counter)   # signature -> count
    first_seen: dict = field(default_factory=dict)         # signature -> execution number
    known: Counter = field(default_factory=Counter)      # signature -> count, an open case saved before
    saved: list[Path] = field(default_factory=list)
    corpus_size: int = 0           # cases the engine kept (seeds saved)
    coverage: int = 0              # distinct harness edges seen
    new_coverage: int = 0          # executions that found an edge not seen before
    worker_restarts: int = 0
    unfinished: int = 0            # cases in flight at the time limit or an interrupt: dropped
    worker_cpu_seconds: float = 0.0   # CPU time of the workers' processes (0 in process)
    sandbox: dict = field(default_factory=dict)   # what confined the workers, layer by layer
    interrupted: bool = False      # stopped by KeyboardInterrupt (kfuzz run: SIGINT, SIGTERM, SIGHUP)
    stopped: str | None = None     # the error that ended the campaign early (a worker that could not start)
    devices: dict = field(default_factory=dict)   # device -> workers on it
    judges: int = 0                # judge processes (0: judged in kfuzz's process)
    first_judged: float | None = None   # seconds from the start to the first judged case
    compiles: int = 0              # cases whose kernel call compiled (kfuzz.jit notes)
    compile_seconds: float = 0.0   # summed over workers
    kernel_seconds: float = 0.0    # the kernel's side, compiles excluded, summed over workers
    judge_seconds: float = 0.0     # the oracle and the trusted implementation, summed over judges
    judge_restarts: int = 0        # judge processes that died and were replaced
    judge_errors: list = field(default_factory=list)   # kfuzz's own: the oracle's exceptions, unjudged cases
    judged_on_cpu: int = 0         # cases a GPU's judge judged on the CPU for want of the GPU's memory
    gpu_least_free: int | None = None   # the fewest bytes free on a judge's GPU after a case
    compile_log: list = field(default_factory=list)    # (seconds into the campaign, worker's device, compile s, labels)
    workers_ready: float | None = None   # seconds from the start until the workers were up
    specializations: int = 0       # distinct specializations run (kfuzz.schedule)
    specialization_misses: int = 0  # compiles at a JIT key the specialization does not name
    miss_log: list = field(default_factory=list)   # (label, dtype, dims) of the first of them
    memory_reruns: int = 0         # out-of-memory crashes run once more (the memory is shared)
    costs: list = field(default_factory=list)   # the costliest specializations to judge (``costs``)
    minimize_seconds: float = 0.0  # spent minimizing, after the campaign's time
    minimized: dict = field(default_factory=dict)   # saved path -> the minimizer's note

    @property
    def execs_per_second(self) -> float:
        return self.executions / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict:
        return {"target": self.target, "engine": self.engine, "jobs": self.jobs,
                "executions": self.executions, "seconds": round(self.seconds, 3),
                "execs_per_second": round(self.execs_per_second, 2),
                "first_judged_seconds": None if self.first_judged is None else round(self.first_judged, 3),
                "corpus_size": self.corpus_size, "coverage_edges": self.coverage,
                "new_coverage_executions": self.new_coverage, "worker_restarts": self.worker_restarts,
                "unfinished": self.unfinished, "interrupted": self.interrupted, "stopped": self.stopped,
                "worker_cpu_seconds": round(self.worker_cpu_seconds, 3),
                "devices": self.devices, "judges": self.judges,
                "compiles": self.compiles, "compile_seconds": round(self.compile_seconds, 3),
                "kernel_seconds": round(self.kernel_seconds, 3), "judge_seconds": round(self.judge_seconds, 3),
                "judge_restarts": self.judge_restarts, "judge_errors": self.judge_errors,
                "judged_on_cpu": self.judged_on_cpu, "gpu_least_free_bytes": self.gpu_least_free,
                "workers_ready_seconds": None if self.workers_ready is None else round(self.workers_ready, 3),
                "compile_log": [[round(t, 2), d, round(c, 2), list(k)] for t, d, c, k in self.compile_log],
                "specializations": self.specializations,
                "specialization_misses": self.specialization_misses,
                "miss_log": [[w, dt, dims] for w, dt, dims in self.miss_log],
                "memory_reruns": self.memory_reruns,
                "costs": self.costs,
                "minimize_seconds": round(self.minimize_seconds, 3),
                "sandbox": self.sandbox,
                "failures": {str(k): {"count": v, "first_execution": self.first_seen[k]}
                             for k, v in self.failures.items()},
                "known": {str(k): v for k, v in self.known.items()},
                "saved": [str(p) for p in self.saved],
                "minimized": {str(k): v for k, v in self.minimized.items()}}


COSTS = 10     # specializations named in a campaign's stats, the costliest to judge first


def costs(judged: dict, kernel: dict) -> list[list]:
    """The ``COSTS`` specializations whose cases took the judges the most seconds, each as
    [its key, cases judged, judging seconds, the kernel's seconds]: where a campaign's time went."""
    top = sorted(judged.items(), key=lambda kv: -kv[1][1])[:COSTS]
    return [[repr(key), n, round(seconds, 3), round(kernel.get(key, 0.0), 3)] for key, (n, seconds) in top]


@dataclass
class Executed:
    """One case's kernel side as an engine's feedback sees it."""

    case: Case
    outputs: dict | None
    coverage: frozenset
    seconds: float


def worker_devices(device: str, jobs: int, cuda_count: int | None = None) -> list[str]:
    """The device of each of ``jobs`` workers: spread over the GPUs ``device`` covers."""
    gpus = visible_gpus(device, cuda_count)
    if len(gpus) <= 1:
        return [device] * jobs
    return [f"cuda:{g}" for g, n in spread(jobs, gpus) for _ in range(n)]


def default_judges(device: str, jobs: int) -> int:
    """Judge processes by default: one per worker where the kernel runs on a GPU (the oracle
    is then most of a case's time), none on the CPU (the workers and the oracle share the cores)."""
    return jobs if device.startswith("cuda") and jobs > 0 else 0


def run_campaign(target: Target, engine, corpus: Corpus, *, seconds: float | None = None,
                 runs: int | None = None, device: str = "cpu", jobs: int = 1, timeout: float = 60.0,
                 stop_on_failure: bool = False, on_progress: Callable[[CampaignStats, Verdict | None], None] | None = None,
                 policy: Policy | None = None, minimize_seconds: float = MINIMIZE_SECONDS,
                 judges: int | None = None, compile_share: float = 0.25, tick: float = 1.0,
                 cuda_count: int | None = None, compile_history: str | Path | None = None) -> CampaignStats:
    """Execute cases from ``engine`` until ``seconds`` pass or ``runs`` cases are judged (or,
    with ``stop_on_failure``, the first failure); then minimize the new failures for up to
    ``minimize_seconds``. ``policy`` confines the workers (``kfuzz.sandbox``; by default the
    device's). A KeyboardInterrupt, worker startup included, ends the campaign as a time
    limit would, with ``interrupted`` set and nothing minimized: the cases in flight are
    dropped, the failures already saved stay (as found), and the stats are returned.
    ``compile_history``: the JIT cache's ``kfuzz.schedule.CompileHistory`` file, read at the start
    and written with this campaign's specializations at the end (None: none kept)."""
    if seconds is None and runs is None:
        raise ValueError("give seconds or runs")
    if jobs < 0:
        raise ValueError("jobs must be >= 0")
    wants_coverage = getattr(engine, "wants_coverage", False)
    stats = CampaignStats(target.name, engine.name, jobs)
    start = time.monotonic()
    end = None if seconds is None else start + seconds
    found: list[tuple[Case, Verdict, Path, str]] = []   # new failures, saved as found
    seen_edges: set[int] = set()
    runner = judging = None
    kernel_by: dict = {}     # specialization -> the kernel's seconds, compiles excluded
    history = CompileHistory(compile_history) if compile_history is not None else None
    schedule = Scheduler(target, engine, compile_share, workers=max(1, jobs),
                         cold=jobs > 0 and device.startswith("cuda"),
                         history=history.of(target.name) if history is not None else (frozenset(), 0.0))
    submitted = 0
    rerun: set[str] = set()       # cases run again after an out-of-memory crash
    held: list[Program] = []      # those waiting for every worker and judge to be idle
    alone: set[str] = set()       # those running again, alone

    def finish(case: Case, verdict: Verdict, ran: Executed, where: str) -> None:
        stats.executions += 1
        if stats.first_judged is None:
            stats.first_judged = time.monotonic() - start
        new_edges = ran.coverage - seen_edges
        if new_edges:
            seen_edges.update(new_edges)
            stats.coverage = len(seen_edges)
            stats.new_coverage += 1
        kept = engine.feedback(case, verdict, ran) if wants_coverage else engine.feedback(case, verdict)
        if kept:
            corpus.save_seed(case)
            stats.corpus_size += 1
        if not verdict.passed:
            sig = verdict.signature
            stats.failures[sig] += 1
            stats.first_seen.setdefault(sig, stats.executions)
            if stats.failures[sig] == 1 and not any(v.signature == sig for _, v, _, _ in found):
                path = corpus.save_failure(case, verdict, device=where)
                if path is None:
                    stats.known[sig] += 1
                else:
                    stats.saved.append(path)
                    found.append((case, verdict, path, where))
            elif sig in stats.known:
                stats.known[sig] += 1
        stats.seconds = time.monotonic() - start
        if on_progress is not None:
            on_progress(stats, verdict)

    try:
        devices = worker_devices(device, max(1, jobs), cuda_count)
        stats.devices = dict(Counter(devices)) if jobs else {device: 0}
        # an in-process kernel shares kfuzz's process: a judge pool's threads would be its threads
        n_judges = 0 if jobs == 0 else default_judges(device, jobs) if judges is None else judges
        stats.judges = n_judges
        runner = (InProcess(target, device, wants_coverage) if jobs == 0 else
                  Pool(target, jobs, device, timeout, wants_coverage, policy=policy, devices=devices))
        judging = Judges(target, n_judges, device, devices=devices if jobs else None,
                         account=lambda c: specialization(target, c))
        judging.start()      # the judges and the workers import torch and the target at once
        if isinstance(runner, Pool):
            runner.deadline = end
        runner.start()
        stats.workers_ready = time.monotonic() - start
        stats.sandbox = runner.confinement
        if hasattr(engine, "start"):
            engine.start(corpus, parallel=max(1, jobs))
        last_tick = time.monotonic()
        while True:
            now = time.monotonic()
            stats.seconds = now - start
            open_ = ((end is None or now < end) and (runs is None or submitted < runs)
                     and not (stop_on_failure and stats.failures))
            capacity = getattr(engine, "capacity", None)   # cases it can have out at once
            while (open_ and runner.idle > 0 and (runs is None or submitted < runs)
                   and (capacity is None or runner.busy + judging.busy < capacity)
                   and judging.busy <= max(2 * n_judges, 1) and not schedule.waiting_first
                   and not held and not alone):
                case = schedule.next_case(stats.seconds, stats.compile_seconds)
                runner.submit(Program("call", case, {"case": materialize(case, target, "cpu")}),
                              affinity=specialization(target, case))
                submitted += 1
            if held and runner.busy == 0 and judging.busy == 0:    # quiet: the memory reruns, alone
                for program in held:
                    alone.add(program.case.hash)
                    runner.submit(program, affinity=specialization(target, program.case))
                held.clear()
            if runner.busy == 0 and judging.busy == 0:
                break
            if end is not None and time.monotonic() >= end:
                stats.unfinished += runner.abandon() + judging.drop() + len(held)
                break
            wake = time.monotonic() + (0.01 if judging.busy else tick)
            until = wake if end is None else min(end, wake)
            for r in runner.results(until):
                if end is not None and time.monotonic() >= end:
                    stats.unfinished += 1       # came back past the limit: dropped, not judged
                    continue
                case, inputs = r.program.case, r.program.inputs["case"]
                alone.discard(case.hash)
                spent, spec = max(0.0, r.seconds - r.compile_seconds), specialization(target, case)
                stats.kernel_seconds += spent
                kernel_by[spec] = kernel_by.get(spec, 0.0) + spent
                stats.compile_seconds += r.compile_seconds
                stats.compiles += r.compile_seconds > 0
                if r.compile_seconds > 0 and len(stats.compile_log) < COMPILE_LOG:
                    stats.compile_log.append((time.monotonic() - start, r.device or device, r.compile_seconds,
                                              r.compiled))
                misses = schedule.observe(case, r.compile_seconds, r.compiled)
                stats.specialization_misses += len(misses)
                stats.miss_log.extend((w, case.dtype, case.dim) for w in misses[:MISS_LOG - len(stats.miss_log)])
                stats.specializations = schedule.size
                outputs, verdict = settled(r, target, case, inputs)
                if verdict is not None and verdict.exc_type == MEMORY and case.hash not in rerun:
                    # a GPU's memory is shared by every worker and judge on it, a host's by the
                    # workers: the case runs once more, alone, in a fresh worker; again out of
                    # memory is its verdict
                    rerun.add(case.hash)
                    stats.memory_reruns += 1
                    held.append(r.program)
                    continue
                ran = Executed(case, outputs, r.coverage, r.seconds)
                if verdict is not None:
                    finish(case, verdict, ran, r.device or device)
                else:
                    judging.submit(case, inputs, outputs, (ran, r.device or device), device=r.device)
            for (ran, where), verdict in judging.done(0.0 if runner.busy else 0.01):
                if end is not None and time.monotonic() >= end:
                    stats.unfinished += 1
                    continue
                finish(ran.case, verdict, ran, where)
            stats.judge_seconds = judging.seconds
            stats.judged_on_cpu, stats.gpu_least_free = judging.on_cpu, judging.least_free
            if on_progress is not None and time.monotonic() - last_tick >= tick:
                last_tick = time.monotonic()
                stats.seconds = last_tick - start
                on_progress(stats, None)
    except KeyboardInterrupt:
        stats.interrupted = True
        stats.unfinished += ((runner.busy if runner is not None else 0) + (judging.busy if judging is not None else 0)
                             + len(held))
    except WorkerStartError as e:
        stats.stopped = str(e)
        stats.unfinished += ((runner.abandon() if runner is not None else 0)
                             + (judging.drop() if judging is not None else 0) + len(held))
    finally:
        if runner is not None:
            stats.worker_restarts = runner.restarts
            stats.worker_cpu_seconds = runner.worker_cpu_seconds
            runner.close()
        if judging is not None:
            stats.judge_seconds = judging.seconds
            stats.judged_on_cpu, stats.gpu_least_free = judging.on_cpu, judging.least_free
            stats.judge_restarts, stats.judge_errors = judging.restarts, judging.errors
            stats.costs = costs(judging.by_account, kernel_by)
            judging.close()
        if hasattr(engine, "close"):
            engine.close()
        if history is not None and schedule.ran:
            history.add(target.name, schedule)
            try:
                history.save()
            except OSError:     # a cache folder that cannot be written: scheduling only loses the history
                pass
        stats.seconds = time.monotonic() - start
    if found and not stats.interrupted and minimize_seconds > 0:
        minimize_found(target, corpus, found, stats, minimize_seconds, jobs, timeout, policy)
    return stats


def minimize_found(target: Target, corpus: Corpus, found: list, stats: CampaignStats, budget: float,
                   jobs: int, timeout: float, policy: Policy | None) -> None:
    """Minimize each new failure on the device where it was found, within ``budget`` seconds
    in all (a share each), the campaign's ``jobs`` workers (started once a device) asking
    candidates at once, and keep the minimized case in place of the one saved as found.
    A KeyboardInterrupt stops it, a worker that does not start skips a failure; the cases not
    minimized stay as found."""
    began = time.monotonic()
    executors: dict[str, object] = {}     # one a device, its workers kept from one failure to the next
    try:
        for i, (case, verdict, path, where) in enumerate(found):
            left = budget - (time.monotonic() - began)
            if left <= 0:
                break
            share = left / (len(found) - i)
            if where not in executors:
                executors[where] = (InProcess(target, where) if jobs == 0
                                    else Pool(target, jobs, where, timeout, policy=policy))
            try:
                kept, kept_verdict, note = minimize_failure(case, target, verdict, where,
                                                            max_executions=20 * DEFAULT_BUDGET,
                                                            max_seconds=share, executor=executors[where])
            except WorkerStartError as e:     # kept as found
                stats.minimized[path] = {"error": str(e)}
                continue
            dest = corpus.failure_path(kept, kept_verdict.signature)
            write_atomic(dest, encode(kept, make_record(kept_verdict, "fail", where, **note)))
            if dest != path:
                path.unlink(missing_ok=True)
                stats.saved[stats.saved.index(path)] = dest
            stats.minimized[dest] = note.get("minimize", {})
    except KeyboardInterrupt:
        stats.interrupted = True
    finally:
        for executor in executors.values():
            executor.close()
        stats.minimize_seconds = time.monotonic() - began
