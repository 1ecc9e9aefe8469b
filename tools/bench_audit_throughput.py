"""The audit's throughput on compiled kernels: kernels an hour, compiles included, from a cold cache.

    python tools/bench_audit_throughput.py CORPUS... --limit 160 --budget 400 [--jobs 16]
        [--build-jobs 8] [--max-jobs N] [--timeout 150] [--build-timeout 600] [--device cuda]
        [--no-pch] [--no-slim-cuda] [--baseline]
        [--out DIR] [--key FILE] [--exclude RESULTS]

Takes ``--limit`` solutions that call ``load_inline`` (distinct sources, taken in turn from each
corpus file, so that every file and level is in the sample; with ``--exclude``, none whose kernel
already has a line in that ``results.jsonl``, so that a measurement also audits kernels not yet
audited, whose records can join those results when signed with the same ``--key``) and audits
them with ``kfuzz.audit.run_audit`` (every gate) into a fresh results folder and a fresh, empty
extension cache, until
all are recorded or ``--budget`` seconds have passed (the kernels still running then are stopped
and not counted). Prints, and writes to ``<out>/throughput.json``: kernels recorded, wall seconds,
kernels an hour (recorded / wall), the rate over the second half of the run, the build's share
of the kernels' time (build seconds, a kernel's own build step's or its build run ahead by
``--build-jobs`` (``ahead`` in its record's ``build``), over those and its process's seconds;
also for the kernels whose own build step compiled), the CPU seconds of a build's compilers
(``cpu_seconds`` in its record's ``build``), how many found a
precompiled header, how many builds failed
and how many solutions caught their build's error and ran a fallback, and the records' ends
(complete, killed for time, skipped), a worker start's mean seconds and their steps (the launch,
isolation, CUDA, Triton's driver, preloads, the target's import, confinement: printed below the
table), and the machine's CPU over the run (``/proc/stat``: the
share of its cores busy, and busy core-seconds per kernel recorded, which bounds the rate a
machine of as many cores can reach when the run keeps them busy), and those core-seconds by
process (printed below the table): the compilers, the kernel's oracle process and its workers
(``cpu`` in its record), and the rest (the audit's own process, the builds ahead's processes,
forkservers, the system). Needs a machine where
``kfuzz audit`` runs (``--allow-unconfined`` is passed: use it where the workers have no OS
sandbox layer, as the audit's docs say).

Prints a table, a row a run: with ``--baseline``, first the same sample audited one kernel at a
time with no build ahead, no precompiled header and CUDA files compiled as written (``--jobs 1
--build-jobs 0 --no-pch --no-slim-cuda``: the
audit as a plain loop), each run on a fresh cache and results folder, and the rate of the run
as asked over the baseline's (``/ baseline``). A run's rate counts only kernels recorded. A build
that fails (``build failed``, or ``fell back``: the solution caught the failure and ran PyTorch)
costs less compile than one that loads, so a sample's rate is that of its mix of both.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from kfuzz.audit import judge_record, results_key, run_audit
from kfuzz.kernelbench.build import fell_back
from kfuzz.kernelbench.corpus import read_corpus
from kfuzz.workers import add_seconds
from kfuzz.gates import GATES


def recorded_keys(results: Path) -> set[str]:
    """The kernel keys that have a line in a ``results.jsonl`` (signed or not; a torn line is skipped)."""
    keys = set()
    for line in results.read_text().splitlines():
        try:
            keys.add(json.loads(line)["key"])
        except (ValueError, KeyError, TypeError):
            continue
    return keys


def sample(corpora: list[str], limit: int, exclude: set[str] = frozenset()) -> list:
    """Compiling solutions with distinct sources, one from each corpus file in turn, none whose
    key is in ``exclude``."""
    per_file = [[e for e in read_corpus(p) if e.pair is not None and e.compiles and e.key not in exclude]
                for p in corpora]
    out, seen = [], set()
    while len(out) < limit and any(per_file):
        for rows in per_file:
            while rows:
                e = rows.pop(0)
                if e.pair.custom_sha not in seen:
                    seen.add(e.pair.custom_sha)
                    out.append(e)
                    break
            if len(out) >= limit:
                break
    return out


def machine_cpu() -> tuple[float, float] | None:
    """The whole machine's busy and total CPU seconds since boot, summed over its cores, from
    ``/proc/stat`` (busy: all but idle and I/O wait); None where there is no such file."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    ticks = [int(x) for x in fields[1:9]]       # user nice system idle iowait irq softirq steal
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - ticks[3] - ticks[4]) / tick, sum(ticks) / tick


