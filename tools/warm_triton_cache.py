"""Compile a target's Triton kernels for every case of the gates, in parallel, before a
`kfuzz verify` on a GPU.

    python tools/warm_triton_cache.py --target gdn_bwd --device cuda --jobs 14 [--gates G01,G03] [--seed 0]
    kfuzz verify --target gdn_bwd --device cuda --jobs 12

Why: on the H200 a gdn_bwd gate case costs about 45 s of Triton compiles (every case is a new
shape class: the forward's H, K, V are constexprs, the backward specializes T, H, K, V), and
`kfuzz verify --jobs N` runs gates, not cases, in parallel, so its longest gate (G03 or G04,
about 30 cases) took the time (G05's 9 cases alone took 437 s).  Triton's
on-disk cache (TRITON_CACHE_DIR, default ~/.triton/cache) is shared by every process on the
machine, so this tool spreads all the gates' cases over --jobs processes, each calling the
kernel once per case (compiling what the case needs), and the verify that follows finds them
compiled.  Same seed, same cases: the gates draw theirs from (gate, seed, index).

The kernel's result is not judged here and an exception is counted, not fatal (the gate
judges it).  Prints the cases run, the calls that raised, and the seconds; exit 0.

Two rounds: first one case of each compile class (`compile_class`: the
dtype and the dims), spread over the processes, then the rest (compiled by then).  Spread round-robin in one round,
processes compiled the same class at once, each for itself (Triton's cache has no lock
between processes): on the H200 (gdn_bwd G01-G04, G06, G07, 15 processes, six verify
processes beside them) the warm-up ran out of its 301 s, and every gate of its 154 s.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def gate_cases(target_name: str, gates: str | None, seed: int) -> list:
    """Every case the named gates (default all twelve) would run on the target."""
    from kfuzz.gates import GATES, parse_gates
    from kfuzz.target import get_target
    target = get_target(target_name)
    return [case for gid in parse_gates(gates) for case in GATES[gid].cases(target, seed)]


def compile_class(case) -> tuple:
    """What a case's Triton compiles depend on, as far as a case shows it: its dtype and dims.
    (Coarser classes miss: the GDN forward specializes integers derived from T, the chunk
    count among them, and its tuned state pass is keyed by N*H; gdn_bwd's G01-G04 and G06
    have 34 shapes in 192 cases.)"""
    return (case.dtype, tuple(sorted(dict(case.dims).items())))


def rounds(cases: list) -> tuple[list, list]:
    """(one case of each compile class, the rest), in the cases' order."""
    seen, first, rest = set(), [], []
    for case in cases:
        key = compile_class(case)
        (rest if key in seen else first).append(case)
        seen.add(key)
    return first, rest


def _call_each(args) -> tuple[int, int]:
    """(cases called, calls that raised) for one process's share of the cases."""
    target_name, device, cases = args
    import torch
    from kfuzz.target import get_target, prepare_triton
    from kfuzz.tensors import materialize
    prepare_triton()
    target = get_target(target_name)
    raised = 0
    for case in cases:
        try:
            target.kernel(**materialize(case, target, device))
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception:  # noqa: BLE001  (the gate judges it; here only the compile matters)
            raised += 1
    return len(cases), raised


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--gates", default=None, help="comma-separated gate ids (default: all twelve)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    start = time.monotonic()
    cases = gate_cases(a.target, a.gates, a.seed)
    jobs = max(1, min(a.jobs, len(cases)))
    first, rest = rounds(cases)
    done = []
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:   # spawn: CUDA in children
        for part in (first, rest):   # one case a class first: no class compiled twice at once
            done += pool.map(_call_each, [(a.target, a.device, [c]) for c in part], chunksize=1)
            print(f"{a.target}: {len(part)} case(s) done, {time.monotonic() - start:.1f} s", flush=True)
    print(f"{a.target}: {sum(n for n, _ in done)} case(s) called in {jobs} process(es) "
          f"({len(first)} compile classes), {sum(r for _, r in done)} raised, "
          f"{time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
