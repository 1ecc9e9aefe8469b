"""A kernel's oracle process and the audit's handle on it (``KernelProcess``).

Every kernel gets its own process, forked from the audit's forkserver, which never touches
CUDA (``kfuzz.audit.policy.forkserver_context``), in a process group of its own: the kernel's
workers and their forkserver end with it. There it runs ``audit_kernel`` and sends each result
up a pipe as it ends. CUDA extensions built by ``load_inline`` go to ``TORCH_EXTENSIONS_DIR`` =
``<cache>/<hash of the solution's source>``, so a rerun never rebuilds one and kernels with the
same extension name never collide; each build runs ``MAX_JOBS`` ninja jobs.

The auditing process keeps the kernel's record (``base_record``, then what arrives) and kills
the kernel's process group after ``timeout`` seconds (the build gets its own limit,
``build_timeout``; what finished is kept) or once its record is written. A kernel's process
does not outlive the audit's, however that ends.
"""
from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING

from kfuzz.audit.kernel import audit_kernel, error_kind

if TYPE_CHECKING:
    from kfuzz.kernelbench.corpus import CorpusEntry


def _ends_with(pid: int, started: int | None) -> None:
    """From now on, this process's group (the kernel's oracle process, its zygote and workers)
    is killed within a second of process ``pid`` (the audit's, started at ``started``) ending,
    however it ends (SIGKILL included): no kernel runs on unsupervised."""
    import threading
    from kfuzz.processes import running

    def watch() -> None:
        while running(pid, started):
            time.sleep(1.0)
        os.killpg(0, signal.SIGKILL)
    threading.Thread(target=watch, daemon=True, name="kfuzz-audit-supervisor").start()


def _child(conn, entry: CorpusEntry, device: str, gates: list[str], seed: int, cache: str | None,
           threads: int, max_jobs: int, timeout: float, policy: dict | None, pch: str | None = None,
           cases: str | None = None, build_timeout: float | None = None, stubs: str | None = None,
           slim: bool = True, build_only: bool = False, supervisor: tuple[int, int | None] | None = None,
           built: dict | None = None) -> None:
    """The kernel's oracle process (``audit_kernel``), sending what it finds through ``conn``;
    ``supervisor``: the audit's process (pid, start), which it does not outlive (unless its start
    could not be read: then it is not watched)."""
    os.setsid()     # one process group a kernel: its workers and their forkserver end with it
    from kfuzz.kernelbench.cuda_compile import SLIM_ENV
    from kfuzz.kernelbench.pch import PCH_ENV
    if pch:
        os.environ[PCH_ENV] = pch
    os.environ[SLIM_ENV] = "1" if slim else "0"
    if stubs:       # Triton's driver stubs, built once by the audit: each worker copies them
        from kfuzz.sandbox import STUBS_ENV
        os.environ[STUBS_ENV] = stubs
    if cache and entry.pair is not None:
        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(cache, entry.pair.custom_sha)
        # made now: a worker may write only beneath directories that exist when it is confined
        os.makedirs(os.environ["TORCH_EXTENSIONS_DIR"], exist_ok=True)
    os.environ["MAX_JOBS"] = str(max_jobs)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import warnings
    import torch
    import torch._dynamo  # noqa: F401  (model code and G10 import it: once here, not in each worker)
    import kfuzz.kernelbench, kfuzz.kernelbench.build, kfuzz.programs  # noqa: F401,E401  (preloaded)
    import kfuzz.kernelbench.cuda_compile, kfuzz.kernelbench.pch  # noqa: F401,E401  (preloaded)
    from kfuzz.workers import fork_server_here
    torch.set_num_threads(threads)
    warnings.simplefilter("ignore")     # the kernels' own warnings are not the audit's output
    # the kernel's workers are forked from a copy of this process as it is now (all of the above
    # set): everything imported, no CUDA yet, nothing of the oracle's, no pipe to the audit's parent
    fork_server_here(close=(conn.fileno(),))
    if supervisor is not None and supervisor[1] is not None:    # a thread, started after the zygote's fork
        _ends_with(*supervisor)
    try:
        audit_kernel(entry, device, gates, seed, lambda kind, d: conn.send((kind, d)), timeout,
                     os.environ.get("TORCH_EXTENSIONS_DIR"), policy, build_only, cases, pch, build_timeout, built)
    except BaseException as e:   # what audit_kernel did not catch still reaches the record
        conn.send(("error", {"error": f"{type(e).__name__}: {e}"[:1000], "exc_type": error_kind(e)}))
    conn.send(("done", {}))
    conn.close()
    os._exit(0)     # skip interpreter teardown: a broken extension may crash it


