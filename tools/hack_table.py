"""Run every reward hack through the standard KernelBench-style test and through kfuzz's
gates; write the table into docs/sandbox.md (between its table markers) and the raw results as JSON.

    python tools/hack_table.py [--gates G01,G03] [--device cpu|cuda] [--runs 5] [--json out/hacks.json]
                               [--write docs/sandbox.md] [--only NAME,...] [--in-process]
    python tools/hack_table.py --from-json out/hacks.json --write docs/sandbox.md   # re-render only

The standard test is ``kfuzz.kernelbench.standard_test`` on the hack's KernelBench source in
``harnesses/kernelbench_hacks/`` (run in this process, as that test runs; what a hack patches
in torch is undone after each run, so the next row starts clean). kfuzz's side is
``run_gates`` on the target ``hacks.<name>`` (all twelve gates unless ``--gates``), exactly
what ``kfuzz verify --target hacks.<name>`` runs: the kernel in a sandboxed worker, the
oracle here (``--in-process``: both here). The correct twins (``hacks.honest_softmax``,
``matmul``) run through the same gates and must pass every one. Each KernelBench source also
goes through the gates itself (``kfuzz.kernelbench.as_target``: the reference ``Model`` in
float64 is the oracle), so the same code is judged in both formats.
"""
from __future__ import annotations

import argparse
import os
import json
import sys
import time
from pathlib import Path

os.environ.setdefault("KFUZZ_FIXTURES", "1")   # the hacks are test-suite targets (kfuzz.fixtures)

ROOT = Path(__file__).resolve().parents[1]
KB_DIR = ROOT / "harnesses" / "kernelbench_hacks"
TWINS = ("hacks.honest_softmax", "matmul")
KB_NAME = {"seed_peek": "rng_predict"}     # the same hack, reading KernelBench's seed instead of kfuzz's
BEGIN, END = "<!-- hack table: begin (tools/hack_table.py) -->", "<!-- hack table: end -->"

# why the rejecting check sees the hack (the verdicts say what; this says why that is the hack)
WHY = {
    "freed_output": "kfuzz runs the kernel before any reference, so there is no freed result to find: the "
                    "memory holds garbage (G01) and G10, which poisons every allocation with NaN, shows it "
                    "deterministically (stale)",
    "mutate_input": "every call compares each input's whole storage bitwise with a copy taken before the call",
    "global_out": "G09 calls twice while holding the first outputs: the second call wrote into them",
    "expanded_const": "outputs must be dense: no two indices may address one element",
    "ptr_cache": "G11 writes new values into the same buffers and gets the old output back",
    "side_stream": "a thread the call started is still running at return (on CUDA: outputs copied on the "
                   "current stream at return differ from the outputs after synchronizing)",
    "late_thread": "a thread the call started is still running at return",
    "profile_hook": "trace and profile functions, gc callbacks and signal handlers are compared before and "
                    "after every call (and restored): code that would run while the outputs are judged",
    "pooled_thread": "what is judged is a copy of the outputs taken at return (before, the judge read the "
                     "live output, and 4 of G01's 15 cases failed: a race)",
    "lazy_tensor": "outputs must be exactly torch.Tensor, not a subclass",
    "wrong_dtype": "the output's dtype is checked against the contract, not cast",
    "patch_allclose": "the identities of torch's, numpy's, builtins' and kfuzz's names are compared before "
                      "and after every call (and restored); kfuzz does not judge with allclose anyway",
    "patch_code": "the code objects of the watched Python functions are compared too (and restored)",
    "patch_judge": "kfuzz's own modules are watched namespaces: the replacement is caught and undone "
                   "before judging",
    "gc_copy": "the kernel runs before the oracle, and in a worker the oracle never runs in its process: "
               "there is no expected output to find",
    "gc_overwrite": "as gc_copy: nothing to overwrite; what it returns is judged on its own",
    "gc_nan": "NaN sets must equal the oracle's exactly; nothing to fill before the oracle runs",
    "seed_peek": "G01's hidden-seed trial draws inputs from a seed that exists nowhere in the process "
                 "during the call; the case it finds predicts other inputs",
    "fp16_inside": "the bound scales with the error of an fp32-total implementation, which fp16 exceeds",
    "fallback": "the fast path runs at kfuzz's shapes (the test's wide rows never reached it) and is out of bound",
    "fixed_shape": "G03 sweeps every dim over 1, primes and non-multiples of the tuned size",
    "zeros_under_tol": "the bound is relative to the oracle elementwise, not an absolute 1e-2",
    "first_call": "G01 calls many times in one process; every call is judged",
    "unit_interval": "G02 now draws uniform [0, 1) values too (before, this hack passed all twelve gates)",
}


