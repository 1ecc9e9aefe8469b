"""kfuzz run --target NAME: a fuzzing campaign; new failures are saved in crashes/."""
import json
import sys

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kfuzz.campaign import run_campaign
from kfuzz.corpus import Corpus
from kfuzz.engines import ENGINES
from kfuzz.cli import cli, handles_bad_input
from kfuzz.target import get_target


@cli.command("run")
@click.option("--target", "target_name", required=True, help="Target name (see `kfuzz targets`).")
@click.option("--time", "seconds", type=float, default=None, help="Stop after this many seconds.")
@click.option("--runs", type=int, default=None, help="Stop after this many executions.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--engine", type=click.Choice(sorted(ENGINES)), default="random", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="The engine's seed.")
@click.option("--root", type=click.Path(file_okay=False), default=".", show_default=True,
              help="Project root holding seeds/ and crashes/.")
@click.option("--stats-json", type=click.Path(dir_okay=False), default=None, help="Write the final summary here.")
@handles_bad_input
def run_cmd(target_name, seconds, runs, device, engine, seed, root, stats_json):
    """Fuzz a target. Exit 1 if a failure was found, 0 if none."""
    if seconds is None and runs is None:
        seconds = 30.0
    target = get_target(target_name)
    eng = ENGINES[engine](target, seed=seed)
    console = Console(stderr=True)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[status]}"), console=console, transient=False) as progress:
        total = runs if runs is not None else seconds
        task = progress.add_task(f"{target_name} ({engine})", total=total, status="")

        def on_progress(stats, verdict):
            done = stats.executions if runs is not None else stats.seconds
            progress.update(task, completed=done, status=(
                f"{stats.executions} execs, {stats.execs_per_second:.1f}/s, "
                f"{sum(stats.failures.values())} failures, {len(stats.failures)} signatures"))

        stats = run_campaign(target, eng, Corpus(root), seconds=seconds, runs=runs, device=device,
                             on_progress=on_progress)
    for sig, n in stats.failures.items():
        click.echo(f"failure  {sig}  x{n}")
    for p in stats.saved:
        click.echo(f"saved    {p}")
    click.echo(f"{stats.executions} executions in {stats.seconds:.1f} s "
               f"({stats.execs_per_second:.1f}/s), {len(stats.failures)} failure signature(s)")
    if stats_json:
        with open(stats_json, "w") as f:
            json.dump(stats.to_json(), f, indent=2)
    sys.exit(1 if stats.failures else 0)
