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

A judge is a spawned process with a pipe of its own: kfuzz sends it the case and the
tensors' raw bytes (``kfuzz.wire``; a large message through a sender thread, so that kfuzz
never waits on a busy judge) and reads its verdict back, with no other thread in kfuzz's
process. Results come back in the order they finish (``done``). With ``processes=0`` the
judge runs in the caller's process, at ``submit``.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Callable, Hashable

import torch

from kfuzz.case import Case
from kfuzz.execute import judge, release_device_memory
from kfuzz.launcher import helpers_ignore_ctrl_c
from kfuzz.target import Target, load_target
from kfuzz.verdict import Verdict
from kfuzz.wire import Outbox, geometry, pack, rebuild, unpack

MEMORY_SHARE = 0.5          # of a GPU's memory, for all of its judges together


def judge_within_memory(case: Case, target: Target, inputs: dict, outputs: dict, device: str) -> tuple[dict, bool]:
    """``execute.judge`` on ``device``, or on the CPU where the GPU's memory left to this
    process does not hold the case's oracle; the memory it cached goes back to the GPU. The
    verdict's JSON, and whether it was judged on the CPU for want of the GPU's memory."""
    try:
        return judge(case, target, inputs, outputs, device).to_json(), False
    except torch.OutOfMemoryError:
        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()
        return judge(case, target, inputs, outputs, "cpu").to_json(), True
    finally:
        release_device_memory(device)


def free_memory(device: str) -> int | None:
    """Bytes free on ``device``'s GPU, all processes counted (None on the CPU, or where the GPU
    cannot say: a context that a CUDA error left unusable)."""
    if not str(device).startswith("cuda"):
        return None
    try:
        return torch.cuda.mem_get_info(device)[0]
    except RuntimeError:
        return None


def judge_message(case: Case, inputs: dict, outputs: dict) -> bytes:
    """The message that asks a judge for ``case``'s verdict on the kernel's ``outputs``."""
    items = [("in", k, t) for k, t in inputs.items()] + [("out", k, t) for k, t in outputs.items()]
    return pack((case.to_json(), [(role, k, geometry(t)) for role, k, t in items]), [t for _, _, t in items])


def judged(msg: bytes, target: Target, device: str) -> tuple:
    """A judge's answer to a ``judge_message``: ``("verdict", verdict JSON, seconds, memory)``,
    or ``("error", the oracle's own exception, seconds, memory)``; ``memory``: whether the
    case was judged on the CPU for want of the GPU's memory, and the bytes free on the GPU
    once the judge gave back what it cached (``free_memory``)."""
    (case_json, layouts), storages = unpack(msg)
    got: dict[str, dict] = {"in": {}, "out": {}}
    for (role, k, geo), st in zip(layouts, storages):
        got[role][k] = rebuild(st, geo)
    start = time.monotonic()
    try:
        verdict, on_cpu = judge_within_memory(Case.from_json(case_json), target, got["in"], got["out"], device)
        return ("verdict", verdict, time.monotonic() - start, (on_cpu, free_memory(device)))
    except Exception as e:  # noqa: BLE001 - the oracle's own error: kfuzz's, named by the caller
        return ("error", f"{type(e).__name__}: {e}"[:2000], time.monotonic() - start, (False, free_memory(device)))