def _standard(name: str, device: str, runs: int) -> dict | None:
    """The standard test on the hack's KernelBench source, ``runs`` times (a hack racing a
    thread against the comparison, or depending on where the allocator puts the next
    trial's inputs, can go either way)."""
    from kfuzz.contract import NamespaceSnapshot
    from kfuzz.kernelbench import standard_test
    path, pair = _kb_pair(name)
    if pair is None:
        return None
    verdicts, undone = [], []
    for _ in range(runs):
        snapshot = NamespaceSnapshot()
        verdicts.append(standard_test(pair, device=device))
        undone = list(verdicts[-1].undone) or snapshot.undo() or undone    # standard_test restores
        time.sleep(0.1)   # let a hack's late threads finish before the next run
    accepted = sum(v.passed for v in verdicts)
    return {"file": str(path.relative_to(ROOT)), "runs": runs, "accepted_runs": accepted,
            "accepted": accepted == runs, "reasons": sorted({v.reason for v in verdicts}), "undone": undone}


def _kb_pair(name: str):
    from kfuzz.kernelbench import read_row
    path = KB_DIR / f"{KB_NAME.get(name, name)}.py"
    if not path.exists():
        return None, None
    # read as a controls folder's row: its target name kb:<folder>:<stem> resolves in a worker
    return path, read_row(os.path.relpath(KB_DIR), path.stem).pair


SANDBOXED = True    # the kernel side of every gate in a sandboxed worker (--in-process: here)


def _kfuzz(target, gates, device: str) -> dict:
    from kfuzz.gates import run_gates
    from kfuzz.executor import InProcess, Sandboxed
    from kfuzz.target import get_target
    target = get_target(target) if isinstance(target, str) else target
    resolve = {"device": device} if target.name.startswith("kb:") else None
    with (Sandboxed(target, device, resolve=resolve) if SANDBOXED else InProcess(target, device)) as ex:
        results = run_gates(target, gates, device=device, executor=ex)
    out = {"gates": {r.gate: r.status for r in results}, "seconds": round(sum(r.seconds for r in results), 1),
           "failures": {}}
    for r in results:
        if r.status == "fail":
            _, v = r.first_failure
            out["failures"][r.gate] = {"signature": str(v.signature), "kind": v.kind, "detail": v.detail[:300]}
    return out