def base_record(entry: CorpusEntry) -> dict:
    p = entry.pair
    rec = {"key": entry.key, "expect": entry.expect}
    if p is not None:
        rec.update(name=p.name, model=p.model, level=p.level, problem=p.problem, sha=p.sha,
                   target=p.target_name, compiles=entry.compiles, cpu_runnable=entry.cpu_runnable,
                   mode="eval" if p.eval_mode else "train")
    if entry.skip:
        rec["skip"] = entry.skip
    return rec


class KernelProcess:
    """A kernel's oracle process as the audit sees it: started, its record so far, its deadline,
    how it ended."""

    def __init__(self, ctx, entry, args, timeout: float, build_only: bool = False, alone: bool = False,
                 build_timeout: float | None = None, built: dict | None = None):
        """``timeout``: the kernel's limit; ``build_timeout``: its build's (default ``timeout``),
        from the start of a solution that compiles until its next step begins; ``built``: the
        facts of its build run ahead (``audit_kernel``'s ``built``)."""
        self.entry, self.start, self.timeout, self.alone = entry, time.monotonic(), timeout, alone
        builds = entry.compiles and built is None
        self.deadline = self.start + ((build_timeout or timeout) if builds else timeout)
        # kernel_side: where the solution ran (records before it ran it beside the oracle);
        # trusted_on: where the gates ran the reference in float32, the trusted implementation
        # that scales the bound (where the kernel ran; a record without it ran it on the CPU)
        self.record = {**base_record(entry), "gates": {}, "device": args[0], "kernel_side": "sandboxed workers",
                       "trusted_on": args[0], "timeout": timeout}
        self.conn, child = ctx.Pipe(duplex=False)
        # not a daemon: it starts the kernel's workers (run_audit kills it, whatever happens)
        from kfuzz.processes import started_at
        supervisor = (os.getpid(), started_at(os.getpid()))
        self.proc = ctx.Process(target=_child, args=(child, entry, *args),
                                kwargs={"build_only": build_only, "supervisor": supervisor, "built": built},
                                daemon=False,
                                name=f"kfuzz-{'build' if build_only else 'audit'}-{entry.key}")
        self.proc.start()
        child.close()

    def take(self, kind: str, d: dict) -> None:
        if kind == "gate":
            self.record["gates"][d["gate"]] = d
        elif kind == "phase":
            if self.record.get("phase") == "build":    # the build had its own limit
                self.deadline = time.monotonic() + self.timeout
            self.record["phase"] = str(d.get("phase"))
        elif kind in ("build", "standard", "weights", "adapter", "unbuilt", "error", "starts", "cpu"):
            self.record[kind] = d

    def ended(self) -> str | None:
        """How the kernel's process has ended, taking what it sent: "done" (its record handed
        up), "crash" (the process or its pipe gone first) or "timeout" (past its deadline); None
        while it runs."""
        try:
            while self.conn.poll():
                kind, d = self.conn.recv()
                if kind == "done":
                    return "done"
                self.take(kind, d)
        except (EOFError, OSError):
            return "crash"
        if not self.proc.is_alive() and not self.conn.poll():
            return "crash"
        if time.monotonic() >= self.deadline:
            return "timeout"
        return None

    def kill(self) -> None:
        """End the kernel's process group: its oracle process, the workers and their forkserver."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.kill()

    def end(self, how: str | None) -> dict:
        if how is not None:
            self.record["ended"] = how
        self.record["seconds"] = round(time.monotonic() - self.start, 3)
        return self.record