def _serve(conn: Connection, name: str, module: str | None, threads: int, device: str,
           memory_fraction: float) -> None:
    """A judge process: judge each message's case until the pipe closes; the answer is the
    verdict and the seconds judging took, or the oracle's own exception. A terminal's Ctrl-C
    reaches the whole process group: kfuzz's process ends its judges itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    if device.startswith("cuda"):    # a current device for autograd's own threads (cuBLAS)
        torch.cuda.set_device(torch.device(device) if ":" in device else 0)
        torch.cuda.set_per_process_memory_fraction(memory_fraction)
    target = load_target(name, module)
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return
        answer = judged(msg, target, device)
        del msg
        conn.send_bytes(pack(answer, []))


@dataclass
class _Job:
    case: Case
    inputs: dict
    outputs: dict
    tag: object
    tries: int = 0
    size: int = 0          # bytes of its message, unread by the judge until it answers


@dataclass
class _Judge:
    """One judge process, its pipe, and the jobs sent to it (answered in order)."""

    process: multiprocessing.process.BaseProcess
    conn: Connection
    outbox: Outbox
    device: str
    jobs: list = field(default_factory=list)
    discard: int = 0                               # answers still due for dropped jobs


class Judges:
    """``processes`` judges for ``target`` on ``device`` (0: judge in this process); ``devices``
    (GPUs) splits them among the GPUs, and ``submit`` takes the GPU a result came from."""

    def __init__(self, target: Target, processes: int = 0, device: str = "cpu", devices: list[str] | None = None,
                 account: Callable[[Case], Hashable] | None = None):
        """``account``: the class of a case its judging seconds are summed under (``by_account``:
        class -> [cases judged, seconds])."""
        self.target, self.processes, self.device = target, processes, device
        self.account = account
        self.by_account: dict[Hashable, list] = {}
        gpus = sorted(set(devices or [device]))
        self.share = {d: processes // len(gpus) + (i < processes % len(gpus)) for i, d in enumerate(gpus)}
        self.threads = max(1, (os.cpu_count() or 1) // (2 * processes)) if processes else 1
        self.judges: dict[str, list[_Judge]] = {}
        self.here: list[tuple[object, Verdict]] = []    # judged in this process, not yet asked for
        self.seconds = 0.0           # spent judging, summed over the judges
        self.restarts = 0            # judge processes that died and were replaced
        self.errors: list[str] = []  # the oracle's or trusted implementation's own exceptions
        self.on_cpu = 0              # cases judged on the CPU for want of a GPU's memory
        self.least_free: int | None = None   # the fewest bytes free on a judge's GPU after a case

    def _spawn(self, device: str) -> _Judge:
        ctx = multiprocessing.get_context("spawn")     # a fresh interpreter, which may use CUDA
        mine, theirs = ctx.Pipe()
        fraction = MEMORY_SHARE / self.share[device] if device.startswith("cuda") else 1.0
        process = ctx.Process(target=_serve, name="kfuzz-judge", daemon=True,
                              args=(theirs, self.target.name, getattr(self.target.kernel, "__module__", None),
                                    self.threads, device, fraction))
        with helpers_ignore_ctrl_c():
            process.start()
        theirs.close()
        return _Judge(process, mine, Outbox(mine, "kfuzz-judge-sender"), device)

    def start(self) -> None:
        """Start every judge now, in the background (each imports torch and the target)."""
        for device, n in self.share.items():
            if self.processes and device not in self.judges:
                self.judges[device] = [self._spawn(device) for _ in range(n)]

    def _where(self, device: str | None) -> str:
        device = device or self.device
        if device in self.judges:
            return device
        return next(iter(self.judges), device)

    def submit(self, case: Case, inputs: dict, outputs: dict, tag: object = None, device: str | None = None) -> None:
        """Judge ``outputs`` of ``case`` on ``inputs``; ``tag`` comes back with the verdict.
        ``device``: the GPU the kernel ran on, whose judges take it."""
        self.start()
        where = self._where(device)
        if where not in self.judges:
            start = time.monotonic()
            try:
                verdict, on_cpu = judge_within_memory(case, self.target, inputs, outputs, where)
            except Exception as e:  # noqa: BLE001 - the oracle's own error: kfuzz's, counted and named
                self.errors.append(f"case {case.hash}: {type(e).__name__}: {e}")
                return
            self._spent(case, time.monotonic() - start)
            self._memory(on_cpu, free_memory(where))
            self.here.append((tag, Verdict.from_json(self.target.name, verdict)))
            return
        self._send(min(self.judges[where], key=lambda j: len(j.jobs)), _Job(case, inputs, outputs, tag))

    def _memory(self, on_cpu: bool, free: int | None) -> None:
        self.on_cpu += bool(on_cpu)
        if free is not None:
            self.least_free = free if self.least_free is None else min(self.least_free, free)

    def _spent(self, case: Case, seconds: float) -> None:
        self.seconds += seconds
        if self.account is not None:
            tally = self.by_account.setdefault(self.account(case), [0, 0.0])
            tally[0] += 1
            tally[1] += seconds

    def _send(self, judge_: _Judge, job: _Job) -> None:
        msg = judge_message(job.case, job.inputs, job.outputs)
        judge_.outbox.post(msg, sum(j.size for j in judge_.jobs))
        job.size = len(msg)
        judge_.jobs.append(job)

    @property
    def busy(self) -> int:
        return len(self.here) + sum(len(j.jobs) for js in self.judges.values() for j in js)

    def done(self, timeout: float | None = 0.0) -> list[tuple[object, Verdict]]:
        """The judged results (``tag``, verdict), waiting up to ``timeout`` seconds for one."""
        if self.here:
            out, self.here = self.here, []
            return out
        waiting = {j.conn: j for js in self.judges.values() for j in js if j.jobs or j.discard}
        if not waiting:
            return []
        out = []
        for conn in wait(list(waiting), timeout=timeout):
            j = waiting[conn]
            try:
                (kind, answer, seconds, (on_cpu, free)), _ = unpack(conn.recv_bytes())
            except (EOFError, OSError):
                self._replace(j)
                continue
            if j.discard:
                j.discard -= 1
                continue
            job = j.jobs.pop(0)
            self._spent(job.case, seconds)
            self._memory(on_cpu, free)
            if kind == "verdict":
                out.append((job.tag, Verdict.from_json(self.target.name, answer)))
            else:
                self.errors.append(f"case {job.case.hash}: {answer}")
        return out

    def _replace(self, dead: _Judge) -> None:
        """A fresh judge for one that died; the job it was judging is judged again, once,
        and the jobs queued behind it go to the replacement."""
        self._end(dead)
        self.restarts += 1
        fresh = self._spawn(dead.device)
        pool = self.judges[dead.device]
        pool[pool.index(dead)] = fresh
        for i, job in enumerate(dead.jobs):
            judging = i == 0 and not dead.discard      # else a dropped job's was
            if judging and job.tries:
                self.errors.append(f"case {job.case.hash}: a judge died judging it twice")
                continue
            job.tries += judging
            self._send(fresh, job)

    @staticmethod
    def _end(j: _Judge) -> None:
        if j.process.is_alive():
            j.process.kill()
        j.process.join(10)
        j.outbox.close()
        j.conn.close()

    def drop(self) -> int:
        """Forget the results not yet judged; how many."""
        n = self.busy
        self.here = []
        for js in self.judges.values():
            for j in js:
                j.discard += len(j.jobs)
                j.jobs = []
        return n

    def close(self) -> None:
        """Drop what is pending and end the judges now (one in the middle of a case too)."""
        self.drop()
        for js in self.judges.values():
            for j in js:
                self._end(j)
        self.judges = {}
