"""What a target's random draws would cost to judge: the share of the draws, and of their
summed work, over each threshold, as the random engine draws them without and with the
target's ``options["keep"]`` (``Target.keep_chance``). No kernel or oracle runs.

    python tools/draw_costs.py --target gdn_bwd [--draws 20000] [--seed 0] [--sizes gpu]
        [--dims B,T,H,K,V] [--over 1e6,1e7,1e8,1e9,1e10]

A draw's work is the product of ``--dims`` (default: every dim of the target; for the GDN
targets B*T*H*K*V, the float64 recurrence's work, to which its judging time is about
proportional). ``--sizes gpu`` draws at the sizes a GPU campaign draws (each dim up to its
``hi``), ``cpu`` at those of Triton's interpreter (``cpu_hi``). Both rows use the same seed.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kfuzz.engines.random import sample_case  # noqa: E402
from kfuzz.target import get_target  # noqa: E402


def works(target, draws: int, seed: int, dims: list[str], sizes: str) -> list[float]:
    """The work of ``draws`` cases drawn for ``target`` at ``sizes`` (``Dim.search_hi`` reads
    ``TRITON_INTERPRET`` when it is asked)."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if sizes == "cpu" else "0"
    try:
        rng = random.Random(seed)
        return [float(math.prod(case.dim[name] for name in dims))
                for case in (sample_case(target, rng) for _ in range(draws))]
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


def _num(t: float) -> str:
    return f"{t:.0e}".replace("e+0", "e").replace("e+", "e")


def row(label: str, work: list[float], over: list[float]) -> str:
    total = sum(work)
    cells = [f"{100 * sum(w > t for w in work) / len(work):.2f}% / {100 * sum(w for w in work if w > t) / total:.1f}%"
             for t in over]
    return (f"| {label} | {len(work)} | {statistics.median(work):.3g} | {statistics.mean(work):.3g} | "
            f"{max(work):.3g} | " + " | ".join(cells) + " |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="gdn_bwd")
    ap.add_argument("--draws", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sizes", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--dims", default=None, help="The dims whose product is a draw's work (default: all).")
    ap.add_argument("--over", default="1e6,1e7,1e8,1e9,1e10", help="Thresholds of work, comma-separated.")
    a = ap.parse_args(argv)
    target = get_target(a.target)
    dims = a.dims.split(",") if a.dims else list(target.dims)
    unknown = sorted(set(dims) - set(target.dims))
    if unknown:
        ap.error(f"--dims {','.join(unknown)}: target {a.target} has dims {','.join(target.dims)}")
    try:
        over = [float(t) for t in a.over.split(",")]
    except ValueError:
        ap.error(f"--over {a.over}: comma-separated numbers of work (1e6,1e7)")
    plain = dataclasses.replace(target, options={k: v for k, v in (target.options or {}).items() if k != "keep"})
    print(f"{a.target}, {a.draws} draws at the {a.sizes}'s sizes, seed {a.seed}, work = {'*'.join(dims)}\n")
    print("| draws kept | draws | median work | mean work | largest | "
          + " | ".join(f"over {_num(t)}: draws / work" for t in over) + " |")
    print("|" + " --- |" * (5 + len(over)))
    print(row("all", works(plain, a.draws, a.seed, dims, a.sizes), over))
    if plain.options != target.options:
        print(row("by the target's keep", works(target, a.draws, a.seed, dims, a.sizes), over))
    else:
        print(f"\n{a.target} declares no keep: every draw is kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
