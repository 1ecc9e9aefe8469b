"""kfuzz audit CORPUS...: accepted KernelBench kernels through the standard test and the gates."""
import sys
from pathlib import Path

import click

from kfuzz.cli import cli, handles_bad_input
from kfuzz.errors import KfuzzError

SELECT = ("all", "cpu", "no-compile", "compile")


def _line(rec: dict) -> str:
    from kfuzz.audit import judge_record
    if rec.get("skip"):
        return f"skip     {rec['key']}: {rec['skip'][:120]}"
    j = judge_record(rec)
    std = rec.get("standard", {})
    head = "BROKEN " if j["broken"] else "VIOLATE" if j["violation"] else "TIMEOUT" if j["incomplete"] else "ok     "
    head += f"  {rec['key']}"
    head += f"  standard {'pass' if std.get('passed') else std.get('reason', '-')[:60]}"
    for why in ("adapter", "unbuilt"):
        if why in rec:
            head = f"{why:8s} {rec['key']}: {rec[why]['error'][:120]}"
    if j["violations"]:
        head += f"  violations {','.join(j['violations'])}"
    if rec.get("expect"):
        head += f"  (planted: {rec['expect']})"
    return head + f"  {rec.get('seconds', 0):.1f}s"


@cli.command("audit")
@click.argument("corpora", nargs=-1, required=True, type=click.Path())
@click.option("--standard", type=click.Choice(["kernelbench"]), default="kernelbench", show_default=True,
              help="The standard test reported beside the gates.")
@click.option("--limit", type=int, default=None, help="Audit at most N kernels (after selection and order).")
@click.option("--jobs", type=int, default=1, show_default=True, help="Kernels audited (and compiled) at once.")
@click.option("--out", type=click.Path(file_okay=False), default="out/audit", show_default=True,
              help="OUT/results.jsonl gets one line a kernel; a rerun skips what is there.")
@click.option("--gates", default=None, help="Comma-separated gate ids (default: all twelve).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="The gates' seed.")
@click.option("--timeout", type=float, default=300.0, show_default=True,
              help="Seconds a kernel may take in all (compile included) before it is killed.")
@click.option("--select", type=click.Choice(SELECT), default="all", show_default=True,
              help="cpu: solutions that neither compile CUDA nor ask for the GPU (a static check); "
                   "no-compile / compile: by whether they build a load_inline extension.")
@click.option("--cache", type=click.Path(file_okay=False), default=None,
              help="Compiled extensions, one folder per solution hash (default OUT/extensions).")
@click.option("--max-jobs", type=int, default=2, show_default=True, help="MAX_JOBS for each extension build.")
@click.option("--threads", type=int, default=1, show_default=True, help="torch threads per kernel process.")
@click.option("--retry", is_flag=True, help="Audit again the kernels whose run did not finish (timeout, gate error).")
@handles_bad_input
def audit_cmd(corpora, standard, limit, jobs, out, gates, device, seed, timeout, select, cache, max_jobs, threads,
              retry):
    """Audit the kernels of CORPORA (CUDA-L1 .jsonl, leaderboard .json, controls folder).

    Solutions that need no compile go first. Exit 1 if a control ends otherwise than planted
    (a planted bug not caught, a correct control flagged), 2 on bad input."""
    from kfuzz.audit import judge_record, read_corpus, run_audit
    from kfuzz.gates import parse_gates
    ids = parse_gates(gates)
    if jobs < 1 or (limit is not None and limit < 0):
        raise KfuzzError("--jobs must be >= 1 and --limit >= 0")
    entries = [e for path in corpora for e in read_corpus(path)]
    if select == "cpu":
        entries = [e for e in entries if e.cpu_runnable]
    elif select == "no-compile":
        entries = [e for e in entries if e.pair is not None and not e.compiles]
    elif select == "compile":
        entries = [e for e in entries if e.compiles]
    entries.sort(key=lambda e: e.compiles)         # stable: the fast ones first
    skipped = [e for e in entries if e.pair is None]  # recorded (cheap), never counted in --limit
    entries = [e for e in entries if e.pair is not None][:limit] + skipped
    cache = cache or str(Path(out) / "extensions")
    counts = {"audited": 0, "skipped": 0, "violation": 0, "broken": 0, "controls_wrong": 0}
    for rec in run_audit(entries, out, ids, jobs=jobs, device=device, seed=seed, timeout=timeout,
                         cache=cache, threads=threads, max_jobs=max_jobs, retry=retry):
        click.echo(_line(rec))
        if rec.get("skip"):
            counts["skipped"] += 1
            continue
        j = judge_record(rec)
        if not j["audited"]:
            counts["skipped"] += 1
            continue
        counts["audited"] += 1
        counts["violation"] += j["violation"]
        counts["broken"] += j["broken"]
        if rec.get("expect") is not None and j["violation"] != (rec["expect"] != "none"):
            counts["controls_wrong"] += 1
    click.echo(f"audit: {counts['audited']} kernel(s) audited now ({counts['violation']} with a violation, "
               f"{counts['broken']} broken beyond any tolerance), {counts['skipped']} skipped; "
               f"results in {Path(out) / 'results.jsonl'}")
    if counts["controls_wrong"]:
        click.echo(f"audit: {counts['controls_wrong']} control(s) ended otherwise than planted", err=True)
    sys.exit(1 if counts["controls_wrong"] else 0)
