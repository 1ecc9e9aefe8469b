"""kfuzz show CASE: the case's JSON and its record, once the case is checked against its
target's contract and storage budget (exit 2 naming the file and what is wrong)."""
import json

import click

from kfuzz.cli.base import cli, handles_bad_input
from kfuzz.corpus import load_checked


@cli.command("show")
@click.argument("path", type=click.Path())
@handles_bad_input
def show_cmd(path):
    """Print a .case.zst file as JSON (case and record); exit 2 if it is not a valid case for its target."""
    case, record, _ = load_checked(path)
    doc = case.to_json()
    if record is not None:
        doc["record"] = record
    click.echo(json.dumps(doc, indent=2, sort_keys=True))
