"""Triton's interpreter with and without `kfuzz.interpreter`'s speed patches
(``share_language_patch``, then ``skip_dead_overflow_checks`` too), on the GDN kernels on the
CPU: seconds a call, in one process.

    python tools/bench_interpreter.py [--repeat 2]

Each case is called once to warm the interpreter's caches (its rewritten functions), then
``--repeat`` times as Triton ships (the baseline), with the shared patch, and with both
patches, the three taking turns (so that a change in the machine's load falls on all); the
table gives the fastest call of each and the ratios to the baseline.  The cases: the forward and
the backward of Gated DeltaNet at B1 T70 H1 K=V=32 fp32 (a 64-token chunk and a 6-token one),
and the backward with a NaN in do at token 35, which sends the first chunk to the backward's
step-by-step path (`gdn.bwd_exact`, many small jit calls).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"   # before triton decorates gdn's kernels
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gdn.chunk_bwd import chunk_gdn_bwd  # noqa: E402
from gdn.chunk_fwd import chunk_gdn_fwd  # noqa: E402
from kfuzz.interpreter import share_language_patch, skip_dead_overflow_checks  # noqa: E402


def _inputs(nan_in_do: bool):
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 1, 70, 1, 32, 32
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = dict(q=r(B, T, H, K), k=torch.nn.functional.normalize(r(B, T, H, K), dim=-1), v=r(B, T, H, V),
             g=torch.nn.functional.logsigmoid(r(B, T, H) + 2), beta=torch.sigmoid(r(B, T, H)),
             h0=r(B, H, K, V), do=r(B, T, H, V), dht=r(B, H, K, V))
    if nan_in_do:
        x["do"][0, 35, 0, 3] = float("nan")
    return x


def _forward(x):
    chunk_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                  output_final_state=True)


def _backward(x):
    chunk_gdn_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], x["dht"], initial_state=x["h0"])


CASES = [("forward, B1 T70 H1 K=V=32 fp32", _forward, False),
         ("backward, same", _backward, False),
         ("backward, a NaN in do (step-by-step path)", _backward, True)]


def _seconds(fn, x) -> float:
    t0 = time.perf_counter()
    fn(x)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter

    def installed():
        return interpreter._patch_lang, interpreter.GridExecutor.__call__, TritonSemantic.binary_op_sanitize_overflow_impl

    def install(way):
        interpreter._patch_lang, interpreter.GridExecutor.__call__, TritonSemantic.binary_op_sanitize_overflow_impl = way

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args(argv)
    inputs = {name: _inputs(nan) for name, _, nan in CASES}
    for name, fn, _ in CASES:
        fn(inputs[name])                                  # warm the rewritten functions
    shipped = installed()
    if not share_language_patch():
        print("this Triton's interpreter lacks what kfuzz.interpreter patches", file=sys.stderr)
        return 1
    shared = installed()
    if not skip_dead_overflow_checks():
        print("this Triton lacks the overflow check that kfuzz.interpreter skips", file=sys.stderr)
        return 1
    ways = {"shipped": shipped, "shared": shared, "both": installed()}
    best = {(name, way): float("inf") for name, _, _ in CASES for way in ways}
    for _ in range(a.repeat):
        for name, fn, _ in CASES:
            for way, patches in ways.items():
                install(patches)
                best[name, way] = min(best[name, way], _seconds(fn, inputs[name]))
    print("| case | as Triton ships, s | shared patch, s | ratio | both patches, s | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, _, _ in CASES:
        b, s_, both = best[name, "shipped"], best[name, "shared"], best[name, "both"]
        print(f"| {name} | {b:.2f} | {s_:.2f} | {b / s_:.2f} | {both:.2f} | {b / both:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
