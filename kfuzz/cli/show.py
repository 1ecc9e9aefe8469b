"""kfuzz show CASE: the case's JSON and its record."""
import json

import click

from kfuzz.cli import cli, handles_bad_input
from kfuzz.corpus import load


@cli.command("show")
@click.argument("path", type=click.Path())
@handles_bad_input
def show_cmd(path):
    """Print a .case.zst file as JSON (case and record)."""
    case, record = load(path)
    doc = case.to_json()
    if record is not None:
        doc["record"] = record
    click.echo(json.dumps(doc, indent=2, sort_keys=True))
