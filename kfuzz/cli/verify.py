"""kfuzz verify --target NAME: the twelve gates, one line each, and a summary.

The kernel runs in a sandboxed worker (``kfuzz.executor.Sandboxed``): the oracle and its
outputs stay in this process, a crash or hang is that case's verdict and the gates go on.
``--in-process`` runs it here instead, for trusted kernels and speed. ``--jobs N`` runs N
gates at once, each in a process of its own with its own worker and 1/N of the CPUs' torch
threads: for kernels that spend their time compiling (a Triton target on a GPU compiles at
every new specialization), not for the oracle's share, which each process computes anew.
``--verbose`` adds a line on stderr as each case ends."""
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from xml.sax.saxutils import escape, quoteattr

import click

from kfuzz.cli.base import cli, device_option, handles_bad_input
from kfuzz.corpus import iter_case_files
from kfuzz.executor import InProcess, Sandboxed
from kfuzz.gates import GATES, parse_gates, replay_gate_case, run_gate, run_gates
from kfuzz.launcher import helpers_ignore_ctrl_c
from kfuzz.target import get_target


def _text_line(r) -> str:
    head = f"{r.gate} {r.name:17s} {r.status.upper():4s} {r.cases:3d} case(s) {r.seconds:6.2f}s"
    if r.status == "pass":
        return head + (f"  worst error/bound {r.worst_ratio:.3g}" if not GATES[r.gate].tolerance_free else "")
    if r.status == "n/a":
        return head + f"  {r.reason}"
    case, _ = r.first_failure
    where = f"  case {json.dumps(case.to_json(), sort_keys=True)}"
    saved = f"\n      saved {r.saved[0]}" if r.saved else ""
    return f"{head}  {r.failures} failing\n      {r.reason}\n    {where}{saved}"


def _junit(target, results, seconds) -> str:
    fails = sum(r.status == "fail" for r in results)
    skips = sum(r.status == "n/a" for r in results)
    out = [f'<testsuite name={quoteattr("kfuzz.verify." + target)} tests="{len(results)}" '
           f'failures="{fails}" skipped="{skips}" time="{seconds:.3f}">']
    for r in results:
        out.append(f'  <testcase classname={quoteattr(target)} name={quoteattr(f"{r.gate} {r.name}")} time="{r.seconds:.3f}">')
        if r.status == "fail":
            out.append(f'    <failure message={quoteattr(r.reason[:500])}>{escape(json.dumps(r.to_json()))}</failure>')
        elif r.status == "n/a":
            out.append(f"    <skipped message={quoteattr(r.reason)}/>")
        out.append("  </testcase>")
    out.append("</testsuite>")
    return "\n".join(out)


@cli.command("verify")
@click.option("--target", "target_name", default=None, help="Target name (see `kfuzz targets`).")
@click.option("--gates", default=None, help="Comma-separated gate ids, e.g. G05,G08 (default: all twelve).")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "junit"]), default="text", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="The gates' seed: same seed, same cases.")
@device_option
@click.option("--out", type=click.Path(file_okay=False), default="out", show_default=True,
              help="Failing cases go to OUT/gates/<gate>/crashes/<target>/<signature>/.")
@click.option("--replay", "replay_paths", multiple=True, type=click.Path(),
              help="Replay saved gate cases through their gates instead (repeatable).")
@click.option("--in-process", "in_process", is_flag=True,
              help="Run the kernel in this process, not in a sandboxed worker: for trusted kernels (faster, "
                   "but a crash ends kfuzz and the kernel shares a process with the oracle).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="Seconds one case's kernel program may take in the worker before it is a timeout "
                   "(its JIT compiles not counted).")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Gates run at once, each in its own process with its share of the CPUs "
                   "(lines come as gates end).")
@click.option("-v", "--verbose", is_flag=True,
              help="A line on stderr as each case ends: gate, case index, seconds, verdict.")
@click.option("--corpora", "corpora", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="A folder to find a kb: target's corpus in, by its file name, where the path the target "
                   "names is not here (an audit's gate case replayed on another machine; repeatable).")