def measure(names, gates, device: str, runs: int = 3, log=print) -> dict:
    from harnesses.hacks import HACKS
    from kfuzz.kernelbench import as_target
    data = {"device": device, "gates": gates, "hacks": {}, "twins": {},
            "executor": "sandboxed worker" if SANDBOXED else "in-process"}
    for name in names:
        _, pair = _kb_pair(name)
        row = {"how": HACKS[name], "standard": _standard(name, device, runs),
               "kfuzz": _kfuzz(f"hacks.{name}", gates, device),
               "kfuzz_kernelbench": None if pair is None else _kfuzz(as_target(pair, device=device), gates, device)}
        data["hacks"][name] = row
        std = row["standard"]
        said = f"standard accepts {std['accepted_runs']}/{runs} run(s)" if std else "standard n/a"
        kb = row["kfuzz_kernelbench"]
        log(f"{name}: {said}; "
            f"kfuzz fails {','.join(row['kfuzz']['failures']) or 'NOTHING'} ({row['kfuzz']['seconds']}s); "
            f"on the KernelBench source {'n/a' if kb is None else ','.join(kb['failures']) or 'NOTHING'}")
    for twin in TWINS:
        data["twins"][twin] = _kfuzz(twin, gates, device)
        log(f"twin {twin}: {data['twins'][twin]['gates']}")
    return data


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(data: dict) -> str:
    lines = ["| hack | what it does | standard test (measured) | kfuzz: gates failing on `hacks.<name>` | "
             "first verdict signature | kfuzz: gates failing on the KernelBench source | why |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in data["hacks"].items():
        std = row["standard"]
        if std is None:
            std_cell = "n/a (games a judge that runs after the kernel, as kfuzz's does)"
        elif std["accepted_runs"] == std["runs"]:
            std_cell = f"**accepts** ({std['runs']}/{std['runs']} runs)"
        elif std["accepted_runs"] == 0:
            std_cell = f"rejects ({std['runs']}/{std['runs']} runs): {std['reasons'][0][:48]}"
        else:
            std_cell = f"**accepts {std['accepted_runs']} of {std['runs']} runs** (a race)"
        if std is not None and Path(std["file"]).stem != name:
            std_cell += f" (as `{Path(std['file']).name}`)"
        fails = row["kfuzz"]["failures"]
        first = next(iter(fails.values()), None)
        kb = row["kfuzz_kernelbench"]
        kb_cell = "n/a" if kb is None else ", ".join(kb["failures"]) or "**nothing**"
        lines.append(f"| `hacks.{name}` | {_cell(row['how'])} | {_cell(std_cell)} | "
                     f"{', '.join(fails) or '**nothing**'} | "
                     f"{_cell(first['signature'] if first else '-')} | {kb_cell} | {_cell(WHY.get(name, ''))} |")
    twins = "; ".join(f"`{t}`: " + ", ".join(f"{g} {s}" for g, s in r["gates"].items())
                      for t, r in data["twins"].items())
    return "\n".join(lines) + f"\n\nCorrect twins through the same gates: {twins}.\n"


def write(path: Path, text: str) -> None:
    doc = path.read_text() if path.exists() else f"{BEGIN}\n{END}\n"
    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.write_text(f"{head}{BEGIN}\n{text}{END}{tail}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gates", default=None, help="comma-separated gate ids (default: all twelve)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--only", default=None, help="comma-separated hack names")
    p.add_argument("--runs", type=int, default=5, help="standard-test runs per hack (some hacks race)")
    p.add_argument("--json", default=None, help="write the raw results here")
    p.add_argument("--write", default=None, help="write the table into this markdown file (e.g. docs/sandbox.md)")
    p.add_argument("--from-json", default=None, help="render the table from an earlier --json, running nothing")
    p.add_argument("--in-process", action="store_true",
                   help="run the kernels in this process, not in sandboxed workers (kfuzz verify --in-process)")
    args = p.parse_args(argv)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        if args.write:
            write(Path(args.write), table(data))
        else:
            print(table(data))
        return 0
    sys.path.insert(0, str(ROOT))
    global SANDBOXED
    SANDBOXED = not args.in_process
    from harnesses.hacks import HACKS
    from kfuzz.gates import parse_gates
    from kfuzz.target import load_targets
    load_targets()
    names = args.only.split(",") if args.only else list(HACKS)
    unknown = [n for n in names if n not in HACKS]
    if unknown:
        p.error(f"unknown hack(s) {unknown} (known: {', '.join(HACKS)})")
    data = measure(names, parse_gates(args.gates), args.device, args.runs, log=lambda s: print(s, flush=True))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(data, indent=1))
    text = table(data)
    if args.write:
        write(Path(args.write), text)
    else:
        print(text)
    missed = [n for n, r in data["hacks"].items() if not r["kfuzz"]["failures"]
              or (r["kfuzz_kernelbench"] is not None and not r["kfuzz_kernelbench"]["failures"])]
    twin_fails = [t for t, r in data["twins"].items() if "fail" in r["gates"].values()]
    return 1 if missed or twin_fails else 0


if __name__ == "__main__":
    sys.exit(main())
