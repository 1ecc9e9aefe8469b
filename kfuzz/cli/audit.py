"""kfuzz audit CORPUS...: accepted KernelBench kernels through the standard test and the gates."""
import contextlib
import sys
from pathlib import Path

import click

from kfuzz.cli.base import cli, device_option, handles_bad_input, stop_signals_interrupt
from kfuzz.errors import KfuzzError

SELECT = ("all", "cpu", "no-compile", "compile")
LABELS = {"BROKEN": "a violation no tolerance explains (a tolerance-free gate or kind, a sandbox violation, a crash "
                    "or timeout in the standard test, an error over 1000x the bound)",
          "VIOLATE": "at least one violation (a gate failed, W the weights contract, or a finding of the build or "
                     "standard test), all within some tolerance",
          "TIMEOUT": "killed at --timeout in the gates or the build: judged on what finished",
          "ERROR": "kfuzz could not finish the kernel's audit (a gate that could not run, a worker that did not "
                   "start): judged on what finished, counted as incomplete; --retry audits it again",
          "ok": "no violation", "skip": "not audited (no pair, the reference refused, the solution did not build)"}


def _line(rec: dict) -> str:
    from kfuzz.audit import first_failure, judge_record, kfuzz_errors
    name = rec["key"] if rec.get("name") in (None, rec["key"]) else f"{rec['key']} ({rec['name']})"
    if rec.get("skip"):
        return f"skip     {name}: {rec['skip'][:120]}"
    for why in ("adapter", "unbuilt"):
        if why in rec:
            return f"skip     {name}: {why}: {rec[why]['error'][:120]}"
    j = judge_record(rec)
    std = rec.get("standard", {})
    errors = kfuzz_errors(rec)
    head = ("BROKEN " if j["broken"] else "VIOLATE" if j["violation"] else "TIMEOUT" if j["incomplete"]
            else "ERROR  " if errors else "ok     ")
    said = "pass" if std.get("passed") else std.get("finding") or str(std.get("reason", "-"))[:60]
    head += f"  {name}  standard {said}"
    if j["violations"]:
        head += f"  violations {','.join(j['violations'])}  first: {first_failure(rec)}"
    if errors and not j["violations"]:
        head += f"  error: {errors[0][:120]}"
    if rec.get("expect"):
        head += f"  (planted: {rec['expect']})"
    return head + f"  {rec.get('seconds', 0):.1f}s"


def _redo_keys(given) -> list[str]:
    """``--redo`` values as keys: ``@FILE`` stands for the whitespace-separated keys in FILE."""
    keys = []
    for value in given:
        if not value.startswith("@"):
            keys.append(value)
            continue
        try:
            keys += Path(value[1:]).read_text().split()
        except (OSError, UnicodeDecodeError) as e:
            raise KfuzzError(f"--redo {value}: cannot read the file of keys: {e}") from e
    return keys


@cli.command("audit")
@click.argument("corpora", nargs=-1, required=True, type=click.Path())
@click.option("--standard", type=click.Choice(["kernelbench"]), default="kernelbench", show_default=True,
              help="The standard test reported beside the gates.")
@click.option("--limit", type=click.IntRange(min=0), default=None,
              help="Audit at most N kernels (after selection and order).")
@click.option("--jobs", type=click.IntRange(min=1), default=None,
              help="Kernels audited (and compiled) at once (default: on a GPU, one a core, at most 16; on the "
                   "CPU, 1).")
@click.option("--out", type=click.Path(file_okay=False), default="out/audit", show_default=True,
              help="OUT/results.jsonl gets one signed line a kernel; a rerun skips what is there.")
