"""GPU sweep of the GDN backward (or forward) over narrow and wide tiles, against float64.

Run on a CUDA machine from the repository root:

    python tools/sweep_gdn_gpu.py [--launch '{"bwd_prep_warps": 8}'] [--jobs 15] [--dtype bf16]
    python tools/sweep_gdn_gpu.py --forward [--tune] [--jobs 15]
    python tools/sweep_gdn_gpu.py --saved   # the backward on what the forward saved (gdn.op)
    python tools/sweep_gdn_gpu.py --saved-inverse   # on the forward's T only (save_states=False)

Why: on the H200 with Triton 3.6 some narrow tile shapes compile to wrong code with no
memory error, and the interpreter on CPU runs none of that code, so only a sweep on the GPU
finds such shapes.  With V tiles that follow V: backward BK 32 with BV 16 (bf16) NaN dq
(right with `_prep` at 8 warps; compute-sanitizer's memcheck, initcheck and racecheck find
nothing), BK 64 with BV 32 dq 0.56 off, V == 1 at K 32 NaN dk; forward V 32 at K >= 64 o
0.36-0.7 off or an illegal address.  So both take 64-wide V tiles at every K (`gdn.config`),
and the backward compiles V generically at V == 1.

Every (gate, K) pair runs in its own subprocess (a fault loses only its CUDA context), --jobs
at once; each runs B1 T100 H2 at every V of the grid, delta rule on, with h0 and a final-state
gradient, and prints one line per case: the normwise relative error of each gradient and ok
when all are under the dtype's bound (NaN fails).  `--forward` runs `gdn.chunk_fwd` instead,
delta rule on and off, at the state pass's first (untuned) config, or with `--tune` at the
autotuner's pick after it tried them all, against the oracle's o and final state.
`--saved` runs the backward as the autograd op does by default, on what
`chunk_gdn_fwd(..., return_saved=True)` saved (T, the chunk states, w and v_new);
`--saved-inverse` as the op does with save_states=False, on the T = (I + A)^-1 that
`chunk_gdn_fwd(..., return_inverse=True)` formed (its _prep then skips the inversion).
`--forward --state-configs all` (or indices) runs every case at each of the state pass's
configs in turn (its matrix part at that one config), `--shape B,T,H` the cases' shape (the
state pass's fault in docs/findings.md was at B4 T16 H16).
`--launch` is a JSON object of `gdn.config.GDNConfig` fields that every child's calls take
(e.g. '{"bwd_prep_warps": 8}').  The last line is ALLOK or NOTOK.
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
SHAPE = (1, 100, 2)    # B, T, H: a partial last chunk
VS = (1, 16, 32, 64)
BOUND = {"bf16": 2e-2, "fp16": 5e-3, "fp32": 1e-4}


GATES = {0: "none", 1: "scalar", 2: "vector"}


def child(gate: int, K: int, dname: str, device: str, vs, forward: bool, tune: bool,
          saved: str = "", shape=SHAPE, state_config: int | None = None, launch: str = "") -> int:
    """Every V at one (gate, K): one line per case; returns the number of cases off bound.
    A case that raises ends the child (a GPU fault loses its CUDA context).  ``launch``: JSON
    config fields (`gdn.config.GDNConfig.from_dict`)."""
    import dataclasses

    import torch
    sys.path.insert(0, str(ROOT / "tools"))
    from kfuzz.target import prepare_triton
    prepare_triton()   # under the interpreter (--device cpu), before gdn's kernels are decorated
    import gdn.fwd_state
    from bench_gdn import inputs   # (it puts the repository root on sys.path)
    from gdn.config import GDNConfig
    config = GDNConfig.from_dict(dict(json.loads(launch or "{}"), state_pick="tune" if tune else "first"))
    cfg = ""
    if state_config is not None:
        # the state pass's PART 0 at that one config: the "first" pick takes the first that
        # fits of the config's list, here a list of one
        one = gdn.fwd_state._state_configs(config)[state_config]
        config = dataclasses.replace(config, state_configs=((one.kwargs["BV"], one.num_warps, one.num_stages),))
        cfg = f" cfg{state_config} BV{one.kwargs['BV']} w{one.num_warps} s{one.num_stages}"
        try:
            gdn.fwd_state._sound_configs([one], K)
        except ValueError:   # a config no launch takes at this K (ptxas 12.8's miscompile)
            print(f"gate{gate} K{K}{cfg}: skipped, never launched at this K", flush=True)
            return 0
    B, T, H = shape
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dname]
    bad = 0
    for V, delta in [(V, d) for V in vs for d in ((True, False) if forward else (True,))]:
        seed = K * 1000 + V
        x = inputs(B, T, H, K, V, dtype, GATES[gate], delta, seed=seed, device=device)
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        h0, do, dht = (torch.randn(*s, generator=gen, device=device)
                       for s in ((B, H, K, V), (B, T, H, V), (B, H, K, V)))
        tag = f"gate{gate} K{K} V{V}{'' if delta else ' linear'} {dname}{cfg}"
        try:
            if forward:
                errs = _forward_errors(*x, h0, do.to(dtype), dht, delta, config)
            else:
                errs = _backward_errors(*x, h0, do.to(dtype), dht, delta, saved, config)
        except Exception as e:  # noqa: BLE001 - a fault is this case's result
            print(f"{tag}: CRASH {type(e).__name__}: {str(e).splitlines()[0][:100]} FAIL", flush=True)
            return bad + 1
        ok = all(e < BOUND[dname] for e in errs.values())   # NaN fails
        bad += not ok
        print(f"{tag}: " + " ".join(f"{n} {e:.1e}" for n, e in errs.items())
              + (" ok" if ok else " FAIL"), flush=True)
    return bad


def _sync(t):
    if t.is_cuda:
        import torch
        torch.cuda.synchronize()


def _forward_errors(q, k, v, g, beta, h0, do, dht, delta, config):
    """{output: normwise relative error}: o and the final state against the oracle's."""
    from bench_gdn import rel
    from gdn.chunk_fwd import chunk_gdn_fwd
    from gdn.oracle import recurrence
    o, s = chunk_gdn_fwd(q, k, v, g, beta, initial_state=h0, delta=delta, config=config)
    _sync(o)
    ro, rs = recurrence(q, k, v, g, beta, initial_state=h0, delta=delta)
    return {"o": rel(o, ro), "state": rel(s, rs)}


