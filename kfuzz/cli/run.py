"""kfuzz run --target NAME: a fuzzing campaign; new failures are saved in crashes/, then minimized.

On a terminal the campaign's table is redrawn live; without one (a CI log) a one-line status
is printed every 30 s (``--status-interval``). JIT caches (Triton's, ``TORCH_EXTENSIONS_DIR``)
live under ``--root``, so that the next campaign on the same root starts warm; beside Triton's
cache, ``kfuzz-compiles.json`` keeps what the campaigns compiled there, which the scheduler reads
(``kfuzz.schedule.CompileHistory``)."""
import json
import os
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.live import Live
from rich.table import Table

from kfuzz.campaign import MINIMIZE_SECONDS, CampaignStats, run_campaign
from kfuzz.cli.base import cli, device_option, handles_bad_input, stop_signals_interrupt
from kfuzz.corpus import Corpus
from kfuzz.engines import ENGINES
from kfuzz.sandbox import Policy, parse_size
from kfuzz.schedule import HISTORY
from kfuzz.target import get_target


def _render(stats: CampaignStats, limit: str) -> Table:
    table = Table(title=f"kfuzz run  {stats.target}  ({stats.engine}, {stats.jobs} job(s), {limit})",
                  show_header=False, title_justify="left")
    table.add_row("executions", f"{stats.executions}  ({stats.execs_per_second:.1f}/s, {stats.seconds:.0f} s)")
    table.add_row("corpus", f"{stats.corpus_size} kept, {stats.coverage} harness edges "
                            f"({stats.new_coverage} runs found new ones)")
    table.add_row("compiles", f"{stats.compiles} ({stats.compile_seconds:.0f} s), "
                              f"{stats.specializations} specialization(s)")
    if stats.specialization_misses:
        what, dtype, dims = stats.miss_log[0]
        table.add_row("[yellow]specialization misses[/yellow]",
                      f"{stats.specialization_misses} compile(s) of a kernel at a JIT key that the target's "
                      f"specialization does not name (first: {what} at {dtype} {dims}; the stats' miss_log)")
    table.add_row("workers restarted", str(stats.worker_restarts))
    if stats.memory_reruns:
        table.add_row("out of memory, run again", f"{stats.memory_reruns} case(s) (the memory is shared; "
                                                  "a second out-of-memory crash is the verdict)")
    if stats.gpu_least_free is not None:
        table.add_row("GPU memory", _gpu_memory(stats))
    if stats.judge_errors or stats.judge_restarts:
        first = f" (first: {stats.judge_errors[0]})" if stats.judge_errors else ""
        table.add_row("[yellow]kfuzz errors[/yellow]", f"{len(stats.judge_errors)} case(s) not judged, "
                                                       f"{stats.judge_restarts} judge(s) restarted{first}")
    if stats.interrupted:
        table.add_row("[yellow]interrupted[/yellow]", f"{stats.unfinished} case(s) in flight dropped, not judged")
    elif stats.stopped:
        table.add_row("[red]stopped early[/red]", f"{stats.stopped}; {stats.unfinished} case(s) in flight dropped, "
                                                  "not judged")
    elif stats.unfinished:
        table.add_row("unfinished", f"{stats.unfinished} case(s) in flight at the time limit: "
                                    "dropped, not judged")
    for sig, n in sorted(stats.failures.items(), key=lambda kv: str(kv[0])):
        known = "; an open case was already saved: not saved again" if sig in stats.known else ""
        table.add_row(f"[red]failure[/red] {sig.slug}", f"x{n} (first at execution {stats.first_seen[sig]}){known}")
    return table


def status_line(stats: CampaignStats) -> str:
    """One line of progress, for logs without a terminal."""
    return (f"kfuzz run {stats.target}: {stats.seconds:.0f} s, {stats.executions} executions "
            f"({stats.execs_per_second:.1f}/s), {len(stats.failures)} failure signature(s), "
            f"{stats.compiles} compile(s)" + (f", {_gpu_memory(stats)}" if stats.gpu_least_free is not None else ""))


def _gpu_memory(stats: CampaignStats) -> str:
    return (f"GPU memory free after a judged case: at least {stats.gpu_least_free / 2**30:.1f} GiB; "
            f"{stats.judged_on_cpu} case(s) judged on the CPU for want of it")


def cache_dirs(root: str) -> dict[str, str]:
    """JIT caches under the project root, unless the environment names its own."""
    base = Path(root).resolve() / ".kfuzz-cache"
    wanted = {"TRITON_CACHE_DIR": base / "triton", "TORCH_EXTENSIONS_DIR": base / "torch_extensions"}
    out = {}
    for var, path in wanted.items():
        if not os.environ.get(var):
            path.mkdir(parents=True, exist_ok=True)
            os.environ[var] = str(path)
        out[var] = os.environ[var]
    return out