@click.option("--gates", default=None, help="Comma-separated gate ids (default: all twelve).")
@device_option
@click.option("--seed", type=int, default=0, show_default=True, help="The gates' seed.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="Seconds a kernel may take (its standard test and gates).")
@click.option("--build-timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Seconds a solution's load_inline build may take, apart from --timeout (builds share the "
                   "cores with the kernels judged beside them).")
@click.option("--select", type=click.Choice(SELECT), default="all", show_default=True,
              help="cpu: solutions that neither compile CUDA nor ask for the GPU (a static check); "
                   "no-compile / compile: by whether they build a load_inline extension.")
@click.option("--cache", type=click.Path(file_okay=False), default=None,
              help="Compiled extensions, one folder per solution hash, outside OUT "
                   "(default ~/.cache/kfuzz/extensions).")
@click.option("--max-jobs", type=click.IntRange(min=1), default=None,
              help="MAX_JOBS (ninja's jobs) for each extension build (default: $MAX_JOBS, else the cores divided "
                   "by --jobs, at least 2).")
@click.option("--build-jobs", type=click.IntRange(min=0), default=None,
              help="Builds of load_inline solutions further down the queue run ahead of their judging, N at once "
                   "(default: on a GPU, half of --jobs; on the CPU, 0).")
@click.option("--pch/--no-pch", default=True, show_default=True,
              help="Precompile torch's extension header once per set of host-file flags, beneath --cache, "
                   "for the load_inline builds.")
@click.option("--slim-cuda/--no-slim-cuda", default=True, show_default=True,
              help="Compile a load_inline CUDA file with <torch/extension.h> (torch.h, all.h) included as "
                   "<torch/types.h> where it compiles so, else as written.")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="torch threads per kernel process.")
@click.option("--retry", is_flag=True,
              help="Audit again the kernels whose run did not finish (timeout, a kfuzz error, a GPU's memory "
                   "taken by other kernels or the GPU busy).")
@click.option("--redo", "redo", multiple=True, metavar="KEY|@FILE",
              help="Audit this kernel again whatever its record says (its key, e.g. cuda-l1-h100.jsonl:148; "
                   "repeatable; @FILE: the keys in FILE, separated by whitespace): a record made before a fix "
                   "of kfuzz's.")
@click.option("--redo-unsigned", is_flag=True,
              help="Audit again the kernels whose record carries no HMAC: an older kfuzz's verdicts, made before "
                   "results were signed (with --trust-unsigned; each is redone once).")
@click.option("--key", type=click.Path(dir_okay=False), default=None,
              help="The key file that signs OUT/results.jsonl, outside OUT (default $KFUZZ_AUDIT_KEY, else "
                   "~/.config/kfuzz/audit.key; made on first use).")
@click.option("--trust-unsigned", is_flag=True,
              help="Take lines of OUT/results.jsonl that carry no HMAC (made before results were signed, "
                   "or under a key that is not kept; never one after a signed line of its kernel).")
@click.option("--allow-unconfined", is_flag=True,
              help="Run the kernels even where no OS layer blocks their network, writes or processes.")
