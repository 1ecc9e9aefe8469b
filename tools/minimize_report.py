"""Write reports/minimize.md: each saved failure as found and after minimization, and a
multi-megabyte reported input imported from a .pt and shrunk.

    python tools/minimize_report.py [--crashes crashes] [--out reports/minimize.md]

The first table is read from the records in crashes/ (``kfuzz run`` and ``kfuzz
minimize`` write the case as found, the steps and the executions there). Each
minimized case is executed again here, and also on the planted bug's base target
(the correct kernel): a base that fails too means the minimizer slipped to another
bug with the same signature.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from kfuzz.corpus import iter_case_files, load
from kfuzz.execute import execute
from kfuzz.importer import import_failure
from kfuzz.minimize import summary
from kfuzz.target import Arg, Dim, Output, Target, add_target, get_target, load_targets


def _fmt(s: dict) -> str:
    dims = "x".join(f"{k}={v}" for k, v in sorted(s["dims"].items()))
    inj = sum(len(v) for v in s["injections"].values())
    extra = [f"{n}:{d if isinstance(d, str) else d['kind']}" for n, d in s["dists"].items()]
    extra += [f"{n}:{lay['kind']}" for n, lay in s["layouts"].items()]
    payload = f", payload {s['payload_elements']} el." if s["payload_elements"] else ""
    return f"{dims} {s['dtype']}, {inj} inj.{payload}" + (f" ({', '.join(extra)})" if extra else "")


def corpus_table(crashes: Path) -> list[str]:
    rows = ["| target | signature | expect | as found | minimized | steps | executions | fixed point | replays | base target on it |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for path in iter_case_files([crashes]):
        case, record = load(path)
        note = (record or {}).get("minimize") or {}
        sig = record["signature"]
        slug = "-".join(p for p in (sig["kind"], sig.get("output"), sig.get("exc_type")) if p)
        now = execute(case)
        expect = record.get("expect", "fail")
        replays = (now.signature.to_json() == sig) if expect == "fail" else now.passed
        base = case.target.split(".")[0]
        base_verdict = execute(case.with_(target=base)).kind if base != case.target else "-"
        found = _fmt(note["found"]) if "found" in note else "(not recorded)"
        rows.append(f"| {case.target} | {slug} | {expect} | {found} | {_fmt(summary(case))} | "
                    f"{len(note.get('steps', []))} | {note.get('executions', '-')} | "
                    f"{note.get('fixed_point', '-')} | {'yes' if replays else 'NO'} | {base_verdict} |")
    return rows


def _rowmax_nan2zero(x):
    return torch.nan_to_num(x, nan=0.0).amax(dim=-1)


def import_demo() -> list[str]:
    """A user's kernel (row max that zeroes NaN) fails on a 4 MB reported input."""
    name = "report.rowmax_nan2zero"
    if name not in load_targets():
        add_target(Target(name=name, kernel=_rowmax_nan2zero, reference=lambda x: x.amax(dim=-1),
                          args={"x": Arg(("N", "D"))}, outputs={"out": Output(("N",))},
                          dims={"N": Dim(1, 4096), "D": Dim(1, 4096)}, planted_bug="NaN becomes 0"))
    target = get_target(name)
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    x[700, 333] = float("nan")
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "report.pt"
        torch.save({"x": x}, f)
        size = f.stat().st_size
        t0 = time.monotonic()
        imp = import_failure(f, target)
        seconds = time.monotonic() - t0
    m = imp.minimized
    again = execute(m.case, target)
    steps = "\n".join(f"    {s.pass_name:<24} {s.change}" for s in m.steps)
    return [
        f"Target `{name}` (a user's row max that turns NaN into 0), input `torch.save({{'x': x}})` of "
        f"x = randn(1024, 1024) float32 with x[700, 333] = NaN.", "",
        f"- file: {size:,} bytes; case as imported: {_fmt(summary(imp.found))}, "
        f"canonical JSON {len(imp.found.canonical()):,} bytes; verdict `{imp.verdict.signature}`",
        f"- minimized: {_fmt(summary(m.case))}, canonical JSON {len(m.case.canonical())} bytes, payload "
        f"`{m.case.payload_dict['x']['shape']}` = {m.case.payload_dict['x']['data']!r} (base64 of the one element)",
        f"- fresh execution of the minimized case: `{again.signature}` "
        f"({'same signature' if again.signature == imp.verdict.signature else 'DIFFERENT signature'}): {again.detail}",
        f"- {len(m.steps)} steps, {m.sweeps} sweeps, {m.executions} executions, {seconds:.1f} s "
        f"(import, verify, minimize)", "", "```", steps, "```"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--crashes", default="crashes")
    ap.add_argument("--out", default="reports/minimize.md")
    a = ap.parse_args()
    lines = ["# Minimization", "", "Written by `python tools/minimize_report.py`; the numbers are measured, "
             "not typed in (CPU, Triton kernels under the interpreter).", "",
             "## The saved failures, as found and minimized", "",
             "Each case was found by `kfuzz run --target <bug> --time 30` and minimized before it was saved "
             "(`rowsum.fp16acc/nonfinite-out` was minimized again by `kfuzz minimize` after the explicit-value "
             "windows were added; its steps and executions add both runs). *replays*: a fresh execution "
             "ends as recorded. *base target on it*: the verdict of the correct kernel on the minimized case "
             "(`pass` means the case shows the planted bug, not another one).", ""]
    lines += corpus_table(Path(a.crashes))
    lines += ["", "## A reported multi-megabyte input, imported and shrunk", ""] + import_demo() + [""]
    Path(a.out).write_text("\n".join(lines))


if __name__ == "__main__":
    main()
