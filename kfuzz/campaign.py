"""A fuzzing campaign: an engine proposes cases, each is executed and judged, and every
failure with a signature not yet in the corpus is saved.

The library never prints: progress reaches the caller through ``on_progress``.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kfuzz.corpus import Corpus
from kfuzz.execute import execute
from kfuzz.target import Target
from kfuzz.verdict import Verdict


@dataclass
class CampaignStats:
    target: str
    engine: str
    executions: int = 0
    seconds: float = 0.0
    failures: Counter = field(default_factory=Counter)   # signature -> count
    saved: list[Path] = field(default_factory=list)

    @property
    def execs_per_second(self) -> float:
        return self.executions / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict:
        return {"target": self.target, "engine": self.engine, "executions": self.executions,
                "seconds": round(self.seconds, 3), "execs_per_second": round(self.execs_per_second, 2),
                "failures": {str(k): v for k, v in self.failures.items()},
                "saved": [str(p) for p in self.saved]}


def run_campaign(target: Target, engine, corpus: Corpus, *, seconds: float | None = None,
                 runs: int | None = None, device: str = "cpu",
                 on_progress: Callable[[CampaignStats, Verdict], None] | None = None) -> CampaignStats:
    """Execute cases from ``engine`` until ``seconds`` pass or ``runs`` cases ran."""
    if seconds is None and runs is None:
        raise ValueError("give seconds or runs")
    stats = CampaignStats(target.name, engine.name)
    start = time.monotonic()
    while True:
        stats.seconds = time.monotonic() - start
        if (seconds is not None and stats.seconds >= seconds) or (runs is not None and stats.executions >= runs):
            break
        case = engine.next_case()
        verdict = execute(case, target, device=device)
        stats.executions += 1
        engine.feedback(case, verdict)
        if not verdict.passed:
            stats.failures[verdict.signature] += 1
            path = corpus.save_failure(case, verdict, device=device)
            if path is not None:
                stats.saved.append(path)
        if on_progress is not None:
            on_progress(stats, verdict)
    return stats
