"""GPU sweep of the GDN backward (or forward) over narrow and wide tiles, against float64.

Run on a CUDA machine from the repository root:

    python tools/sweep_gdn_gpu.py [--launch '{"prep_warps": 8}'] [--jobs 15] [--dtype bf16]
    python tools/sweep_gdn_gpu.py --forward [--tune] [--jobs 15]

Why: on the H200 with Triton 3.6 some narrow tile shapes compiled to wrong code with no
memory error, and the interpreter on CPU runs none of that code, so only a sweep on the GPU
finds such shapes.  Session 7 found, with V tiles that followed V: backward BK 32 with BV 16
(bf16) NaN dq (right with `_prep` at 8 warps; compute-sanitizer's memcheck, initcheck and
racecheck found nothing), BK 64 with BV 32 dq 0.56 off, V == 1 at K 32 NaN dk; forward V 32 at
K >= 64 o 0.36-0.7 off or an illegal address.  Both now take 64-wide V tiles at every K
(gdn.chunk_bwd.tiles, gdn.chunk_fwd), and the backward compiles V generically at V == 1.

Every (gate, K) pair runs in its own subprocess (a fault loses only its CUDA context), --jobs
at once; each runs B1 T100 H2 at every V of the grid, delta rule on, with h0 and a final-state
gradient, and prints one line per case: the normwise relative error of each gradient and ok
when all are under the dtype's bound (NaN fails).  `--forward` runs `gdn.chunk_fwd` instead,
delta rule on and off, at the state pass's first (untuned) config, or with `--tune` at the
autotuner's pick after it tried them all, against the oracle's o and final state.
`--launch` sets GDN_BWD_LAUNCH (the launch overrides of gdn.chunk_bwd) in the children.  The
last line is ALLOK or NOTOK.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KS = (16, 32, 64, 128, 184)
VS = (1, 16, 32, 64)
BOUND = {"bf16": 2e-2, "fp16": 5e-3, "fp32": 1e-4}


def child(gate: int, K: int, dname: str, device: str, vs, forward: bool, tune: bool) -> int:
    """Every V at one (gate, K): one line per case; returns the number of cases off bound."""
    import torch
    sys.path.insert(0, str(ROOT))
    import gdn.fwd_state
    from gdn.chunk_bwd import chunk_gdn_bwd
    from gdn.chunk_fwd import chunk_gdn_fwd
    from gdn.oracle import recurrence
    gdn.fwd_state.TUNE = tune
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dname]
    bad = 0
    for V, delta in [(V, d) for V in vs for d in ((True, False) if forward else (True,))]:
        gen = torch.Generator().manual_seed(K * 1000 + V)

        def rnd(*s):
            return torch.randn(*s, generator=gen)
        B, T, H = 1, 100, 2
        q = rnd(B, T, H, K).to(dtype)
        k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1).to(dtype)
        v = rnd(B, T, H, V).to(dtype)
        g = None if gate == 0 else torch.nn.functional.logsigmoid(
            rnd(*((B, T, H) if gate == 1 else (B, T, H, K))) + 2)
        beta = torch.rand(B, T, H, generator=gen).to(dtype)
        h0, do, dht = rnd(B, H, K, V), rnd(B, T, H, V).to(dtype), rnd(B, H, K, V)
        xs = [x.to(device) if x is not None else None for x in (q, k, v, g, beta, h0)]
        do, dht = do.to(device), dht.to(device)
        tag = f"gate{gate} K{K} V{V}{'' if delta else ' linear'} {dname}"
        if forward:
            ok, errs = _forward_case(xs, delta, BOUND[dname], chunk_gdn_fwd, recurrence, device)
            bad += not ok
            print(f"{tag}: {errs}" + (" ok" if ok else " FAIL"), flush=True)
            continue
        try:
            got = chunk_gdn_bwd(*xs[:5], do, dht, initial_state=xs[5])
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a fault is this case's result
            print(f"{tag}: CRASH {type(e).__name__}: {str(e).splitlines()[0][:100]}",
                  flush=True)
            return bad + 1
        ref = [x.double().requires_grad_() if x is not None else None for x in xs]
        o, hT = recurrence(*ref[:5], initial_state=ref[5])
        want = torch.autograd.grad((o, hT), [x for x in ref if x is not None],
                                   (do.double(), dht.double()))
        got = [a for a in got if a is not None]
        names = ["dq", "dk", "dv"] + (["dg"] if gate else []) + ["dbeta", "dh0"]
        errs = {n: ((a.double() - b).norm() / b.norm()).item() for n, a, b in zip(names, got, want)}
        ok = all(e < BOUND[dname] for e in errs.values())   # NaN fails
        bad += not ok
        print(f"{tag}: " + " ".join(f"{n} {e:.1e}" for n, e in errs.items())
              + (" ok" if ok else " FAIL"), flush=True)
    return bad


def _forward_case(xs, delta, bound, fwd, recurrence, device):
    """(ok, text) of one forward case: o and final state against the oracle's."""
    import torch
    q, k, v, g, beta, h0 = xs
    beta = beta if delta else None
    try:
        o, s = fwd(q, k, v, g, beta, initial_state=h0, delta=delta)
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a fault is this case's result
        return False, f"CRASH {type(e).__name__}: {str(e).splitlines()[0][:100]}"
    ro, rs = recurrence(q, k, v, g, beta, initial_state=h0, delta=delta)
    eo = ((o.double() - ro).norm() / ro.norm()).item()
    es = ((s.double() - rs).norm() / rs.norm()).item()
    return eo < bound and es < bound, f"o {eo:.1e} state {es:.1e}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launch", default="", help="JSON launch overrides (GDN_BWD_LAUNCH)")
    ap.add_argument("--jobs", type=int, default=15)
    ap.add_argument("--dtype", default="bf16", choices=sorted(BOUND))
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (interpreter) for a smoke test")
    ap.add_argument("--ks", default=",".join(map(str, KS)))
    ap.add_argument("--vs", default=",".join(map(str, VS)))
    ap.add_argument("--forward", action="store_true", help="sweep the forward instead")
    ap.add_argument("--tune", action="store_true", help="forward: autotune the state pass")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    vs = [int(x) for x in a.vs.split(",")]
    if a.child:
        gate, K = (int(x) for x in a.child.split(","))
        bad = child(gate, K, a.dtype, a.device, vs, a.forward, a.tune)
        sys.stdout.flush()
        # every case is judged and printed (each synchronized): leave without the interpreter's
        # teardown, which once aborted a child on the H200 ("terminate called without an
        # active exception", exit -6) after all its cases had printed ok (session 7)
        os._exit(1 if bad else 0)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if a.launch:
        json.loads(a.launch)   # a typo fails here, not in every child
        env["GDN_BWD_LAUNCH"] = a.launch
    if a.device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    groups = [(gate, int(K)) for gate in (0, 1, 2) for K in a.ks.split(",")]
    running, ok = [], True

    def reap(p, label):
        out, _ = p.communicate()
        print(out, end="", flush=True)
        if p.returncode != 0:
            print(f"gate{label[0]} K{label[1]}: exit {p.returncode}", flush=True)
        return p.returncode == 0
    for gate, K in groups:
        if len(running) >= a.jobs:
            ok &= reap(*running.pop(0))
        cmd = [sys.executable, __file__, "--child", f"{gate},{K}", "--dtype", a.dtype,
               "--device", a.device, "--vs", a.vs] + ["--forward"] * a.forward + ["--tune"] * a.tune
        running.append((subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True), (gate, K)))
    for p, label in running:
        ok &= reap(p, label)
    print("ALLOK" if ok else "NOTOK")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
