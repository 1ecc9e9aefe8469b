"""kfuzz minimize CASE: shrink a saved failure keeping its signature; print what was removed."""
from pathlib import Path

import click

from kfuzz.case import encode
from kfuzz.cli.base import cli, device_option, handles_bad_input
from kfuzz.corpus import SUFFIX, load_checked, make_record, write_atomic
from kfuzz.errors import CaseError
from kfuzz.executor import InProcess, Pool
from kfuzz.gates import GATES, gate_check
from kfuzz.minimize import DEFAULT_BUDGET, Minimized, minimize, passes_for
from kfuzz.verdict import Signature


def render(m: Minimized) -> None:
    """What minimizing removed, step by step, and the case before and after (shared with import)."""
    for s in m.steps:
        click.echo(f"  {s.pass_name:<26} {s.change}")
    doc = m.to_json()
    for label in ("found", "minimized"):
        d = doc[label]
        parts = [f"dims {d['dims']}", f"dtype {d['dtype']}", f"seed {d['seed']}",
                 f"injections {sum(len(v) for v in d['injections'].values())}"]
        if d["payload_elements"]:
            parts.append(f"payload elements {d['payload_elements']}")
        click.echo(f"{label:<10} " + ", ".join(parts))
    click.echo(f"{len(m.steps)} steps, {m.sweeps} sweeps, {m.executions} executions"
               + ("" if not m.exhausted else " (budget spent before a fixed point)"))


@cli.command("minimize")
@click.argument("path", type=click.Path())
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Where to write the minimized case (default: CASE's folder, named by its hash).")
@click.option("--replace", is_flag=True, help="Remove CASE once the minimized case is written.")
@click.option("--budget", type=click.IntRange(min=1), default=DEFAULT_BUDGET, show_default=True,
              help="Most executions to spend, re-runs included.")
@click.option("--time", "seconds", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Most seconds to spend (default: no limit but --budget).")
@device_option
@click.option("--in-process", "in_process", is_flag=True,
              help="Run the kernel in this process, not in a sandboxed worker: for trusted kernels "
                   "(a crash or a hang then ends kfuzz).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="Seconds one kernel call may take in the worker before it is a timeout (compiles not counted).")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Sandboxed workers: a shrink pass's next candidates run that many at once "
                   "(the same result as one at a time, for some executions more).")
@handles_bad_input
def minimize_cmd(path, out, replace, budget, seconds, device, in_process, timeout, jobs):
    """Shrink a failing case; the result fails with the same signature. Exit 2 if it does not fail.
    The kernel runs in a sandboxed worker on DEVICE (a crash or a hang is minimized too). A gate's
    case (its record names the gate: `kfuzz verify`'s and `kfuzz audit`'s) is judged by that gate
    at each step, as `kfuzz verify --replay` judges it, and keeps its gate in the new record."""
    case, record, target = load_checked(path, device)
    want = Signature.from_json(record["signature"]) if record and "signature" in record else None
    gid = (record or {}).get("gate")
    if gid is not None and gid not in GATES:
        raise CaseError(f"{path}: its record names gate {gid!r}, which kfuzz does not know (known: {', '.join(GATES)})")
    with (InProcess(target, device) if in_process else Pool(target, jobs, device, timeout)) as executor:
        m = minimize(case, target, signature=want, device=device, max_executions=budget, max_seconds=seconds,
                     executor=executor, passes=passes_for(device),
                     check=gate_check(gid, target, device, executor) if gid else None)
    click.echo(f"signature {m.verdict.signature}")
    render(m)
    dest = Path(out) if out else Path(path).parent / f"{m.case.hash}{SUFFIX}"
    expect = (record or {}).get("expect", "fail")
    note = m.to_json()
    earlier = (record or {}).get("minimize")
    if earlier and "found" in earlier:   # minimized before: the record keeps the case as first found
        note.update(found=earlier["found"], steps=earlier["steps"] + note["steps"],
                    executions=earlier["executions"] + note["executions"], sweeps=earlier["sweeps"] + note["sweeps"])
    kept = {k: record[k] for k in ("gate", "gate_seed", "resolve") if record and k in record}
    write_atomic(dest, encode(m.case, make_record(m.verdict, expect, device, minimize=note, **kept)))
    click.echo(f"wrote     {dest}")
    if replace and dest.resolve() != Path(path).resolve():
        Path(path).unlink()
        click.echo(f"removed   {path}")