def _backward_errors(q, k, v, g, beta, h0, do, dht, delta, saved, config):
    """{gradient: normwise relative error} against float64 autograd through the oracle, with
    an initial state and a final-state gradient; ``saved`` "inverse": on the forward's T,
    "all": on everything the forward saves."""
    import torch
    from bench_gdn import rel
    from gdn.chunk_bwd import chunk_gdn_bwd
    from gdn.chunk_fwd import chunk_gdn_fwd
    from gdn.oracle import recurrence
    kept = chunk_gdn_fwd(q, k, v, g, beta, initial_state=h0, delta=delta,
                         return_saved=True, config=config)[2] if saved else {}
    got = chunk_gdn_bwd(q, k, v, g, beta, do, dht, initial_state=h0, inverse=kept.get("inverse"),
                        saved=kept if saved == "all" else None, config=config)
    _sync(got[0])
    names = [n for n, x in zip(("q", "k", "v", "g", "beta", "h0"), (q, k, v, g, beta, h0)) if x is not None]
    ref = [x.detach().double().requires_grad_() if x is not None else None for x in (q, k, v, g, beta, h0)]
    o, hT = recurrence(*ref[:5], initial_state=ref[5])
    want = torch.autograd.grad((o, hT), [x for x in ref if x is not None], (do.double(), dht.double()))
    return {f"d{n}": rel(a, b) for n, a, b in zip(names, [a for a in got if a is not None], want)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launch", default="", help="JSON object of gdn.config.GDNConfig fields")
    ap.add_argument("--jobs", type=int, default=15)
    ap.add_argument("--dtype", default="bf16", choices=sorted(BOUND))
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (interpreter) for a smoke test")
    ap.add_argument("--ks", default=",".join(map(str, KS)))
    ap.add_argument("--vs", default=",".join(map(str, VS)))
    ap.add_argument("--forward", action="store_true", help="sweep the forward instead")
    ap.add_argument("--tune", action="store_true", help="forward: autotune the state pass")
    ap.add_argument("--saved", action="store_true",
                    help="backward: on all the forward saves, as the autograd op runs it")
    ap.add_argument("--saved-inverse", action="store_true",
                    help="backward: on the forward's T, as the op runs it with save_states=False")
    ap.add_argument("--gates", default="0,1,2", help="gate ids: 0 none, 1 scalar, 2 vector")
    ap.add_argument("--shape", default=",".join(map(str, SHAPE)), help="B,T,H of every case")
    ap.add_argument("--state-configs", default="",
                    help="forward: 'all', or comma-separated indices into the state pass's "
                         "configs: every case at each, in turn (default: the untuned first)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    vs = [int(x) for x in a.vs.split(",")]
    shape = tuple(int(x) for x in a.shape.split(","))
    if a.state_configs and (not a.forward or a.tune):
        ap.error("--state-configs sweeps the forward's untuned state pass: add --forward, "
                 "without --tune")
    if a.device == "cpu":
        # the interpreter, GPU or not: chosen before triton loads, and the children inherit it
        os.environ["TRITON_INTERPRET"] = "1"
    if a.child:
        gate, K, cfg = (int(x) for x in a.child.split(","))
        bad = child(gate, K, a.dtype, a.device, vs, a.forward, a.tune,
                    "all" if a.saved else "inverse" if a.saved_inverse else "", shape,
                    None if cfg < 0 else cfg, a.launch)
        sys.stdout.flush()
        # every case is judged and printed (each synchronized): leave without the interpreter's
        # teardown, which once aborted a child on the H200 ("terminate called without an
        # active exception", exit -6) after all its cases had printed ok
        os._exit(1 if bad else 0)
    # the repository root ahead of the PYTHONPATH this process was given
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    if a.launch:
        sys.path.insert(0, str(ROOT))
        from gdn.config import GDNConfig
        try:   # a typo fails here, not in every child
            GDNConfig.from_dict(json.loads(a.launch))
        except (ValueError, TypeError) as e:
            ap.error(f"--launch: {e}")
    configs = [-1]
    if a.state_configs:
        sys.path.insert(0, str(ROOT))
        from gdn.config import DEFAULT
        from gdn.fwd_state import _state_configs
        n = len(_state_configs(DEFAULT))
        configs = list(range(n)) if a.state_configs == "all" else \
            [int(x) for x in a.state_configs.split(",")]
        if any(not 0 <= c < n for c in configs):
            ap.error(f"--state-configs: indices run from 0 to {n - 1} here")
    groups = [(int(gate), int(K), c) for c in configs for gate in a.gates.split(",")
              for K in a.ks.split(",")]
    running, ok = [], True

    def reap(p, label):
        out, _ = p.communicate()
        print(out, end="", flush=True)
        if p.returncode != 0:
            print(f"gate{label[0]} K{label[1]}: exit {p.returncode}", flush=True)
        return p.returncode == 0
    for gate, K, c in groups:
        if len(running) >= a.jobs:
            ok &= reap(*running.pop(0))
        cmd = [sys.executable, __file__, "--child", f"{gate},{K},{c}", "--dtype", a.dtype,
               "--device", a.device, "--vs", a.vs, "--shape", a.shape] + ["--forward"] * a.forward \
            + ["--tune"] * a.tune + ["--saved-inverse"] * a.saved_inverse + ["--saved"] * a.saved \
            + (["--launch", a.launch] if a.launch else [])
        running.append((subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True), (gate, K)))
    for p, label in running:
        ok &= reap(p, label)
    print("ALLOK" if ok else "NOTOK")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
