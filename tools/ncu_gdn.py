"""Run the GDN forward or backward once, warm, between cudaProfilerStart and Stop, for Nsight
Compute on a GPU: its hardware counters per kernel, without the compiles and autotuning.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats python3 tools/ncu_gdn.py --pass fwd

Inputs: tools/bench_gdn.py's, at its bench shape (bf16, B8 T4096 H16 K=V=128) unless told
otherwise.  It measures nothing itself; ncu reads the counters of the launches in between.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gdn import inputs  # noqa: E402  (it puts the repository root on sys.path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pass", dest="which", choices=["fwd", "bwd"], default="fwd")
    ap.add_argument("--gate", default="scalar", choices=["scalar", "none", "vector"])
    ap.add_argument("--shape", default="8,4096,16,128,128", help="B,T,H,K,V")
    args = ap.parse_args(argv)
    B, T, H, K, V = map(int, args.shape.split(","))
    q, k, v, g, beta = inputs(B, T, H, K, V, torch.bfloat16, args.gate)
    if args.which == "fwd":
        from gdn.chunk_fwd import chunk_gdn_fwd

        def run():
            chunk_gdn_fwd(q, k, v, g, beta)
    else:
        from gdn.chunk_bwd import chunk_gdn_bwd
        do = torch.randn_like(v)

        def run():
            chunk_gdn_bwd(q, k, v, g, beta, do)
    run()   # compiles and autotunes outside the profiled range
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
