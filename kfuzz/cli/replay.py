"""kfuzz replay [PATHS]: every saved case must end as recorded."""
import sys

import click

from kfuzz.cli.base import cli, device_option, handles_bad_input
from kfuzz.replay import mark_fixed, replay


@cli.command("replay")
@click.argument("paths", nargs=-1, type=click.Path())
@device_option
@click.option("--mark-fixed", "mark", is_flag=True, help="Record expected failures that now pass as pass cases.")
@handles_bad_input
def replay_cmd(paths, device, mark):
    """Replay cases (default: crashes/). Every file is replayed and counted, a bad one reported
    by name. Exit 1 on any unexpected result, else 2 on any bad file, 130 if interrupted."""
    counts = {"ok": 0, "changed": 0, "error": 0}
    interrupted = False
    try:
        for r in replay(paths or ("crashes",), device):
            if r.status == "changed" and mark and r.expect == "fail" and r.verdict.passed:
                mark_fixed(r, device)
                click.echo(f"fixed    {r.path}: now passes; recorded as a pass case")
                counts["ok"] += 1
                continue
            counts[r.status] += 1
            tag = {"ok": "ok      ", "changed": "CHANGED ", "error": "ERROR   "}[r.status]
            click.echo(f"{tag} {r.path}: {r.message}", err=r.status == "error")
    except KeyboardInterrupt:
        interrupted = True
    click.echo(f"{counts['ok']} as expected, {counts['changed']} changed, {counts['error']} unreadable"
               + (" (interrupted: the rest not replayed)" if interrupted else ""))
    if counts["changed"]:
        sys.exit(1)
    if interrupted:
        sys.exit(130)
    if counts["error"]:
        sys.exit(2)
