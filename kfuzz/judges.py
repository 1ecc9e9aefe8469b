"""Judging several results at once: the oracle's side of a campaign in a pool of processes.

Once a kernel is compiled its call costs little and the float64 oracle is most of a case's
time (a step-by-step recurrence, autograd through it). ``Judges`` runs ``execute.judge`` in
``processes`` processes of its own, so that judging keeps up with the kernel's workers;
each runs the oracle and the trusted implementation on ``device`` (a GPU, where the kernel
runs on one: the oracle is trusted code and may share it). The judges are kfuzz's side:
they receive the inputs kfuzz materialized and the outputs kfuzz received from a worker,
never anything from a kernel's process directly, and they are spawned (a fresh
interpreter, which may use CUDA).

With ``processes=0`` the judge runs in the caller's process, when its result is asked for.
``pending`` results come back in the order they finish (``done``).
"""
from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

import torch

from kfuzz.case import Case
from kfuzz.execute import judge
from kfuzz.target import Target
from kfuzz.verdict import Verdict
from kfuzz.wire import geometry, pack, rebuild, unpack

_TARGET: Target | None = None


def _start(name: str, module: str | None, threads: int, device: str) -> None:
    global _TARGET
    from kfuzz.target import load_target as _load_target
    torch.set_num_threads(threads)
    if device.startswith("cuda"):    # a current device for autograd's own threads (cuBLAS)
        torch.cuda.set_device(torch.device(device) if ":" in device else 0)
    _TARGET = _load_target(name, module)


def _message(inputs: dict, outputs: dict) -> bytes:
    items = [("in", k, t) for k, t in inputs.items()] + [("out", k, t) for k, t in outputs.items()]
    return pack(([(role, k, geometry(t)) for role, k, t in items],), [t for _, _, t in items])


def _judge_here(case_json: dict, msg: bytes, device: str) -> tuple[dict, float]:
    (layouts,), storages = unpack(msg)
    got: dict[str, dict] = {"in": {}, "out": {}}
    for (role, k, geo), st in zip(layouts, storages):
        got[role][k] = rebuild(st, geo)
    start = time.monotonic()
    verdict = judge(Case.from_json(case_json), _TARGET, got["in"], got["out"], device)
    return verdict.to_json(), time.monotonic() - start


class Judges:
    """``processes`` judges for ``target`` on ``device`` (0: judge in this process)."""

    def __init__(self, target: Target, processes: int = 0, device: str = "cpu"):
        self.target, self.processes, self.device = target, processes, device
        self.pool = None
        if processes > 0:
            threads = max(1, (os.cpu_count() or 1) // (2 * processes))
            self.pool = ProcessPoolExecutor(
                max_workers=processes, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
                initargs=(target.name, getattr(target.kernel, "__module__", None), threads, device))
        self.pending: dict[Future, object] = {}
        self.seconds = 0.0           # spent judging, summed over the judges

    def submit(self, case: Case, inputs: dict, outputs: dict, tag: object = None) -> None:
        """Judge ``outputs`` of ``case`` on ``inputs``; ``tag`` comes back with the verdict."""
        if self.pool is None:
            fut: Future = Future()
            start = time.monotonic()
            fut.set_result((judge(case, self.target, inputs, outputs, self.device).to_json(),
                            time.monotonic() - start))
        else:
            fut = self.pool.submit(_judge_here, case.to_json(), _message(inputs, outputs), self.device)
        self.pending[fut] = tag

    @property
    def busy(self) -> int:
        return len(self.pending)

    def done(self, timeout: float | None = 0.0) -> list[tuple[object, Verdict]]:
        """The judged results (``tag``, verdict), waiting up to ``timeout`` seconds for one."""
        if not self.pending:
            return []
        finished, _ = wait(list(self.pending), timeout=timeout, return_when=FIRST_COMPLETED)
        out = []
        for fut in finished:
            tag = self.pending.pop(fut)
            verdict_json, seconds = fut.result()
            self.seconds += seconds
            out.append((tag, Verdict.from_json(self.target.name, verdict_json)))
        return out

    def drop(self) -> int:
        """Forget the results not yet judged; how many."""
        n = len(self.pending)
        for fut in self.pending:
            fut.cancel()
        self.pending.clear()
        return n

    def close(self) -> None:
        """Drop what is pending and end the judges now (one in the middle of a case too)."""
        self.drop()
        if self.pool is not None:
            processes = list((getattr(self.pool, "_processes", None) or {}).values())
            self.pool.shutdown(wait=False, cancel_futures=True)
            for p in processes:
                if p.is_alive():
                    p.kill()
            self.pool = None
