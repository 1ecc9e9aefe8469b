"""kfuzz targets: list the registered targets and their contracts."""
import sys

import click

from kfuzz.cli.base import cli, handles_bad_input
from kfuzz.target import broken_modules, load_targets


@cli.command("targets")
@handles_bad_input
def targets_cmd():
    """List the targets, with planted-bug variants marked; name the target modules that
    failed to import (exit 2 if any did; the others are listed)."""
    for name, t in sorted(load_targets().items()):
        dims = " ".join(f"{k}:{d.lo}..{d.hi}" for k, d in t.dims.items())
        mark = f"  [planted bug: {t.planted_bug}]" if t.planted_bug else ""
        click.echo(f"{name:24s} {','.join(t.dtypes):28s} {dims}{mark}")
    broken = broken_modules()
    for b in broken:
        click.echo(f"kfuzz: error: {b}", err=True)
    if broken:
        sys.exit(2)