def measure(entries, out: Path, budget: float, write=None, key: Path | None = None, **audit) -> dict:
    """Audit ``entries`` into ``out`` until done or ``budget`` seconds; the summary (``summary``),
    also handed to ``write`` after each record (so that a run stopped from outside leaves one).
    Records are signed with ``key`` (made if missing; default: ``<out>.key`` beside ``out``)."""
    key = key or out.parent / f"{out.name}.key"
    results_key(key)
    start, cpu = time.monotonic(), machine_cpu()

    def used() -> tuple[float, float] | None:
        now = machine_cpu()
        return None if cpu is None or now is None else (now[0] - cpu[0], now[1] - cpu[1])
    done: list[tuple[float, dict]] = []
    for rec in run_audit(entries, out, list(GATES), key=key, allow_unconfined=True, **audit):
        done.append((time.monotonic() - start, rec))
        if write is not None:
            write(summary(entries, done, time.monotonic() - start, audit, used()))
        if time.monotonic() - start >= budget:
            break
    return summary(entries, done, time.monotonic() - start, audit, used())


def summary(entries, done: list[tuple[float, dict]], wall: float, audit: dict,
            cpu: tuple[float, float] | None = None) -> dict:
    """The run's numbers (the module's docstring); ``cpu``: the machine's busy and total CPU
    seconds over the run (``machine_cpu``)."""
    recs = [r for _, r in done]
    built = [r for r in recs if isinstance(r.get("build"), dict) and r["build"].get("seconds") is not None]
    own_build = [r for r in built if not r["build"].get("ahead")]
    # a build ahead ran in a process of its own, before the kernel's: outside the record's seconds
    ahead_s = sum(float(r["build"]["seconds"]) for r in built if r["build"].get("ahead"))
    build_s = sum(float(r["build"]["seconds"]) for r in built)
    kernel_s = sum(float(r.get("seconds") or 0) for r in built) + ahead_s
    compiled = [r for r in own_build if float(r["build"]["seconds"]) > 5.0]
    half = [t for t, _ in done if t >= wall / 2]
    # the compilers' CPU seconds per kernel whose build compiled
    cpus = [c for c in (float(r["build"].get("cpu_seconds") or 0) for r in built) if c > 0]
    first = done[0][0] if done else None
    ends = {"complete": sum(not judge_record(r)["incomplete"] and judge_record(r)["audited"] for r in recs),
            "killed for time": sum(judge_record(r)["incomplete"] for r in recs),
            "not judged (unbuilt, adapter, skipped)": sum(not judge_record(r)["audited"] for r in recs)}
    # where the kernels' own seconds go: the steps a record times, and the rest (the kernel
    # process's and its workers' starts, saving the records)
    steps = {"standard": sum(float((r.get("standard") or {}).get("seconds") or 0) for r in recs),
             "weights": sum(float((r.get("weights") or {}).get("seconds") or 0) for r in recs),
             "gates": sum(float(g.get("seconds") or 0) for r in recs for g in r.get("gates", {}).values()),
             "minimize": sum(float(g.get("minimize_seconds") or 0) for r in recs for g in r.get("gates", {}).values())}
    own = sum(float(r.get("seconds") or 0) for r in recs)
    steps["build"] = sum(float(r["build"]["seconds"]) for r in own_build)
    steps["rest"] = own - sum(steps.values())
    starts = sum(float((r.get("starts") or {}).get("seconds") or 0) for r in recs)   # within the others
    workers = sum(int((r.get("starts") or {}).get("workers") or 0) for r in recs)
    steps_of_starts: dict[str, float] = {}
    for r in recs:
        add_seconds(steps_of_starts, (r.get("starts") or {}).get("phases") or {})
    # the machine's core-seconds a kernel by process: the compilers (its builds'), its oracle
    # process and its workers (its record's ``cpu``), and the rest (the audit's own process, the
    # builds ahead's processes, forkservers, the system)
    by_process = {"compilers": sum(cpus),
                  **{k: sum(float((r.get("cpu") or {}).get(k) or 0) for r in recs) for k in ("oracle_process", "workers")}}
    if cpu and recs:
        by_process["rest"] = cpu[0] - sum(by_process.values())
    return {
        "sample": len(entries), "recorded": len(recs), "wall_s": round(wall, 1),
        "kernels_per_hour": round(3600 * len(recs) / wall, 1) if wall else None,
        "kernels_per_hour_second_half": round(3600 * len(half) / (wall / 2), 1) if wall else None,
        "first_record_s": None if first is None else round(first, 1),
        "build_share": round(build_s / kernel_s, 3) if kernel_s else None,
        "build_share_where_compiled_here": round(sum(float(r["build"]["seconds"]) for r in compiled) / max(
            1e-9, sum(float(r.get("seconds") or 0) for r in compiled)), 3) if compiled else None,
        "build_seconds_mean": round(build_s / len(built), 1) if built else None,
        "build_cpu_seconds_mean": round(sum(cpus) / len(cpus), 1) if cpus else None,
        "compiled_in_own_step": len(compiled),
        "built_ahead": len(built) - len(own_build),
        "build_failed": sum((r.get("build") or {}).get("status") == "failed" for r in recs),
        "fell_back": sum(fell_back(r.get("build")) for r in recs), "with_precompiled_header": sum(bool(r["build"].get("pch")) for r in built),
        "cuda_slimmed": sum(bool(r["build"].get("slim")) for r in built),
        "cuda_slim_refused": sum(bool(r["build"].get("slim_refused")) for r in built),
        "kernel_seconds_mean": round(own / max(1, len(recs)), 1),
        "cpu_busy_share": round(cpu[0] / cpu[1], 3) if cpu and cpu[1] else None,
        "core_seconds_per_kernel": round(cpu[0] / len(recs), 1) if cpu and recs else None,
        **{f"{k}_share": round(v / own, 3) if own else None for k, v in steps.items() if k != "build"},
        "worker_starts_share": round(starts / own, 3) if own else None,
        "worker_start_seconds_mean": round(starts / workers, 3) if workers else None,
        "worker_start_steps_mean": {k: round(v / workers, 3) for k, v in steps_of_starts.items()} if workers else {},
        "core_seconds_per_kernel_by_process": ({k: round(v / len(recs), 1) for k, v in by_process.items()}
                                               if recs else {}),
        "ends": ends, "settings": {k: v for k, v in audit.items() if k != "cache"},
    }


