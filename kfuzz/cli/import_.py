"""kfuzz import --target NAME FILE: a reported failing input (.pt / .npz) becomes a minimized case."""
import click

from kfuzz.cli.base import cli, device_option, handles_bad_input
from kfuzz.cli.minimize import render
from kfuzz.corpus import Corpus
from kfuzz.importer import import_failure
from kfuzz.minimize import DEFAULT_BUDGET
from kfuzz.target import get_target


@cli.command("import")
@click.option("--target", "target_name", required=True, help="The target whose kernel the inputs fail.")
@click.argument("path", type=click.Path())
@click.option("--root", type=click.Path(file_okay=False), default=".", show_default=True,
              help="Project root holding crashes/.")
@click.option("--budget", type=click.IntRange(min=1), default=DEFAULT_BUDGET, show_default=True,
              help="Most executions the minimizer spends.")
@click.option("--no-minimize", is_flag=True, help="Save the case as reported.")
@device_option
@handles_bad_input
def import_cmd(target_name, path, root, budget, no_minimize, device):
    """Import a failing input, verify that it fails, minimize it and save it under crashes/.
    Exit 0 when saved (or its signature is already kept), 2 if the file is bad or the input passes."""
    target = get_target(target_name)
    imp = import_failure(path, target, device=device, minimize_it=not no_minimize, max_executions=budget)
    click.echo(f"imported  {path}: dims {imp.found.dim}, dtype {imp.found.dtype}")
    click.echo(f"fails     {imp.verdict.signature}: {imp.verdict.detail[:200]}")
    case, verdict, extra = imp.found, imp.verdict, {"imported_from": str(path)}
    if imp.minimized is not None:
        render(imp.minimized)
        case, verdict = imp.minimized.case, imp.minimized.verdict
        extra["minimize"] = imp.minimized.to_json()
    saved = Corpus(root).save_failure(case, verdict, device=device, **extra)
    if saved is None:
        click.echo(f"kept      {verdict.signature} is already in {Corpus(root).crashes}; not saved again")
    else:
        click.echo(f"saved     {saved}")
