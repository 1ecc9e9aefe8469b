"""Judging several results at once: the oracle's side of a campaign in a pool of processes.

Once a kernel is compiled its call costs little and the float64 oracle is most of a case's
time (a step-by-step recurrence, autograd through it). ``Judges`` runs ``execute.judge`` in
``processes`` processes of its own, so that judging keeps up with the kernel's workers;
each runs the oracle and the trusted implementation on ``device`` (a GPU, where the kernel
runs on one: the oracle is trusted code and may share it). The judges are kfuzz's side:
they receive the inputs kfuzz materialized and the outputs kfuzz received from a worker,
never anything from a kernel's process directly, and they are spawned (a fresh
interpreter, which may use CUDA).

With several GPUs, each has a pool of its own and a result is judged on the GPU its kernel
ran on. The judges of one GPU together keep to ``MEMORY_SHARE`` of its memory (the rest is
the kernels'); a case whose float64 oracle does not fit a judge's part is judged on the CPU,
the same definition, slower. A judge that dies (killed, a driver fault) is replaced and its
pending results are judged again; an exception of the oracle's or the trusted
implementation's own is kfuzz's error, counted (``errors``) and named, never a verdict.

With ``processes=0`` the judge runs in the caller's process, when its result is asked for.
``pending`` results come back in the order they finish (``done``).
"""
from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

import torch

from kfuzz.case import Case
from kfuzz.execute import judge, release_device_memory
from kfuzz.target import Target
from kfuzz.verdict import Verdict
from kfuzz.wire import geometry, pack, rebuild, unpack

MEMORY_SHARE = 0.5          # of a GPU's memory, for all of its judges together
_TARGET: Target | None = None


def _start(name: str, module: str | None, threads: int, device: str, memory_fraction: float) -> None:
    global _TARGET
    from kfuzz.target import load_target
    torch.set_num_threads(threads)
    if device.startswith("cuda"):    # a current device for autograd's own threads (cuBLAS)
        torch.cuda.set_device(torch.device(device) if ":" in device else 0)
        torch.cuda.set_per_process_memory_fraction(memory_fraction)
    _TARGET = load_target(name, module)


def judge_within_memory(case: Case, target: Target, inputs: dict, outputs: dict, device: str) -> dict:
    """``execute.judge`` on ``device``, or on the CPU where the GPU's memory left to this
    process does not hold the case's oracle; the memory it cached goes back to the GPU."""
    try:
        return judge(case, target, inputs, outputs, device).to_json()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return judge(case, target, inputs, outputs, "cpu").to_json()
    finally:
        release_device_memory(device)


def _started() -> bool:
    return _TARGET is not None


def _message(inputs: dict, outputs: dict) -> bytes:
    items = [("in", k, t) for k, t in inputs.items()] + [("out", k, t) for k, t in outputs.items()]
    return pack(([(role, k, geometry(t)) for role, k, t in items],), [t for _, _, t in items])


def _judge_here(case_json: dict, msg: bytes, device: str) -> tuple[dict, float]:
    (layouts,), storages = unpack(msg)
    got: dict[str, dict] = {"in": {}, "out": {}}
    for (role, k, geo), st in zip(layouts, storages):
        got[role][k] = rebuild(st, geo)
    start = time.monotonic()
    verdict = judge_within_memory(Case.from_json(case_json), _TARGET, got["in"], got["out"], device)
    return verdict, time.monotonic() - start


class Judges:
    """``processes`` judges for ``target`` on ``device`` (0: judge in this process); ``devices``
    (GPUs) splits them into a pool a GPU, and ``submit`` takes the GPU a result came from."""

    def __init__(self, target: Target, processes: int = 0, device: str = "cpu", devices: list[str] | None = None):
        self.target, self.processes, self.device = target, processes, device
        gpus = sorted(set(devices or [device]))
        self.share = {d: processes // len(gpus) + (i < processes % len(gpus)) for i, d in enumerate(gpus)}
        self.pools: dict[str, ProcessPoolExecutor] = {}
        if processes > 0:
            self.threads = max(1, (os.cpu_count() or 1) // (2 * processes))
            for d, n in self.share.items():
                if n:
                    self.pools[d] = self._pool(d, n)
        self.pending: dict[Future, tuple] = {}
        self.seconds = 0.0           # spent judging, summed over the judges
        self.restarts = 0            # judge processes that died and were replaced (their pool)
        self.errors: list[str] = []  # the oracle's or trusted implementation's own exceptions

    def _pool(self, device: str, n: int) -> ProcessPoolExecutor:
        fraction = MEMORY_SHARE / n if device.startswith("cuda") else 1.0
        return ProcessPoolExecutor(
            max_workers=n, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
            initargs=(self.target.name, getattr(self.target.kernel, "__module__", None), self.threads, device,
                      fraction))

    def start(self) -> None:
        """Start every judge now, in the background (a pool starts its processes on demand)."""
        for where, pool in self.pools.items():
            for _ in range(self.share[where]):
                pool.submit(_started)

    def _where(self, device: str | None) -> str:
        device = device or self.device
        if device in self.pools:
            return device
        return next(iter(self.pools), device)

    def submit(self, case: Case, inputs: dict, outputs: dict, tag: object = None, device: str | None = None) -> None:
        """Judge ``outputs`` of ``case`` on ``inputs``; ``tag`` comes back with the verdict.
        ``device``: the GPU the kernel ran on, whose judges take it."""
        where = self._where(device)
        job = (case, inputs, outputs, tag, where, 0)
        if where not in self.pools:
            fut: Future = Future()
            start = time.monotonic()
            try:
                fut.set_result((judge_within_memory(case, self.target, inputs, outputs, where),
                                time.monotonic() - start))
            except Exception as e:  # noqa: BLE001 - the oracle's own error, named by ``done``
                fut.set_exception(e)
        else:
            fut = self._send(case, inputs, outputs, where)
        self.pending[fut] = job

    def _send(self, case: Case, inputs: dict, outputs: dict, where: str) -> Future:
        self._renew(where)
        return self.pools[where].submit(_judge_here, case.to_json(), _message(inputs, outputs), where)

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
            case, inputs, outputs, tag, where, tries = self.pending.pop(fut)
            try:
                verdict_json, seconds = fut.result()
            except BrokenProcessPool:       # a judge died under this result: judged again, once
                if tries == 0:
                    self.pending[self._send(case, inputs, outputs, where)] = (case, inputs, outputs, tag, where, 1)
                else:
                    self.errors.append(f"case {case.hash}: a judge died judging it twice")
                continue
            except Exception as e:  # noqa: BLE001 - kfuzz's side failed: counted and named, not a verdict
                self.errors.append(f"case {case.hash}: {type(e).__name__}: {e}")
                continue
            self.seconds += seconds
            out.append((tag, Verdict.from_json(self.target.name, verdict_json)))
        return out

    def _renew(self, where: str) -> None:
        """A fresh pool for ``where`` if a judge of it died (once for all its pending results)."""
        pool = self.pools[where]
        if getattr(pool, "_broken", False):
            pool.shutdown(wait=False, cancel_futures=True)
            self.pools[where] = self._pool(where, self.share[where])
            self.restarts += 1

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
        for pool in self.pools.values():
            processes = list((getattr(pool, "_processes", None) or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for p in processes:
                if p.is_alive():
                    p.kill()
        self.pools = {}