@handles_bad_input
def verify_cmd(target_name, gates, fmt, seed, device, out, replay_paths, in_process, timeout, jobs,
               verbose, corpora):
    """Judge a target against the twelve gates. Exit 1 if any gate fails, 2 on bad input."""
    if corpora:     # before any worker starts: they find their target by its name too
        from kfuzz.kernelbench.corpus import CORPORA_ENV
        os.environ[CORPORA_ENV] = os.pathsep.join([*corpora, *filter(None, [os.environ.get(CORPORA_ENV)])])
    executors: dict = {}

    def executor(target):
        if target.name not in executors:
            executors[target.name] = _executor(target, device, in_process, timeout)
        return executors[target.name]
    try:
        _verify(target_name, gates, fmt, seed, device, out, replay_paths, executor,
                jobs=jobs, in_process=in_process, timeout=timeout, verbose=verbose)
    finally:
        for ex in executors.values():
            ex.close()


def _executor(target, device, in_process, timeout):
    # a target built on demand (kb:) is built in the worker as here: the same weights
    resolve = target.options.get("resolve")
    return InProcess(target, device) if in_process else Sandboxed(
        target, device, timeout, resolve={**resolve, "device": device} if resolve else None)


def _case_line(gid, index, seconds, verdict):
    """``--verbose``: one case's end, on stderr (a gate process's too: it shares stderr)."""
    click.echo(f"  {gid} case {index:3d} {seconds:7.2f}s {verdict.kind}", err=True)


def _gate_alone(target_name, gid, seed, out, device, in_process, timeout, on_case):
    """One gate in a process of its own (``--jobs``), with its own executor."""
    target = get_target(target_name)
    with _executor(target, device, in_process, timeout) as ex:
        return run_gate(GATES[gid], target, seed, out, device, executor=ex, on_case=on_case)


def _share_cpus(threads: int) -> None:
    """A gate process's share of the CPUs: ``threads`` torch threads, here and in the
    kernel's workers it starts.  The float64 oracle runs on the CPU in each gate process;
    with torch's default (every core) in each of N processes, OpenMP's threads outnumber the
    cores N times over, and gates that each wait on the oracle's autograd end none within
    their time (gdn_bwd's gates under ``--jobs 5`` on a 16-core host)."""
    import torch
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def _run_parallel(target, ids, seed, out, device, on_result, jobs, in_process, timeout, on_case):
    # spawned, not forked: this process may hold CUDA (an oracle on the GPU) and threads
    ctx = multiprocessing.get_context("spawn")
    results = {}
    threads = max(1, (os.cpu_count() or 1) // min(jobs, len(ids)))
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_share_cpus,
                             initargs=(threads,)) as pool:
        with helpers_ignore_ctrl_c():     # the pool starts its processes at the first submit
            futures = {pool.submit(_gate_alone, target.name, gid, seed, out, device, in_process, timeout,
                                   on_case): gid
                       for gid in ids}
        for done in as_completed(futures):
            r = results[futures[done]] = done.result()
            if on_result is not None:
                on_result(r)
    return [results[gid] for gid in ids]


def _verify(target_name, gates, fmt, seed, device, out, replay_paths, executor, jobs=1, in_process=False,
            timeout=120.0, verbose=False):
    if replay_paths:
        changed = 0
        for path in iter_case_files(replay_paths):
            ok, _, message = replay_gate_case(path, device, executor)
            changed += not ok
            click.echo(f"{'ok      ' if ok else 'CHANGED '} {path}: {message}")
        sys.exit(1 if changed else 0)
    if not target_name:
        raise click.UsageError("give --target NAME (or --replay PATH)")
    target = get_target(target_name)
    ids = parse_gates(gates)
    start = time.monotonic()
    on_result = (lambda r: click.echo(_text_line(r))) if fmt == "text" else None
    on_case = _case_line if verbose else None
    if jobs > 1 and len(ids) > 1:
        results = _run_parallel(target, ids, seed, out, device, on_result, jobs, in_process, timeout,
                                on_case)
    else:
        results = run_gates(target, ids, seed=seed, out=out, device=device, on_result=on_result,
                            executor=executor(target), on_case=on_case)
    seconds = time.monotonic() - start
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "n/a")}
    if fmt == "text":
        click.echo(f"{target_name}: {counts['pass']} pass, {counts['fail']} fail, {counts['n/a']} n/a "
                   f"of {len(results)} gate(s) in {seconds:.1f}s (seed {seed})")
    elif fmt == "json":
        click.echo(json.dumps({"target": target_name, "seed": seed, "seconds": round(seconds, 3),
                               "summary": counts, "gates": [r.to_json() for r in results]}, indent=2))
    else:
        click.echo(_junit(target_name, results, seconds))
    sys.exit(1 if counts["fail"] else 0)
