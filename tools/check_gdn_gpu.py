"""GPU check of `gdn.chunk_fwd.chunk_gdn_fwd`'s matrix path against the float64 oracle.

Run on a CUDA machine from the repository root:

    python tools/check_gdn_gpu.py            # fixed (first) autotune config
    python tools/check_gdn_gpu.py --tune     # also let the autotuner try every config

Every member (gate none/scalar/vector x delta on/off) and dtype runs in its own
fresh subprocess (an illegal memory access kills the CUDA context, so one
case's fault must not hide the others'), all at once, on inputs that send every chunk to the
matrix path (finite, in the domain; a case whose forward stepped any chunk token by token
fails), for bf16, fp16 and fp32 inputs on four shapes: B2 T300 H4 K=V=128, an odd one (T77 K96 V80), a varlen one and one with
V=16.  One line
per case; the last line is ALLOK or NOTOK.

`--device cpu --small` is a smoke test of this script under the Triton
interpreter (tiny shapes).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

MEMBERS = [(gate, delta) for gate in ("none", "scalar", "vector") for delta in (True, False)]
BOUND = {"bf16": 2e-2, "fp16": 5e-3, "fp32": 1e-4}
SMALL = {
    "B1-T37-H2-K16-V32": dict(B=1, T=37, H=2, K=16, V=32, cu=None),
    "varlen-0,9,10,40-H1-K24-V20": dict(B=1, T=40, H=1, K=24, V=20, cu=[0, 9, 10, 40]),
}
SHAPES = {
    "B2-T300-H4-K128-V128": dict(B=2, T=300, H=4, K=128, V=128, cu=None),
    "B2-T77-H2-K96-V80": dict(B=2, T=77, H=2, K=96, V=80, cu=None),
    "varlen-0,100,101,300-H4-K128-V64": dict(B=1, T=300, H=4, K=128, V=64, cu=[0, 100, 101, 300]),
    # 16-wide output tiles (V <= 16): their bf16 products were wrong on the H200 (gdn.chunk_fwd)
    "B1-T100-H2-K32-V16": dict(B=1, T=100, H=2, K=32, V=16, cu=None),
}


def _inputs(gate, delta, B, T, H, K, V, cu, dtype, device, seed=0):
    import torch
    import torch.nn.functional as F
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device)
    N = B if cu is None else len(cu) - 1
    x = dict(q=rnd(B, T, H, K).to(dtype), k=F.normalize(rnd(B, T, H, K), dim=-1).to(dtype),
             v=rnd(B, T, H, V).to(dtype), g=None, beta=None, initial_state=rnd(N, H, K, V))
    if gate == "scalar":
        x["g"] = F.logsigmoid(rnd(B, T, H))
    elif gate == "vector":
        x["g"] = F.logsigmoid(rnd(B, T, H, K) + 3)
    if delta:
        x["beta"] = torch.sigmoid(rnd(B, T, H)).to(dtype)
    return x


def child(gate, delta, dname, tune, device, shapes):
    """One member and dtype, every shape; prints one line per case, exits 1 on a bound miss."""
    import torch
    import dataclasses

    import gdn.chunk_fwd as cf
    from gdn.config import DEFAULT
    from gdn.oracle import recurrence
    config = dataclasses.replace(DEFAULT, state_pick="tune" if tune else "first")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dname]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    bad = 0
    for sname, sh in shapes.items():
        x = _inputs(gate, delta, dtype=dtype, device=device, **sh)
        cu = None if sh["cu"] is None else torch.tensor(sh["cu"], device=device, dtype=torch.int32)
        kw = dict(initial_state=x["initial_state"], cu_seqlens=cu, delta=delta)
        t0 = time.perf_counter()
        o, s, saved = cf.chunk_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw,
                                       return_saved=True, config=config)
        sync()
        stepped = int(saved["stepped"].sum()) + int(saved["out_stepped"].sum())
        dt = time.perf_counter() - t0
        ro, rs = recurrence(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
        eo = ((o.double() - ro).norm() / ro.norm()).item()
        es = ((s.double() - rs).norm() / rs.norm()).item()
        ok = eo < BOUND[dname] and es < BOUND[dname] and not stepped   # NaN fails
        bad += not ok
        print(f"{gate}-{'delta' if delta else 'linear'} {dname} {sname}: o {eo:.2e} "
              f"state {es:.2e} bound {BOUND[dname]:.0e} (first call {dt:.1f}s)"
              f"{f' {stepped} stepped' if stepped else ''} {'ok' if ok else 'FAIL'}", flush=True)
    sys.exit(1 if bad else 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true", help="autotune the state pass over every config")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of this script")
    ap.add_argument("--small", action="store_true", help="tiny shapes (with --device cpu)")
    ap.add_argument("--member", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.member:
        gate, delta, dname = a.member.split(",")
        child(gate, delta == "1", dname, a.tune, a.device, SMALL if a.small else SHAPES)
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = dict(os.environ, PYTHONPATH=root)
    if a.device == "cpu":
        base["TRITON_INTERPRET"] = "1"
    else:
        base.pop("TRITON_INTERPRET", None)
    procs = []
    for (gate, delta), dname in [(m, d) for m in MEMBERS for d in BOUND]:   # all at once: compiling dominates
        cmd = [sys.executable, os.path.abspath(__file__), "--member", f"{gate},{int(delta)},{dname}",
               "--device", a.device] + (["--tune"] if a.tune else []) + \
            (["--small"] if a.small else [])
        procs.append(((gate, delta), subprocess.Popen(
            cmd, env=base, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    ok = True
    for (gate, delta), p in procs:
        try:
            out, _ = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\nTIMEOUT"
        name = f"{gate}-{'delta' if delta else 'linear'}"
        lines = out.splitlines()
        print("\n".join(ln for ln in lines if ln.startswith(name)))
        if p.returncode != 0:
            ok = False
            if not any(ln.endswith("FAIL") for ln in lines):   # a crash, not a bound miss
                print(f"{name}: CRASH rc={p.returncode}; last output:")
                print("\n".join("    " + ln for ln in lines[-15:]))
    print("ALLOK" if ok else "NOTOK")


if __name__ == "__main__":
    main()