COLUMNS = ("recorded", "wall_s", "kernels_per_hour", "kernels_per_hour_second_half", "first_record_s", "build_share",
           "build_seconds_mean", "build_cpu_seconds_mean", "compiled_in_own_step", "built_ahead", "build_failed", "fell_back",
           "with_precompiled_header", "cuda_slimmed", "cuda_slim_refused",
           "kernel_seconds_mean", "gates_share", "minimize_share", "rest_share", "worker_starts_share",
           "cpu_busy_share", "core_seconds_per_kernel")
ENDS = ("complete", "killed for time")


def table(runs: list[tuple[str, dict]]) -> str:
    """The runs (name, summary) as a markdown table; with two or more, the last column is each
    run's rate over the first run's."""
    head = ["run", *COLUMNS, *ENDS] + (["/ baseline"] if len(runs) > 1 else [])
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    base = runs[0][1].get("kernels_per_hour")
    for name, r in runs:
        cells = [name, *(str(r.get(c, "")) for c in COLUMNS), *(str(r["ends"][e]) for e in ENDS)]
        if len(runs) > 1:
            rate = r.get("kernels_per_hour")
            cells.append(f"{rate / base:.2f}" if rate and base else "")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpora", nargs="+")
    ap.add_argument("--limit", type=int, default=160)
    ap.add_argument("--budget", type=float, default=400.0, help="seconds of auditing before stopping")
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--build-jobs", type=int, default=8)
    ap.add_argument("--max-jobs", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=150.0)
    ap.add_argument("--build-timeout", type=float, default=600.0,
                    help="seconds a solution's build may take, apart from --timeout (kfuzz audit's default)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pch", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--slim-cuda", action=argparse.BooleanOptionalAction, default=True,
                    help="kfuzz audit's --slim-cuda (the CUDA file's torch frontend includes slimmed)")
    ap.add_argument("--out", default=None, help="folder for results.jsonl and throughput.json (default: a new temp one)")
    ap.add_argument("--key", default=None, help="the results key (made if missing; default: OUT/audit.key)")
    ap.add_argument("--exclude", type=Path, action="append", default=[], metavar="RESULTS",
                    help="a results.jsonl whose kernels are left out of the sample (repeatable)")
    ap.add_argument("--baseline", action="store_true",
                    help="first audit the sample as a plain loop (--jobs 1 --build-jobs 0 --no-pch --no-slim-cuda), "
                         "the ratio's base")
    a = ap.parse_args(argv)
    missing = [str(r) for r in a.exclude if not r.is_file()]
    if missing:
        ap.error(f"--exclude: no such results file: {', '.join(missing)}")
    entries = sample(a.corpora, a.limit, set().union(*(recorded_keys(r) for r in a.exclude)))
    if not entries:
        ap.error("no compiling solution in these corpora")
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="kfuzz-throughput-"))
    out.mkdir(parents=True, exist_ok=True)
    key = Path(a.key) if a.key else None
    asked = dict(jobs=a.jobs, build_jobs=a.build_jobs, pch=a.pch, slim=a.slim_cuda)
    plans = ([("baseline", dict(jobs=1, build_jobs=0, pch=False, slim=False))] if a.baseline else []) + [("kfuzz audit", asked)]
    runs: list[tuple[str, dict]] = []
    for name, settings in plans:
        folder = out if len(plans) == 1 else out / name.replace(" ", "-")
        folder.mkdir(parents=True, exist_ok=True)
        cache = Path(tempfile.mkdtemp(prefix="kfuzz-throughput-cache-"))      # cold

        def write(result: dict, folder=folder) -> None:
            (folder / "throughput.json").write_text(json.dumps(result, indent=1))
        result = measure(entries, folder / "audit", a.budget, write, key=key, device=a.device, timeout=a.timeout,
                         build_timeout=a.build_timeout, cache=cache, max_jobs=a.max_jobs, **settings)
        write(result)
        runs.append((f"{name} (jobs {settings['jobs']}, build-jobs {settings['build_jobs']}, "
                     f"{'pch' if settings['pch'] else 'no pch'}, {'slim' if settings['slim'] else 'no slim'})", result))
    print(f"{len(entries)} compiling solutions sampled, --budget {a.budget:g} s a run, device {a.device}\n")
    print(table(runs))
    for name, summary in runs:
        steps = ", ".join(f"{k} {v:g}" for k, v in summary.get("worker_start_steps_mean", {}).items())
        print(f"\n{name}: a worker start {summary.get('worker_start_seconds_mean')} s on average"
              + (f" ({steps})" if steps else ""))
        parts = ", ".join(f"{k} {v:g}" for k, v in summary.get("core_seconds_per_kernel_by_process", {}).items())
        if parts:
            print(f"{name}: core-seconds a kernel by process: {parts} (of {summary.get('core_seconds_per_kernel')})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