@cli.command("run")
@click.option("--target", "target_name", required=True, help="Target name (see `kfuzz targets`).")
@click.option("--time", "seconds", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Stop after this many seconds.")
@click.option("--runs", type=click.IntRange(min=1), default=None, help="Stop after this many executions.")
@device_option
@click.option("--engine", type=click.Choice(sorted(ENGINES)), default="random", show_default=True)
@click.option("--jobs", type=click.IntRange(min=0), default=1, show_default=True,
              help=("Sandboxed worker processes (0: run the kernel in kfuzz's own process, unprotected); "
                    "with several GPUs visible they are spread over them."))
@click.option("--judges", type=click.IntRange(min=0), default=None,
              help="Processes that run the oracle beside the workers (default: one per worker on CUDA, 0 on CPU).")
@click.option("--minimize-time", "minimize_time", type=click.FloatRange(min=0), default=MINIMIZE_SECONDS,
              show_default=True, help="Seconds for minimizing the new failures, after --time (0: save them as found).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds one kernel call may take before it is a `timeout` failure (workers only).")
@click.option("--memory-limit", default=None,
              help=("Address space a worker's kernel may add to what the worker maps when its target "
                    "is loaded (4G, 512M, none); default 4G on CPU, none on CUDA."))
@click.option("--cpu-limit", type=click.IntRange(min=1), default=None,
              help="CPU seconds a kernel call may use (default: the timeout times the CPU count).")
@click.option("--seed", type=int, default=0, show_default=True, help="The engine's seed.")
@click.option("--root", type=click.Path(file_okay=False), default=".", show_default=True,
              help="Project root holding seeds/ and crashes/.")
@click.option("--stats-json", type=click.Path(dir_okay=False), default=None, help="Write the final summary here.")
@click.option("--status-interval", type=click.FloatRange(min=0, min_open=True), default=30.0, hidden=True,
              help="Seconds between status lines when stderr is not a terminal.")
@handles_bad_input
def run_cmd(target_name, seconds, runs, device, engine, jobs, judges, minimize_time, timeout, memory_limit,
            cpu_limit, seed, root, stats_json, status_interval):
    """Fuzz a target. Exit 1 if a failure was found, else 130 if interrupted (SIGINT, SIGTERM,
    SIGHUP: the summary and --stats-json are still written), else 2 if a worker could not start
    (the campaign stops early; the summary and --stats-json are still written), else 0."""
    if seconds is None and runs is None:
        seconds = 30.0
    limits = {} if cpu_limit is None else {"cpu_seconds": cpu_limit}
    if memory_limit is not None:
        try:
            limits["memory"] = parse_size(memory_limit)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--memory-limit") from None
    policy = Policy.for_device(device, **limits)
    target = get_target(target_name)
    eng = ENGINES[engine](target, seed=seed)
    console = Console(stderr=True)
    limit = f"{runs} runs" if runs is not None else f"{seconds:g} s"
    history = Path(cache_dirs(root)["TRITON_CACHE_DIR"]) / HISTORY
    shown = [0.0, time.monotonic()]

    def campaign(on_progress):
        return run_campaign(target, eng, Corpus(root), seconds=seconds, runs=runs, device=device, jobs=jobs,
                            timeout=timeout, on_progress=on_progress, policy=policy, judges=judges,
                            minimize_seconds=minimize_time, tick=min(1.0, status_interval),
                            compile_history=history)

    if console.is_terminal:
        def on_progress(stats, verdict):
            if stats.seconds - shown[0] >= 0.25 or (verdict is not None and not verdict.passed):
                shown[0] = stats.seconds     # rendering is not free
                live.update(_render(stats, limit))

        with stop_signals_interrupt(), Live(_render(CampaignStats(target.name, engine, jobs), limit),
                                             console=console, refresh_per_second=4, transient=False) as live:
            stats = campaign(on_progress)
            live.update(_render(stats, limit))
    else:
        def on_progress(stats, verdict):
            if time.monotonic() - shown[1] >= status_interval:
                shown[1] = time.monotonic()
                click.echo(status_line(stats), err=True)

        click.echo(f"kfuzz run {target.name}: {engine} engine, {jobs} job(s) on {device}, {limit}", err=True)
        with stop_signals_interrupt():
            stats = campaign(on_progress)
        console.print(_render(stats, limit))
    for sig, n in stats.failures.items():
        click.echo(f"failure  {sig}  x{n}")
        if sig in stats.known:
            click.echo(f"known    {sig}: an open case with this signature was already saved; not saved again")
    for p in stats.saved:
        note = stats.minimized.get(p)
        how = "" if note is None else (f"  (minimized: {note.get('executions', 0)} executions, "
                                       f"fixed point {'yes' if note.get('fixed_point') else 'no'})"
                                       if "error" not in note else f"  (kept as found: {note['error']})")
        click.echo(f"saved    {p}{how}")
    for err in stats.judge_errors:
        click.echo(f"kfuzz error  not judged: {err}", err=True)
    click.echo(f"{stats.executions} executions in {stats.seconds:.1f} s "
               f"({stats.execs_per_second:.1f}/s), {len(stats.failures)} failure signature(s)"
               + (f"; interrupted ({stats.unfinished} case(s) in flight dropped)" if stats.interrupted
                  else f"; {stats.unfinished} case(s) in flight at the time limit dropped" if stats.unfinished
                  else ""))
    if stats_json:
        with open(stats_json, "w") as f:
            json.dump(stats.to_json(), f, indent=2)
    if stats.stopped:
        click.echo(f"kfuzz: error: the campaign stopped early, at {stats.seconds:.0f} s: {stats.stopped}", err=True)
    sys.exit(1 if stats.failures else 130 if stats.interrupted else 2 if stats.stopped else 0)
