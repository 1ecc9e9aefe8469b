"""How fast a campaign judges cases: `kfuzz run` as a user runs it, against a bare loop.

For each target and each ``--jobs`` value, a campaign (``kfuzz run --time SECONDS``, its
minimizer off) runs twice in a process of its own: *cold*, with empty JIT caches
(Triton's and ``TORCH_EXTENSIONS_DIR``, in a fresh folder), then *warm*, on the caches the
cold run filled. From its ``--stats-json``:

- judged executions per second over the campaign's whole time (worker startup included);
- seconds to the first judged case;
- the time spent compiling, in the kernel (compiles excluded) and in the oracle and the
  trusted implementation, each summed over kfuzz's processes and given as a share of the
  campaign's wall time (with several workers and judges a share can pass 100%).

The bare loop is the same cases (the random engine, same seed, drawn through the same
compile-aware scheduler, ``kfuzz.schedule``, reading the compile history the cold campaign left
in the cache) in one process: the kernel called directly,
then the oracle and the trusted implementation (``execute.judge``), no sandbox, no contract
checks, no pipes; on warm caches. The ratio is kfuzz's warm rate over it. The table is printed in Markdown. A benchmark, not a test:

    python tools/bench_campaign.py --targets softmax,gdn_fwd,gdn_bwd --jobs 1,4,8 --seconds 300
    python tools/bench_campaign.py --targets softmax --jobs 1 --seconds 20     # a CPU smoke run

``--judges N`` gives every campaign N judges instead of kfuzz's default (one a worker on a
GPU), to compare in one call.

``--phases`` runs some of the three (``cold``, ``warm``, ``bare``), and ``--cache DIR`` keeps
each target's and ``--jobs`` value's caches in ``DIR/<target>-<jobs>`` (made where missing,
reused where there), so that the runs of one row can be split across separate runs of this
tool: the cold campaign in one, then, with ``DIR`` carried over, the warm campaign and the bare
loop in another (a warm row's ratio needs the bare loop in the same run). ``--bare-seconds``
runs the bare loop for other than ``--seconds`` (its rate, warm and with nothing to compile
after its first cases, is steady: a shorter loop saves a device's time).

A failure a campaign finds is listed beneath the table (its signature, count and saved case);
``--cases DIR`` copies each saved case there (``<target>-<jobs>-<caches>-<file>``), so that it
outlives a work folder on a machine that is given back.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def _env(cache: Path) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache / "triton"), TORCH_EXTENSIONS_DIR=str(cache / "ext"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    return env


def campaign(target: str, jobs: int, seconds: float, device: str, cache: Path, work: Path, seed: int,
             judges: int | None = None) -> dict:
    """One `kfuzz run` in its own process (``judges``: its ``--judges``, else kfuzz's default):
    its stats, and the process's wall time."""
    root = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    stats = root / "stats.json"
    start = time.monotonic()
    p = subprocess.run([sys.executable, "-c", "from kfuzz.cli import main; main()", "run", "--target", target,
                        "--time", str(seconds), "--jobs", str(jobs), "--device", device, "--seed", str(seed),
                        "--root", str(root), "--minimize-time", "0", "--stats-json", str(stats),
                        *(["--judges", str(judges)] if judges is not None else [])],
                       env=_env(cache), capture_output=True, text=True, timeout=seconds + 900)
    wall = time.monotonic() - start
    if not stats.exists():
        raise RuntimeError(f"kfuzz run {target} --jobs {jobs} wrote no stats (exit {p.returncode}):\n"
                           f"{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    out = json.loads(stats.read_text())
    out["wall"] = wall
    return out


def bare_loop(target_name: str, seconds: float, device: str, seed: int) -> dict:
    """The same cases, the kernel then the judge, in this process (run via --bare)."""
    import torch

    from kfuzz import jit
    from kfuzz.engines.random import RandomEngine
    from kfuzz.execute import as_outputs, judge
    from kfuzz.schedule import HISTORY, CompileHistory, Scheduler
    from kfuzz.target import get_target
    from kfuzz.tensors import materialize
    target = get_target(target_name)
    credit = jit.Credit()
    jit.report_compiles(lambda note: credit.take(note, time.monotonic()))
    # the compile history the campaigns on this cache wrote, as kfuzz run reads it (not written)
    history = CompileHistory(Path(os.environ["TRITON_CACHE_DIR"]) / HISTORY).of(target_name)
    schedule = Scheduler(target, RandomEngine(target, seed=seed), seed=seed, cold=device.startswith("cuda"),
                         history=history)
    start = time.monotonic()
    n = errors = 0
    compiled = 0.0
    first = None
    while time.monotonic() - start < seconds:
        case = schedule.next_case(time.monotonic() - start, compiled)
        inputs = materialize(case, target, device)
        credit.reset()
        try:
            outputs = as_outputs(target.kernel(**inputs), target)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a kernel's exception is a judged case too
            errors += 1
        else:
            judge(case, target, inputs, outputs, device)
        took = credit.extension(time.monotonic())
        compiled += took
        schedule.observe(case, took)
        n += 1
        first = first if first is not None else time.monotonic() - start
    took = time.monotonic() - start
    return {"executions": n, "seconds": took, "errors": errors, "first": first}


def bare(target: str, seconds: float, device: str, cache: Path, seed: int) -> dict:
    p = subprocess.run([sys.executable, __file__, "--bare", target, "--seconds", str(seconds), "--device", device,
                        "--seed", str(seed)], env=_env(cache), capture_output=True, text=True,
                       timeout=seconds + 900)
    if p.returncode != 0:
        raise RuntimeError(f"bare loop for {target} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _share(s: dict, key: str) -> str:
    return f"{100 * s[key] / s['seconds']:.0f}%" if s["seconds"] else "-"


def row(target: str, jobs: int, kind: str, s: dict, bare_rate: float | None) -> str:
    rate = s["execs_per_second"]
    ratio = f"{rate / bare_rate:.2f}" if bare_rate and kind == "warm" else ""
    first = s.get("first_judged_seconds")
    return (f"| {target} | {jobs} | {kind} | {s['executions']} | {s['seconds']:.0f} | {rate:.2f} | "
            f"{'-' if first is None else f'{first:.1f}'} | {s['compiles']} | {_share(s, 'compile_seconds')} | "
            f"{_share(s, 'kernel_seconds')} | {_share(s, 'judge_seconds')} | {s['unfinished']} | "
            f"{len(s['failures'])} | {ratio} |")


def failures(target: str, jobs: int, kind: str, s: dict, cases: Path | None) -> list[str]:
    """Lines naming each failure signature a campaign found and the cases it saved (copied into
    ``cases`` where given)."""
    lines = [f"- {target} --jobs {jobs} {kind}: {sig} ({f['count']} execution(s), first at execution "
             f"{f['first_execution']})" for sig, f in s["failures"].items()]
    for saved in s.get("saved", []):
        kept = saved
        if cases is not None and Path(saved).exists():
            cases.mkdir(parents=True, exist_ok=True)
            kept = str(shutil.copy(saved, cases / f"{target}-{jobs}-{kind}-{Path(saved).name}"))
        lines.append(f"  - saved: {kept}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="softmax,gdn_fwd,gdn_bwd")
    ap.add_argument("--jobs", default="1,4,8")
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--judges", type=int, default=None, help="Each campaign's --judges (default: kfuzz's own).")
    ap.add_argument("--work", default=None, help="Folder for caches and campaign roots (default: a temporary one).")
    ap.add_argument("--json", default=None, help="Also write every measurement here.")
    ap.add_argument("--phases", default="cold,warm,bare", help="Which of cold, warm and bare to run.")
    ap.add_argument("--cache", default=None,
                    help="Keep the caches in DIR/<target>-<jobs>, reused where there (default: fresh ones).")
    ap.add_argument("--bare-seconds", type=float, default=None,
                    help="How long the bare loop runs (default: --seconds).")
    ap.add_argument("--cases", default=None, help="Copy each case a campaign saved into this folder.")
    ap.add_argument("--bare", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.bare:
        print(json.dumps(bare_loop(a.bare, a.seconds, a.device, a.seed)))
        return
    phases = set(a.phases.split(","))
    if not phases or phases - {"cold", "warm", "bare"}:
        ap.error(f"--phases {a.phases}: a comma-separated choice of cold, warm and bare")
    sys.path.insert(0, str(HERE))
    from kfuzz.devices import resolve_device
    device = resolve_device(a.device)
    work = Path(a.work or tempfile.mkdtemp(prefix="bench-campaign-"))
    work.mkdir(parents=True, exist_ok=True)
    judges = "kfuzz's default" if a.judges is None else a.judges
    print(f"device {device}, {a.seconds:g} s a campaign, judges {judges}, work folder {work}\n", flush=True)
    print("| target | jobs | caches | judged | s | judged/s | first judged, s | compiles | compiling | "
          "kernel | oracle+trusted | dropped at --time | failures | / bare |")
    print("|" + " --- |" * 14, flush=True)
    results, found = [], []
    for target in a.targets.split(","):
        bare_rate = None
        for jobs in (int(j) for j in a.jobs.split(",")):
            if a.cache:
                cache = Path(a.cache) / f"{target}-{jobs}"
                cache.mkdir(parents=True, exist_ok=True)
            else:
                cache = Path(tempfile.mkdtemp(prefix=f"cache-{target}-{jobs}-", dir=work))
            for kind in ("cold", "warm"):
                s = campaign(target, jobs, a.seconds, device, cache, work, a.seed, a.judges) if kind in phases else None
                if kind == "warm" and bare_rate is None and "bare" in phases:
                    b = bare(target, a.bare_seconds or a.seconds, device, cache, a.seed)
                    bare_rate = b["executions"] / b["seconds"]
                    results.append({"target": target, "bare": b})
                    print(f"| {target} | bare loop | warm | {b['executions']} | {b['seconds']:.0f} | "
                          f"{bare_rate:.2f} | {b['first'] or 0:.1f} | | | | | | | 1.00 |", flush=True)
                if s is not None:
                    results.append({"target": target, "jobs": jobs, "caches": kind, "stats": s})
                    print(row(target, jobs, kind, s, bare_rate), flush=True)
                    found += failures(target, jobs, kind, s, Path(a.cases) if a.cases else None)
    if found:
        print("\nFailures found:\n\n" + "\n".join(found), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
