"""Run part of one gate's cases through the gate's own check, for spreading a gate over
processes on a GPU machine.

    python tools/gate_part.py --target gdn_bwd --gate G03 --part 3/10 --device cuda

Runs cases I, I+N, I+2N, ... of the gate (part I/N, 0 <= I < N; same seed, same cases: the
gates draw theirs from (gate, seed, index)) in this process and prints one line a case
(index, pass or FAIL with the verdict, error/bound, seconds), then a summary line
``PART G03 3/10: cases C failures F worst W``.  Exit 1 if a case failed, 0 otherwise.

Why: `kfuzz verify --jobs N` runs gates, not cases, in parallel, and every `gdn_bwd` case is a
new shape class that compiles for 35-200 s on the H200; G03 (61 cases) in one process outlasts
a device call.  G03 and G04 spread over 10-15 processes this way run beside
`kfuzz verify --gates` for the other ten.  What a part cannot judge: a gate's n/a decisions
that need all its verdicts (`Gate.no_evidence`) and the saving of failing cases; run the whole
gate through `kfuzz verify` for those.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_part(target_name: str, gate_id: str, part: int, parts: int, device: str = "cpu",
             seed: int = 0, out=sys.stdout) -> tuple[int, int, float]:
    """(cases run, failures, worst error/bound) of part ``part`` of ``parts`` of the gate."""
    from kfuzz.gates import GATES, parse_gates
    from kfuzz.executor import executor_for
    from kfuzz.target import get_target
    gate = GATES[parse_gates(gate_id)[0]]
    target = get_target(target_name)
    executor = executor_for(target, device, None)
    reason = gate.not_applicable(target, executor)
    if reason:
        print(f"PART {gate.id} {part}/{parts}: n/a ({reason})", file=out, flush=True)
        return 0, 0, 0.0
    cases = failures = 0
    worst = 0.0
    for index, case in enumerate(gate.cases(target, seed)):
        if index % parts != part:
            continue
        start = time.monotonic()
        v = gate.check(target, case, device, executor=executor)
        if isinstance(v, tuple):   # the check judged other inputs than the case's own
            case, v = v
        cases += 1
        failures += not v.passed
        worst = max(worst, v.ratio)
        verdict = "pass" if v.passed else f"FAIL {v.kind} {v.output!r}: {v.detail[:200]}"
        print(f"{gate.id} case {index}: {verdict} ratio {v.ratio:.4g} {time.monotonic() - start:.1f}s",
              file=out, flush=True)
    print(f"PART {gate.id} {part}/{parts}: cases {cases} failures {failures} worst {worst:.4g}",
          file=out, flush=True)
    return cases, failures, worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--gate", required=True, help="one gate id, e.g. G03")
    ap.add_argument("--part", required=True, help="I/N: cases I, I+N, I+2N, ...")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        part, parts = (int(x) for x in a.part.split("/"))
        if not 0 <= part < parts:
            raise ValueError
    except ValueError:
        ap.error(f"--part must be I/N with 0 <= I < N; got {a.part!r}")
    return 1 if run_part(a.target, a.gate, part, parts, a.device, a.seed)[1] else 0


if __name__ == "__main__":
    sys.exit(main())
