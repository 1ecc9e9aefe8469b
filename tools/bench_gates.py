"""Where a target's gates spend their time: the kernel, the oracle, the trusted implementation,
and kfuzz's own judging (drawing and injecting inputs, comparing, the gates' bookkeeping).

    python tools/bench_gates.py TARGET [--gates G01,G03] [--device auto] [--weights seed] [--profile N]

Runs each gate in this process (the kernel in process too, so that no worker's start-up
counts) with the kernel, the oracle (the reference on float64 inputs) and the trusted
implementation timed call by call, and prints a table, a row a gate. ``bare`` is the time of
those calls alone, the loop that runs the same cases with no kfuzz around them, and ``bare /
total`` kfuzz's rate as a share of that loop's. ``--weights`` is passed to the resolver of a
``kb:`` target (``seed``: the solution's own same-seed weights, as the audit judges a kernel
whose weights do not load as its reference's). ``--profile N``: after each gate's row, the N
functions of this process with the most time of their own over a second run of the gate under
cProfile (``tottime``; the row comes from the first, unprofiled), for the judging column's
parts; on a GPU, time waiting for its work shows up in the calls that synchronize with it
(``synchronize``, ``item``, a copy to the CPU).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import time
from collections import Counter

import torch

from kfuzz.devices import resolve_device
from kfuzz.errors import KfuzzError
from kfuzz.gates import GATES, parse_gates, run_gate
from kfuzz.target import RESOLVERS, get_target, load_target


def timed(target, seconds: Counter, calls: Counter, cuda: bool = False):
    """``target`` with its kernel, oracle and trusted calls adding their seconds to ``seconds``
    (with ``cuda``, each call's work on the GPU finished before its clock stops)."""
    def clock(name, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if cuda:
                    torch.cuda.synchronize()
                seconds[name] += time.perf_counter() - start
                calls[name] += 1
        return call

    reference = target.reference

    def split_reference(**inputs):
        floats = [v.dtype for v in inputs.values() if v.is_floating_point()]
        role = "oracle" if floats and floats[0] == torch.float64 else "trusted"
        return clock(role, reference)(**inputs)

    changes = {"kernel": clock("kernel", target.kernel), "reference": split_reference}
    if target.trusted is not None:
        changes["trusted"] = clock("trusted", target.trusted)
    return dataclasses.replace(target, **changes)


def own_time(profiler: cProfile.Profile, n: int) -> str:
    """The ``n`` functions with the most time of their own, as cProfile prints them."""
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(n)
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    first = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return "\n".join(["", f"The {n} functions with the most time of their own over the gate (cProfile):",
                      "```", *lines[first:], "```", ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target")
    ap.add_argument("--gates", default="")
    ap.add_argument("--device", default="auto", help="auto (cuda where torch sees a GPU), cpu, cuda or cuda:N")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weights", default=None, help="a kb: target's weights (strict, the default; seed; none)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after each gate, the N functions with the most time of their own")
    args = ap.parse_args(argv)
    try:
        args.device = resolve_device(args.device)
    except KfuzzError as e:
        ap.error(str(e))
    try:
        if any(args.target.startswith(p) for p in RESOLVERS):     # built for the device asked
            target = load_target(args.target, resolve={"weights": args.weights or "strict",
                                                       "device": args.device})
        else:
            target = get_target(args.target)
        gates = parse_gates(args.gates)
    except KfuzzError as e:
        ap.error(str(e))
    seconds, calls = Counter(), Counter()
    target = timed(target, seconds, calls, cuda=args.device.startswith("cuda"))
    from kfuzz.execute import COMPARE_ON_DEVICE_MIN
    where = (f"oracle and trusted implementation on {args.device}, outputs of {COMPARE_ON_DEVICE_MIN:,} elements "
             f"or more compared there" if args.device.startswith("cuda") else "everything on the CPU")
    print(f"{args.target} on {args.device} ({where}), torch threads {torch.get_num_threads()}\n")
    print("| gate | status | cases | total s | kernel s | oracle s | trusted s | judging s | bare / total |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for gid in gates:
        seconds.clear()
        calls.clear()
        start = time.perf_counter()
        result = run_gate(GATES[gid], target, seed=args.seed, device=args.device)
        total = time.perf_counter() - start
        bare = sum(seconds.values())
        share = f"{bare / total:.2f}" if total > 0 and result.cases else "-"
        print(f"| {gid} | {result.status} | {result.cases} | {total:.2f} | {seconds['kernel']:.2f} | "
              f"{seconds['oracle']:.2f} | {seconds['trusted']:.2f} | {total - bare:.2f} | {share} |",
              flush=True)
        if args.profile > 0:     # a second run of the gate, so that the row above is timed unprofiled
            profiler = cProfile.Profile()
            profiler.runcall(run_gate, GATES[gid], target, seed=args.seed, device=args.device)
            print(own_time(profiler, args.profile), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
