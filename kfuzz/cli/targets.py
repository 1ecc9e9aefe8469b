"""kfuzz targets: list the registered targets and their contracts."""
import click

from kfuzz.cli import cli, handles_bad_input
from kfuzz.target import load_targets


@cli.command("targets")
@handles_bad_input
def targets_cmd():
    """List the targets, with planted-bug variants marked."""
    for name, t in sorted(load_targets().items()):
        dims = " ".join(f"{k}:{d.lo}..{d.hi}" for k, d in t.dims.items())
        mark = f"  [planted bug: {t.planted_bug}]" if t.planted_bug else ""
        click.echo(f"{name:24s} {','.join(t.dtypes):28s} {dims}{mark}")