@handles_bad_input
def audit_cmd(corpora, standard, limit, jobs, out, gates, device, seed, timeout, build_timeout, select, cache,
              max_jobs, build_jobs, pch, slim_cuda, threads, retry, redo, redo_unsigned, key, trust_unsigned,
              allow_unconfined):
    """Audit the kernels of CORPORA (CUDA-L1 .jsonl, leaderboard .json, controls folder).

    Solutions that need no compile go first. Reports every selected kernel recorded in OUT, this
    run's and earlier ones. Exit 0 when each ends as expected, 1 when any does not (a violation in
    a corpus without expectations, a control whose verdict differs from its planting, a kernel
    killed for time), 2 on bad input, 130 when stopped by SIGINT, SIGTERM or SIGHUP (the records
    written are kept; docs/audit.md, "Exit codes and output")."""
    from kfuzz.audit import RESULTS, default_jobs, judge_record, outcome, read_results, results_key, run_audit
    from kfuzz.gates import parse_gates
    from kfuzz.kernelbench import read_corpus
    ids = parse_gates(gates)
    jobs, ahead = default_jobs(device, jobs)
    build_jobs = ahead if build_jobs is None else build_jobs
    entries = [e for path in corpora for e in read_corpus(path)]
    redo = _redo_keys(redo)
    unknown = sorted(set(redo) - {e.key for e in entries})
    if unknown:
        raise KfuzzError(f"--redo {unknown[0]}: no such kernel in the corpora given"
                         + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    if select == "cpu":
        entries = [e for e in entries if e.cpu_runnable]
    elif select == "no-compile":
        entries = [e for e in entries if e.pair is not None and not e.compiles]
    elif select == "compile":
        entries = [e for e in entries if e.compiles]
    entries.sort(key=lambda e: e.compiles)         # stable: the fast ones first
    skipped = [e for e in entries if e.pair is None]  # recorded (cheap), never counted in --limit
    entries = [e for e in entries if e.pair is not None][:limit] + skipped
    now, in_flight = {}, {}
    audit = run_audit(entries, out, ids, jobs=jobs, device=device, seed=seed, timeout=timeout, cache=cache,
                      threads=threads, max_jobs=max_jobs, retry=retry, redo=redo, key=key,
                      trust_unsigned=trust_unsigned, allow_unconfined=allow_unconfined, build_jobs=build_jobs,
                      pch=pch, build_timeout=build_timeout, slim=slim_cuda, redo_unsigned=redo_unsigned,
                      in_flight=in_flight)
    try:
        # closed on an interrupt: the kernels in flight and their builds end, unrecorded
        with stop_signals_interrupt(), contextlib.closing(audit):
            for rec in audit:
                now[rec["key"]] = rec
                click.echo(_line(rec))
    except KeyboardInterrupt as e:
        click.echo(f"audit: interrupted ({e.args[0] if e.args else 'SIGINT'}): {len(now)} kernel(s) recorded now "
                   f"in {Path(out) / RESULTS}, kept; the kernels in flight were stopped unrecorded (run again to "
                   f"go on)", err=True)
        for k, where in in_flight.items():
            click.echo(f"audit: stopped unrecorded: {k} ({where})", err=True)
        sys.exit(130)
    # the whole results file for the selected kernels, this run's records first
    results = read_results(Path(out) / RESULTS, results_key(key) if key else None, trust_unsigned)
    earlier = [results[e.key] for e in entries if e.key not in now and e.key in results]
    if earlier:
        click.echo(f"audit: {len(earlier)} kernel(s) recorded by an earlier run:")
        for rec in earlier:
            click.echo(_line(rec))
    records = list(now.values()) + earlier
    ends = [outcome(r) for r in records]
    counts = {k: ends.count(k) for k in ("expected", "unexpected", "incomplete", "skipped")}
    judged = [judge_record(r) for r in records]
    audited = sum(j["audited"] for j in judged)
    click.echo(f"audit: {len(records)} kernel(s) in {Path(out) / RESULTS} ({len(now)} now): {audited} audited, "
               f"{sum(j['violation'] for j in judged)} with a violation, {sum(j['broken'] for j in judged)} broken "
               f"beyond any tolerance, {counts['incomplete']} incomplete, {counts['skipped']} skipped; "
               f"{counts['unexpected']} ended otherwise than expected")
    missing = [e.key for e in entries if e.key not in now and e.key not in results]
    if missing:
        click.echo(f"audit: {len(missing)} selected kernel(s) have no valid record: {', '.join(missing[:5])}", err=True)
    for line, why in results.refused[:10]:
        click.echo(f"audit: refused line {line} of {Path(out) / RESULTS}: {why}", err=True)
    if len(results.refused) > 10:
        click.echo(f"audit: ... {len(results.refused)} line(s) refused in all", err=True)
    click.echo("labels: " + "; ".join(f"{k} = {v}" for k, v in LABELS.items()))
    sys.exit(1 if counts["unexpected"] or counts["incomplete"] or missing else 0)
