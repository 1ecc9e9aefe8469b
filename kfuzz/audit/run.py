"""The audit over a corpus (``run_audit``): its kernels, several at once, one signed record each.

Each kernel runs in a process of its own (``kfuzz.audit.process``), ``jobs`` at once
(``default_jobs``), while builds of solutions further down the queue run ahead of their
judging; each record is appended once its kernel's process has ended
(``kfuzz.audit.results``). A kernel that ran out of a GPU's memory beside other kernels, or
found that GPU busy, is run again at the end, alone.

Refuses (``KfuzzError``), before any kernel runs: an audit key or an extension cache inside the
results folder; a missing key where the results hold records signed under one; and, unless
``allow_unconfined``, a machine whose OS layers would not block the kernels' network, writes or
processes (``kfuzz.audit.policy.confinement``). Untrusted code runs only under such a layer.
"""
from __future__ import annotations

import os
import shutil
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from kfuzz.audit.builds import (PCH_FOLDER, check_build_step, default_cache, default_max_jobs, driver_stubs,
                                precompile_headers)
from kfuzz.audit.kernel import CASES
from kfuzz.audit.policy import confinement, forkserver_context, unconfined_layers
from kfuzz.audit.process import KernelProcess, base_record
from kfuzz.audit.results import RESULTS, append_record, done_keys, key_path, read_results, results_key, signed_lines
from kfuzz.audit.verdicts import ended_by_gpu_state
from kfuzz.devices import shares_memory
from kfuzz.errors import KfuzzError

if TYPE_CHECKING:
    from kfuzz.kernelbench.corpus import CorpusEntry


GPU_JOBS = 16       # kernels at once on a GPU by default, at most: the configuration measured (docs/audit.md)


def default_jobs(device: str, jobs: int | None = None) -> tuple[int, int]:
    """Kernels audited at once (``jobs`` where given) and builds run ahead, by default: on a GPU,
    one kernel a core of this machine (at most ``GPU_JOBS``) and half as many builds ahead (the
    cores compile while the GPU judges the kernels already built); on the CPU, one kernel and no
    build ahead (a kernel's workers, its oracle and the compilers there all share the cores)."""
    gpu = str(device).startswith("cuda")
    if jobs is None:
        jobs = max(1, min(GPU_JOBS, os.cpu_count() or 1)) if gpu else 1
    return jobs, jobs // 2 if gpu else 0


def _beneath(a: Path, b: Path) -> bool:
    return a == b or b in a.parents


