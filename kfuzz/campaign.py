"""A fuzzing campaign: an engine proposes cases, sandboxed workers run the kernel, kfuzz's
own process judges each result against the oracle, and every failure with a signature
that has no open failure in the corpus is saved (a signature whose kept cases are all
fixed bugs, ``expect: pass``, does not hide a new one: `Corpus.has_open_failure`).

``jobs`` workers run at once (``jobs=0`` runs the kernel in this process, unprotected).
A worker that crashes or hangs yields a ``crash`` or ``timeout`` verdict whose case is
saved like any other failure; the campaign goes on until its time or run limit. At the
limit no new case is submitted and the ones in flight are finished.

Cases that an engine keeps in its corpus (new coverage or, for the atheris engine, a new
divergence feature) are saved under ``seeds/<target>/``.

The library never prints: progress reaches the caller through ``on_progress``.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kfuzz.corpus import Corpus
from kfuzz.execute import judge
from kfuzz.minimize import minimize_confined, minimize_failure
from kfuzz.sandbox import Policy
from kfuzz.target import Target
from kfuzz.tensors import materialize
from kfuzz.verdict import Verdict
from kfuzz.workers import InProcess, WorkerPool


@dataclass
class CampaignStats:
    target: str
    engine: str
    jobs: int = 1
    executions: int = 0
    seconds: float = 0.0
    failures: Counter = field(default_factory=Counter)   # signature -> count
    first_seen: dict = field(default_factory=dict)         # signature -> execution number
    saved: list[Path] = field(default_factory=list)
    corpus_size: int = 0           # cases the engine kept (seeds saved)
    coverage: int = 0              # distinct harness edges seen
    new_coverage: int = 0          # executions that found an edge not seen before
    worker_restarts: int = 0
    unfinished: int = 0            # cases still running --timeout after the time limit: dropped
    worker_cpu_seconds: float = 0.0   # CPU time of the workers' processes (0 in process)
    sandbox: dict = field(default_factory=dict)   # what confined the workers, layer by layer
    interrupted: bool = False      # stopped by KeyboardInterrupt (kfuzz run: SIGINT, SIGTERM, SIGHUP)

    @property
    def execs_per_second(self) -> float:
        return self.executions / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict:
        return {"target": self.target, "engine": self.engine, "jobs": self.jobs,
                "executions": self.executions, "seconds": round(self.seconds, 3),
                "execs_per_second": round(self.execs_per_second, 2),
                "corpus_size": self.corpus_size, "coverage_edges": self.coverage,
                "new_coverage_executions": self.new_coverage, "worker_restarts": self.worker_restarts,
                "unfinished": self.unfinished, "interrupted": self.interrupted,
                "worker_cpu_seconds": round(self.worker_cpu_seconds, 3),
                "sandbox": self.sandbox,
                "failures": {str(k): {"count": v, "first_execution": self.first_seen[k]}
                             for k, v in self.failures.items()},
                "saved": [str(p) for p in self.saved]}


def run_campaign(target: Target, engine, corpus: Corpus, *, seconds: float | None = None,
                 runs: int | None = None, device: str = "cpu", jobs: int = 1, timeout: float = 60.0,
                 stop_on_failure: bool = False, on_progress: Callable[[CampaignStats, Verdict], None] | None = None,
                 policy: Policy | None = None) -> CampaignStats:
    """Execute cases from ``engine`` until ``seconds`` pass or ``runs`` cases ran (or, with
    ``stop_on_failure``, the first failure). ``policy`` confines the workers (``kfuzz.sandbox``;
    by default the device's).  A KeyboardInterrupt ends the campaign as a time limit would,
    with ``interrupted`` set: the cases in flight are dropped, the failures already saved stay,
    and the stats are returned."""
    if seconds is None and runs is None:
        raise ValueError("give seconds or runs")
    if jobs < 0:
        raise ValueError("jobs must be >= 0")
    wants_coverage = getattr(engine, "wants_coverage", False)
    stats = CampaignStats(target.name, engine.name, jobs)
    start = time.monotonic()
    runner = (InProcess(target, device, wants_coverage) if jobs == 0 else
              WorkerPool(target, jobs, device, timeout, wants_coverage, policy=policy))
    stats.sandbox = runner.confinement
    if hasattr(engine, "start"):
        engine.start(corpus, parallel=max(1, jobs))
    seen_edges: set[int] = set()
    submitted = 0
    first_result = 0.0
    try:
        while True:
            stats.seconds = time.monotonic() - start
            # a timed campaign submits a case only while it should finish in time (after the
            # cases in flight, at the mean time a case has taken): slow targets under the
            # interpreter otherwise overran --time by a case or two in flight
            # seconds a case takes, between results (the first result also paid the workers' start)
            per_case = (stats.seconds - first_result) / (stats.executions - 1) if stats.executions > 1 else 0.0
            open_ = ((seconds is None or stats.seconds < seconds) and (runs is None or submitted < runs)
                     and not (stop_on_failure and stats.failures))
            capacity = getattr(engine, "capacity", None)   # cases it can have out at once
            while (open_ and runner.idle > 0 and (runs is None or submitted < runs)
                   and (capacity is None or runner.busy < capacity)
                   and (seconds is None or submitted == 0
                        or stats.seconds + (runner.busy + 1) * per_case <= seconds)):
                runner.submit(engine.next_case())
                submitted += 1
            if runner.busy == 0:
                break
            # past the time limit, the cases in flight get --timeout more, compiles included
            # (kfuzz.jit stops a case's clock while it compiles, for up to 10 minutes): then
            # they are dropped, unjudged, rather than called hangs or waited for
            until = None if seconds is None else start + seconds + timeout
            if until is not None and time.monotonic() >= until and jobs > 0:
                stats.unfinished = runner.abandon()
                break
            for result in runner.results(until):
                case = result.case
                verdict = result.verdict
                if verdict is None:
                    inputs = result.inputs if result.inputs is not None else materialize(case, target, "cpu")
                    verdict = judge(case, target, inputs, result.outputs)
                stats.executions += 1
                if stats.executions == 1:
                    first_result = time.monotonic() - start
                new_edges = result.coverage - seen_edges
                if new_edges:
                    seen_edges |= new_edges
                    stats.coverage = len(seen_edges)
                    stats.new_coverage += 1
                kept = engine.feedback(case, verdict, result) if wants_coverage else engine.feedback(case, verdict)
                if kept:
                    corpus.save_seed(case)
                    stats.corpus_size += 1
                if not verdict.passed:
                    stats.failures[verdict.signature] += 1
                    stats.first_seen.setdefault(verdict.signature, stats.executions)
                    path = None
                    if not corpus.has_open_failure(verdict.signature):   # minimize new failures only
                        # a timed campaign ends near its time: minimizing gets what is left (5 s at least)
                        left = None if seconds is None else max(5.0, seconds - (time.monotonic() - start))
                        # a sandboxed campaign minimizes in a sandbox too: shrunk cases run the kernel
                        kept, kept_verdict, note = (
                            minimize_failure(case, target, verdict, device=device, max_seconds=left) if jobs == 0
                            else minimize_confined(case, target, verdict, device, left, runner.policy))
                        path = corpus.save_failure(kept, kept_verdict, device=device, **note)
                    if path is not None:
                        stats.saved.append(path)
                stats.seconds = time.monotonic() - start
                if on_progress is not None:
                    on_progress(stats, verdict)
    except KeyboardInterrupt:
        stats.interrupted = True
        stats.unfinished = runner.busy
    finally:
        stats.worker_restarts = runner.restarts
        stats.worker_cpu_seconds = runner.worker_cpu_seconds
        runner.close()
        if hasattr(engine, "close"):
            engine.close()
        stats.seconds = time.monotonic() - start
    return stats