def run_audit(entries: Iterable[CorpusEntry], out: str | Path, gates: list[str], jobs: int = 1,
              device: str = "cpu", seed: int = 0, timeout: float = 300.0, cache: str | Path | None = None,
              threads: int = 1, max_jobs: int | None = None, retry: bool = False, key: str | Path | None = None,
              trust_unsigned: bool = False, allow_unconfined: bool = False, policy: dict | None = None,
              build_jobs: int = 0, pch: bool = True, redo: Iterable[str] = (),
              build_timeout: float | None = None, slim: bool = True, redo_unsigned: bool = False,
              in_flight: dict | None = None) -> Iterator[dict]:
    """Audit ``entries`` not yet validly recorded in ``out`` (with ``retry``, also those whose run
    did not finish; and those whose key is in ``redo``, whatever their record says; with
    ``redo_unsigned``, those whose record carries no HMAC: an older kfuzz's, made before results
    were signed, each redone once, since its new record is signed), those audited before first,
    the slowest by their last record's ``seconds`` first, then the others in their order; yields
    each record once appended, signed with the key at ``key`` (by default ``key_path()``). A kernel
    that ran out of a GPU's memory beside other kernels (``shares_memory``), or found that GPU
    busy or unavailable, is run again at the end, alone, and only that record is kept
    (``alone``; at ``jobs`` 1 every record is alone).
    Refuses (``KfuzzError``) a key or an extension ``cache`` inside ``out`` (or ``out`` inside the
    cache), a key file that does not exist where ``out``'s results hold signed records (the key
    that signed them is elsewhere or lost: a new one would verify none of them), and, unless
    ``allow_unconfined``, a machine where an OS layer would not block the kernels' network,
    writes or processes (``confinement``). ``policy``: overrides of the
    kernels' sandbox Policy fields. ``max_jobs``: ninja's jobs in each build (default:
    ``$MAX_JOBS``, else this machine's cores shared among the ``jobs`` kernels at once).
    ``build_jobs``: builds of solutions further down the queue that run ahead of their judging (a
    compile phase beside the judging); a kernel built ahead starts once its build has ended, with
    that build's facts (``ahead`` in its record's ``build``) and no build step of its own.
    ``pch``: precompile torch's extension header for the builds (``precompile_headers``, beside the
    first kernels; a build whose header is still being made waits for it). ``slim``: compile a
    ``load_inline`` CUDA file with its torch frontend includes slimmed where it compiles so
    (``kfuzz.kernelbench.cuda_compile.use_slim_cuda``). ``build_timeout``: the seconds a solution's build
    may take, apart from ``timeout`` (default ``timeout``). Before the first solution that
    compiles, kfuzz's probe solution is built in the same confined build step
    (``check_build_step``: a ``KfuzzError`` where it does not build). ``in_flight``: a dict
    that, when the audit is stopped early (closed), is filled with what it leaves unrecorded
    (``unfinished``)."""
    entries = list(entries)
    out_dir = Path(out).resolve()
    key_file = Path(key).resolve() if key is not None else key_path().resolve()
    if _beneath(key_file, out_dir):
        raise KfuzzError(f"{key_file}: the audit key must be kept outside the results folder {out_dir}")
    cache_dir = Path(cache).resolve() if cache else default_cache().resolve()
    if _beneath(out_dir, cache_dir) or _beneath(cache_dir, out_dir):
        raise KfuzzError(f"{cache_dir}: the extension cache (where builds write) and the results folder "
                         f"{out_dir} must not contain one another")
    if not key_file.exists() and signed_lines(out_dir / RESULTS):
        raise KfuzzError(f"{key_file}: no audit key, and {out_dir / RESULTS} holds records signed under one: give "
                         f"the key that signed them (--key FILE, $KFUZZ_AUDIT_KEY); a new key would verify none "
                         f"of them and audit every kernel again")
    secret = results_key(key_file)
    before = read_results(out_dir / RESULTS, secret, trust_unsigned)
    done = done_keys(out, retry, entries, secret, trust_unsigned, redo_unsigned, results=before) - set(redo)
    todo = [e for e in entries if e.key not in done]
    # kernels audited before (a retry, a redo) first, the slowest first: a run cut short spends
    # its time on the kernels that need the most of it, each started with all of it
    todo.sort(key=lambda e: -float(before[e.key].get("seconds") or 0.0) if e.key in before else 0.0)
    if any(e.pair is not None for e in todo) and not allow_unconfined:
        report = confinement(device, policy)
        missing = unconfined_layers(report)
        if missing:
            raise KfuzzError("this machine's sandbox would not block the kernels' " + ", ".join(
                f"{k} ({report.get(k, 'unknown')})" for k in missing) + "; the audit runs untrusted code only "
                "under an OS layer (pass allow_unconfined, --allow-unconfined in the CLI, to run it with what is here)")
    ctx = forkserver_context()
    if max_jobs is None:
        max_jobs = default_max_jobs(jobs)
    compiling = [e for e in todo if e.compiles]
    pch_root = str(cache_dir / PCH_FOLDER) if pch and compiling else None
    if compiling:
        check_build_step(device, cache_dir, policy, pch_root=pch_root)
    if pch_root:
        import threading
        threading.Thread(target=precompile_headers, args=(compiling, pch_root), daemon=True,
                         name="kfuzz-audit-pch").start()
    stubs = driver_stubs(device) if any(e.pair is not None for e in todo) else None
    args = (device, gates, seed, str(cache_dir), threads, max_jobs, timeout, dict(policy or {}), pch_root,
            str(out_dir / CASES), build_timeout, stubs, slim)
    running: list[KernelProcess] = []
    builders: list[KernelProcess] = []     # builds ahead of judging: no record of their own
    ahead_builds: dict[str, dict] = {}  # their build facts, their kernel's build when it starts
    queue = list(todo)
    ahead = [e for e in queue if e.compiles]
    shared_gpu = shares_memory(device) and jobs > 1
    alone: list[CorpusEntry] = []     # out of GPU memory (or the GPU busy) beside others: again, alone, at the end
    try:
        while queue or running or alone:
            if not queue and not running:
                running.append(KernelProcess(ctx, alone.pop(0), args, timeout, alone=True, build_timeout=build_timeout))
            # a kernel whose build ahead still runs waits for it: it then starts with that build's
            # facts and builds nothing itself (two builds of one folder at once would race on
            # torch's lock: the second imports what the first failed to build)
            building = {b.entry.key for b in builders}
            while len(running) < jobs:
                entry = next((e for e in queue if e.key not in building), None)
                if entry is None:
                    break
                queue.remove(entry)
                if entry in ahead:
                    ahead.remove(entry)
                if entry.pair is None:
                    record = base_record(entry)
                    append_record(out, record, secret)
                    yield record
                    continue
                running.append(KernelProcess(ctx, entry, args, timeout, build_timeout=build_timeout,
                                             built=ahead_builds.pop(entry.key, None)))
            if not running and not builders:
                continue
            while ahead and len(builders) < build_jobs:
                builders.append(KernelProcess(ctx, ahead.pop(0), args, timeout, build_only=True,
                                              build_timeout=build_timeout))
            deadline = min(r.deadline for r in running + builders)
            wait([r.conn for r in running + builders] + [r.proc.sentinel for r in running + builders],
                 timeout=max(0.0, deadline - time.monotonic()))
            for b in list(builders):
                try:
                    while b.conn.poll():
                        kind, d = b.conn.recv()
                        if kind == "build" and isinstance(d, dict):
                            ahead_builds[b.entry.key] = d
                except (EOFError, OSError, ValueError, TypeError):
                    pass
                if not b.proc.is_alive() or time.monotonic() >= b.deadline:
                    b.kill()
                    b.proc.join(10)
                    b.conn.close()
                    builders.remove(b)
            for r in list(running):
                how = r.ended()
                if how is None:
                    continue
                r.kill()          # also after "done": nothing of the kernel outlives its record
                r.proc.join(10)
                if how == "crash":
                    how = f"crash (exit {r.proc.exitcode})"
                record = r.end(None if how == "done" else how)
                running.remove(r)
                r.conn.close()
                if shared_gpu and not r.alone and ended_by_gpu_state(record):
                    alone.append(r.entry)
                    continue
                if r.alone or (shares_memory(device) and jobs == 1):
                    record["alone"] = True
                append_record(out, record, secret)
                yield record
    finally:   # a caller that stops early (an interrupt): no kernel outlives the audit
        if in_flight is not None:
            in_flight.update(unfinished(running, builders, alone))
        for r in running + builders:
            r.kill()
            r.proc.join(10)
        if stubs:
            shutil.rmtree(stubs, ignore_errors=True)


def unfinished(running: list[KernelProcess], builders: list[KernelProcess], alone: list[CorpusEntry]) -> dict:
    """What an audit stopped now leaves unrecorded, by key, in words: a kernel's phase, its
    seconds so far and the gates it finished (``alone`` where it ran again alone); a build ahead
    of its judging; a kernel waiting to run again alone."""
    now = time.monotonic()
    left = {}
    for r in running:
        gates = ",".join(r.record["gates"]) or "none"
        left[r.entry.key] = (f"{r.record.get('phase', 'starting')}, {now - r.start:.0f} s, gates done: {gates}"
                             + (", alone" if r.alone else ""))
    for b in builders:
        left[b.entry.key] = f"building ahead, {now - b.start:.0f} s"
    for e in alone:
        left[e.key] = "waiting to run again alone (out of the GPU's memory or the GPU busy beside others)"
    return left
