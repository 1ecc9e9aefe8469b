"""Benchmark the GDN-family forward (gdn.chunk_fwd) against fla's
chunk_gated_delta_rule on a GPU: time, floors, accuracy against the float64
oracle, and the NaN/Inf contract on the device.

    python tools/bench_gdn.py [--out reports/bench_gdn.md] [--no-fla] [--budget SECONDS] [--stages fwd,bwd,...]

The ``fwd`` stage is three: ``fwdtime`` (ours and fla at B8 T4096, B1 T65536 and 64 varlen
sequences, in that order, the later shapes skipped past ``--budget``), ``fwdacc`` (every
member's error against the float64 oracle beside fla's own op, ``--acc-members`` and
``--acc-dtypes``; fla's fp32 autotuning takes minutes on a fresh machine) and ``fwdnan`` (the
NaN/Inf sets); each can be run alone.

The ``bwd`` stage times our backward (gdn.chunk_bwd) and forward+backward
(gdn.op.gdn_attention through autograd) against fla's chunk_gated_delta_rule
through autograd, with peak memory and gradient error against float64
autograd through the oracle. fla 0.6.0 refuses its gated backward on Hopper
with Triton < 3.7.1 (a guard in fla/ops/common/chunk_o.py, for fla issue #640:
wrong db/dg); the stage lifts that guard at run time, in this process only, to
time it, so fla's db/dg errors below are what that guard warns of.

The ``bwdprof`` and ``fwdprof`` stages (not in the default) time our backward and
forward per kernel (torch profiler); ``flaprof`` does the same for fla.  ``fwdprof`` takes
``--members`` (e.g. GDN) and ``--out-launches``, a JSON list of output-kernel launches
(overrides of `gdn.config.GDNConfig.out_sliced`'s fields) timed one after another in the same
process.  The accuracy and NaN stages run the state pass at its first config that fits
(``state_pick`` "first"), not the tuner's timed pick.

Writes a Markdown section (docs/benchmarks.md, "GDN on the H200", shows it) after
every stage, so a run cut short still leaves what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import dataclasses
import time
import traceback
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")   # fla's pure Triton path
import gdn.chunk_fwd as fwd  # noqa: E402
import gdn.fwd_state as fwd_state  # noqa: E402
from gdn.config import DEFAULT  # noqa: E402
from gdn.oracle import recurrence  # noqa: E402

FIRST = dataclasses.replace(DEFAULT, state_pick="first")   # accuracy runs: no tuner's timing

COPY_BW = 4.3e12      # bytes/s, device-to-device copy measured on this H200 (KINDS.md)
BF16_RATE = 790e12    # FLOP/s, dense bf16 matrix product measured there
MEMBERS = [(gate, delta) for gate in ("scalar", "none", "vector") for delta in (True, False)]
NAMES = {("none", True): "DeltaNet", ("scalar", True): "GDN", ("vector", True): "KDA",
         ("none", False): "linear attn", ("scalar", False): "Mamba2-SSD", ("vector", False): "GLA"}


def fla_member(gate, delta):
    """fla 0.6.0's forward for a family member, as (q, k, v, g, beta, h0) -> (o, final state),
    gates in natural-log space as ours: GDN chunk_gated_delta_rule, Mamba2-SSD and linear
    attention chunk_simple_gla (g None for the latter), DeltaNet chunk_delta_rule, KDA
    chunk_kda (its gate given, not formed in the kernel), GLA chunk_gla."""
    try:
        if (gate, delta) == ("scalar", True):
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as f
            return lambda q, k, v, g, b, h0: f(q, k, v, g, b, initial_state=h0, output_final_state=True)
        if not delta and gate in ("scalar", "none"):
            from fla.ops.simple_gla import chunk_simple_gla as f
            return lambda q, k, v, g, b, h0: f(q, k, v, g=g, initial_state=h0, output_final_state=True)
        if (gate, delta) == ("none", True):
            from fla.ops.delta_rule import chunk_delta_rule as f
            return lambda q, k, v, g, b, h0: f(q, k, v, b, initial_state=h0, output_final_state=True)
        if (gate, delta) == ("vector", True):
            from fla.ops.kda import chunk_kda as f
            return lambda q, k, v, g, b, h0: f(q, k, v, g, b, initial_state=h0, output_final_state=True)
        from fla.ops.gla import chunk_gla as f
        return lambda q, k, v, g, b, h0: f(q, k, v, g, initial_state=h0, output_final_state=True)
    except ImportError:
        return None


def inputs(B, T, H, K, V, dtype, gate="scalar", delta=True, seed=0, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, device=device)
    q = rnd(B, T, H, K).to(dtype)
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1).to(dtype)
    v = rnd(B, T, H, V).to(dtype)
    g = None
    if gate == "scalar":
        g = torch.nn.functional.logsigmoid(rnd(B, T, H) + 2)
    elif gate == "vector":
        g = torch.nn.functional.logsigmoid(rnd(B, T, H, K) + 2)
    beta = torch.sigmoid(rnd(B, T, H)).to(dtype) if delta else None
    return q, k, v, g, beta


def floors(B, T, H, K, V, N, bytes_el):
    """Fewest bytes (q, k, v, o once; g fp32, beta; final state fp32) and the dense
    FLOPs of the chunked algorithm (C = 64): kk^T, qk^T, T k, T v, Aqk v (C^2 K or
    C^2 V each) and w S, q S, k^T v (C K V each), two FLOPs a multiply-add."""
    C = 64
    by = B * T * H * ((2 * K + 2 * V) * bytes_el + 4 + bytes_el) + N * H * K * V * 4
    fl = 2 * B * T * H * (C * (3 * K + 2 * V) + 3 * K * V)
    return by, fl


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


class Report:
    def __init__(self, path):
        self.path, self.parts = Path(path), []

    def add(self, text):
        self.parts.append(text)
        self.path.write_text("\n".join(self.parts) + "\n")
        print(text, flush=True)


GRADS = ("dq", "dk", "dv", "dg", "dbeta")


def oracle_grads(q, k, v, g, beta, do):
    xs = [x.detach().double().requires_grad_() for x in (q, k, v, g, beta)]
    o, _ = recurrence(*xs)
    return torch.autograd.grad(o, xs, do.double())


def peak_mb(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def kept_mb(fwd_fn):
    """MB that a forward through autograd holds until its backward (its output and what it
    saves for the backward), over what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = fwd_fn()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base
    del out
    return kept / 2 ** 20


def backward_stage(rep, fla_module):
    """Backward and forward+backward, ours against fla, B8 T4096 H16 K=V=128 bf16 (GDN)."""
    from gdn.chunk_bwd import chunk_gdn_bwd
    from gdn.op import gdn_attention
    fla = None
    if fla_module is not None:
        import fla.ops.common.chunk_o as chunk_o
        chunk_o.TRITON_ABOVE_3_7_1 = True   # lift fla's Hopper guard (#640) for timing; see docstring
        fla = fla_module
    B, T, H, K, V = 8, 4096, 16, 128, 128
    q, k, v, g, beta = inputs(B, T, H, K, V, torch.bfloat16)
    do = torch.randn(B, T, H, V, device="cuda").to(torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]

    def ours_bwd():
        return chunk_gdn_bwd(q, k, v, g, beta, do)

    def ours_fwd(save_states=True):
        return gdn_attention(*leaves, save_states=save_states)[0]

    def fla_fwd():
        return fla(*leaves, scale=K ** -0.5)[0]

    def fwdbwd_of(fwd_fn):
        return lambda: torch.autograd.grad(fwd_fn(), leaves, do)
    rows = [("ours", ours_bwd, ours_fwd),
            ("ours, save_states=False", None, lambda: ours_fwd(save_states=False))] \
        + ([("fla", None, fla_fwd)] if fla else [])
    rep.add("### Backward (bf16, GDN, B8 T4096 H16 K=V=128; median of triton.testing.do_bench)\n\n"
            "| impl | bwd ms | fwd+bwd ms | peak MB over inputs (fwd+bwd) | MB kept from fwd to bwd "
            "(o included) |\n| --- | --- | --- | --- | --- |")
    for name, bwd, fwd_fn in rows:
        try:
            t_b = do_bench(bwd, warmup=50, rep=200, return_mode="median") if bwd else float("nan")
            fwdbwd = fwdbwd_of(fwd_fn)
            fwdbwd()
            t_fb = do_bench(fwdbwd, warmup=50, rep=200, return_mode="median")
            rep.add(f"| {name} | {t_b:.3f} | {t_fb:.3f} | {peak_mb(fwdbwd):.0f} | {kept_mb(fwd_fn):.0f} |")
        except Exception:  # noqa: BLE001
            rep.add(f"| {name} | failed: {traceback.format_exc(limit=3)!r} |")
    del q, k, v, g, beta, do, leaves
    q, k, v, g, beta = inputs(1, 512, 16, 128, 128, torch.bfloat16, seed=5)
    do = torch.randn(1, 512, 16, 128, device="cuda").to(torch.bfloat16)
    want = oracle_grads(q, k, v, g, beta, do)
    rep.add("\n### Gradient error: normwise rel. error vs float64 autograd through the oracle "
            "(bf16, GDN, B1 T512 H16 K=V=128, same inputs)\n\n| impl | " + " | ".join(GRADS)
            + " |\n| --- |" + " --- |" * len(GRADS))
    got = {"ours": chunk_gdn_bwd(q, k, v, g, beta, do)}
    if fla:
        lv = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
        o, _ = fla(*lv, scale=K ** -0.5)
        got["fla"] = torch.autograd.grad(o, lv, do)
    for name, grads in got.items():
        rep.add(f"| {name} | " + " | ".join(f"{rel(a, w):.2e}" for a, w in zip(grads, want)) + " |")


def kernel_times(fn, runs=5):
    """{kernel name: mean device ms per call} of `fn` over `runs` calls (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in p.events():
        if e.device_type.name == "CUDA":
            times[e.name] = times.get(e.name, 0.0) + e.device_time / runs / 1000
    return times


def profile_row(label, fn, note=lambda: ""):
    """A table row for ``fn``: | label | do_bench median ms | kernels by device time | (or
    | label | failed: traceback |).  True when it ran."""
    try:
        fn()
        t = f"{do_bench(fn, warmup=50, rep=200, return_mode='median'):.3f} | "
        ks = sorted(kernel_times(fn).items(), key=lambda x: -x[1])
        return f"| {label} | {t}" + ", ".join(f"{n[:40]} {ms:.3f}" for n, ms in ks if ms >= 0.002) \
            + f"{note()} |", True
    except Exception:  # noqa: BLE001
        return f"| {label} | failed: {traceback.format_exc(limit=3)!r} |", False


def backward_profile_stage(rep):
    """Our backward per kernel (torch profiler), B8 T4096 H16 K=V=128 bf16 (GDN)."""
    import gdn.chunk_bwd as cb
    q, k, v, g, beta = inputs(8, 4096, 16, 128, 128, torch.bfloat16)
    do = torch.randn(8, 4096, 16, 128, device="cuda").to(torch.bfloat16)
    rep.add("### Backward per kernel (bf16, GDN, B8 T4096 H16 K=V=128; do_bench median; "
            "torch profiler, mean of 5)\n\n| member | bwd ms | per kernel ms |\n| --- | --- | --- |")
    rep.add(profile_row("GDN", lambda: cb.chunk_gdn_bwd(q, k, v, g, beta, do))[0])
    # as the autograd op runs it (save_states): on the forward's T, chunk states, w and v_new
    saved = fwd.chunk_gdn_fwd(q, k, v, g, beta, return_saved=True)[2]
    rep.add(profile_row("GDN on the forward's saved states",
                        lambda: cb.chunk_gdn_bwd(q, k, v, g, beta, do, saved=saved))[0])
    del saved
    # as the autograd op runs it with save_states=False: on the forward prep's T only
    inverse = fwd.chunk_gdn_fwd(q, k, v, g, beta, return_inverse=True)[2]
    rep.add(profile_row("GDN on the forward's T",
                        lambda: cb.chunk_gdn_bwd(q, k, v, g, beta, do, inverse=inverse))[0])


def fla_profile_stage(rep, fla):
    """fla's forward and forward+backward per kernel (torch profiler), bf16 GDN B8 T4096 H16
    K=V=128: the stage-by-stage yardstick for ours (fwdprof, bwdprof).  Lifts fla's Hopper
    guard as backward_stage does."""
    import fla.ops.common.chunk_o as chunk_o
    chunk_o.TRITON_ABOVE_3_7_1 = True
    q, k, v, g, beta = inputs(8, 4096, 16, 128, 128, torch.bfloat16)
    do = torch.randn(8, 4096, 16, 128, device="cuda").to(torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]

    def fwd_only():
        with torch.no_grad():
            return fla(q, k, v, g, beta, scale=128 ** -0.5)

    def fwdbwd():
        o, _ = fla(*leaves, scale=128 ** -0.5)
        return torch.autograd.grad(o, leaves, do)
    rep.add("### fla per kernel (bf16, GDN, B8 T4096 H16 K=V=128; do_bench median; torch profiler, "
            "mean of 5)\n\n| pass | ms | per kernel ms |\n| --- | --- | --- |")
    for name, fn in (("forward", fwd_only), ("forward+backward", fwdbwd)):
        rep.add(profile_row(name, fn)[0])


def _cuda_alive():
    """False once the CUDA context is lost (an illegal address poisons every later call)."""
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
        return True
    except Exception:  # noqa: BLE001
        return False


def forward_profile_stage(rep, members=("KDA", "GDN"), out_launches=({},)):
    """Our forward per kernel (torch profiler), bf16 KDA then GDN (or the named ``members``) at
    B8 T4096 H16 K=V=128, with the state kernel's autotune pick, once for each of
    ``out_launches`` (overrides of the fields of `gdn.config.GDNConfig.out_sliced`, the output
    kernel's sliced launch; {}: the default).  A row that fails is written with its traceback; a failure that loses the
    CUDA context ends the stage with a row that says so."""
    rep.add("### Forward per kernel (bf16, B8 T4096 H16 K=V=128; do_bench median; torch "
            "profiler, mean of 5)\n\n| member | fwd ms | per kernel ms |\n| --- | --- | --- |")
    for gate, delta in (("vector", True), ("scalar", True)):
        if NAMES[gate, delta] not in members:
            continue
        q, k, v, g, beta = inputs(8, 4096, 16, 128, 128, torch.bfloat16, gate, delta)
        for launch in out_launches:
            config = dataclasses.replace(DEFAULT, out_sliced=dataclasses.replace(DEFAULT.out_sliced, **launch))
            label = NAMES[gate, delta] + (f", out {launch}" if launch else "")
            print(f"(fwdprof: {label} running)", flush=True)
            row, ran = profile_row(label, lambda: fwd.chunk_gdn_fwd(q, k, v, g, beta, delta=delta, config=config),
                                   note=lambda: f"; state config {getattr(fwd_state._tuner(config), 'best_config', None)}")
            rep.add(row)
            if not ran and not _cuda_alive():
                rep.add("\nThe CUDA context is lost after this failure: the rows after it were not run.")
                return


def nan_stage(rep, B, T, H, K, V, out_of_time):
    """The NaN/Inf contract on the device: one value injected mid-chunk into each input of
    each member; ours must give NaN and Inf exactly where the float64 oracle does."""
    bad, runs, lost = [], 0, None
    for gate, delta in MEMBERS:
        for name in ("q", "k", "v", "g", "beta", "h0"):
            for val in (float("nan"), float("inf"), float("-inf")):
                if out_of_time() or lost:
                    break
                q, k, v, g, beta = inputs(B, T, H, K, V, torch.bfloat16, gate, delta, seed=3)
                h0 = torch.randn(B, H, K, V, device="cuda")
                x = dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0)
                if x[name] is None:
                    continue
                t = x[name]
                idx = (1, 2, 5, 7) if name == "h0" else ((0, 150, 3) + ((9,) if t.dim() == 4 else ()))
                t[idx] = val
                run = f"{NAMES[gate, delta]} {name}={val}"
                o, s = recurrence(q, k, v, g, beta, initial_state=h0, delta=delta)
                try:   # synchronized here, so that a fault is charged to the run that made it
                    o1, s1 = fwd.chunk_gdn_fwd(q, k, v, g, beta, initial_state=h0, delta=delta, config=FIRST)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    bad.append(f"{run}: {type(e).__name__} {str(e).splitlines()[0][:80]}")
                    lost = None if _cuda_alive() else run
                    continue
                o = o.to(o1.dtype)
                s = s.float()
                runs += 1
                for a, b, what in ((o1, o, "o"), (s1, s, "state")):
                    if not (torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())):
                        bad.append(f"{run} {what}")
    rep.add("")
    rep.add(f"### NaN/Inf sets on the device (bf16, B={B} T={T} H={H} K=V={K}, one value injected "
            f"mid-chunk): {runs} runs, {len(bad)} mismatches or failures {bad[:10]}\n")
    if lost:
        rep.add(f"The CUDA context was lost at `{lost}`; the runs after it were not made.\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="reports/bench_gdn.md")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--budget", type=float, default=500.0, help="seconds; later stages skip past it")
    ap.add_argument("--stages", default="fwd,bwd",
                    help="comma-separated: fwd (= fwdtime, fwdacc, fwdnan), fwdtime (the three "
                         "shapes), fwdacc (accuracy against float64 beside fla), fwdnan (NaN/Inf sets), "
                         "bwd, bwdprof, fwdprof (ours per kernel), flaprof (fla per kernel)")
    ap.add_argument("--acc-members", default=",".join(NAMES[m] for m in MEMBERS),
                    help="fwdacc: the members, by name")
    ap.add_argument("--acc-dtypes", default="bfloat16,float32", help="fwdacc: the input dtypes")
    ap.add_argument("--members", default="KDA,GDN", help="fwdprof: the members to profile")
    ap.add_argument("--out-launches", default="[{}]",
                    help='fwdprof: JSON list of output-kernel launches to profile, e.g. \'[{}, {"bk": 64}]\'')
    args = ap.parse_args()
    stages = set(args.stages.split(","))
    if "fwd" in stages:
        stages |= {"fwdtime", "fwdacc", "fwdnan"}
    t_start = time.time()
    rep = Report(args.out)
    fla = None
    if not args.no_fla:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
        except Exception as e:  # noqa: BLE001
            rep.add(f"(fla not importable: {e!r})")
    dev = torch.cuda.get_device_name()
    rep.add(f"Device: {dev}; torch {torch.__version__}; triton {triton.__version__}; "
            f"python {platform.python_version()}; fla {'yes' if fla else 'no'}.\n")
    if "bwd" in stages:
        backward_stage(rep, fla)
        rep.add("")
    if "bwdprof" in stages:
        backward_profile_stage(rep)
        rep.add("")
    if "fwdprof" in stages:
        forward_profile_stage(rep, args.members.split(","), json.loads(args.out_launches))
        rep.add("")
    if "flaprof" in stages and fla is not None:
        fla_profile_stage(rep, fla)
        rep.add("")

    # -- timing -------------------------------------------------------------------
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(64, 960, (64,), generator=gen)
    lens = (lens * 32768 / lens.sum()).long()
    lens[-1] += 32768 - lens.sum()
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).cuda()
    cases = [("B8 T4096 H16 K=V=128", 8, 4096, None), ("B1 T65536 H16 K=V=128", 1, 65536, None),
             ("64 seqs varlen, T=32768 H16 K=V=128", 1, 32768, cu)]
    def time_case(name, B, T, cus):
        try:
            q, k, v, g, beta = inputs(B, T, 16, 128, 128, torch.bfloat16)
            N = B if cus is None else len(cus) - 1
            ours = lambda: fwd.chunk_gdn_fwd(q, k, v, g, beta, cu_seqlens=cus)  # noqa: E731
            o1, s1 = ours()
            t_ours = do_bench(ours, warmup=50, rep=200, return_mode="median")
            t_fla, diff = float("nan"), float("nan")
            if fla is not None and time.time() - t_start < args.budget:
                fl = lambda: fla(q, k, v, g, beta, output_final_state=True, cu_seqlens=cus)  # noqa: E731
                o2, s2 = fl()
                t_fla = do_bench(fl, warmup=50, rep=200, return_mode="median")
                diff = rel(o1, o2)
            by, flp = floors(B, T, 16, 128, 128, N, 2)
            rep.add(f"| {name} | {t_ours:.3f} | {t_fla:.3f} | {t_fla / t_ours:.2f} | "
                    f"{by / COPY_BW * 1e3:.3f} | {flp / BF16_RATE * 1e3:.3f} | {diff:.1e} |")
        except Exception:  # noqa: BLE001
            rep.add(f"| {name} | failed: {traceback.format_exc(limit=3)!r} |")
    if "fwdtime" in stages:
        rep.add("### Time (bf16, GDN: scalar gate, delta rule; median of triton.testing.do_bench; "
                "the shapes after the first skipped past the budget)\n\n"
                "| case | ours ms | fla ms | fla/ours | bytes floor ms | FLOP floor ms | ours vs fla rel. diff |\n"
                "| --- | --- | --- | --- | --- | --- | --- |")
        for case in cases:
            if case is cases[0] or time.time() - t_start < args.budget:
                time_case(*case)
        rep.add("")

    # -- accuracy -------------------------------------------------------------------
    B, T, H, K, V = 2, 300, 16, 128, 128
    def accuracy(dtype):
        for gate, delta in (m for m in MEMBERS if NAMES[m] in args.acc_members.split(",")):
            if time.time() - t_start > args.budget:
                rep.add("| (budget spent) |")
                break
            try:
                q, k, v, g, beta = inputs(B, T, H, K, V, dtype, gate, delta, seed=2)
                torch.manual_seed(2)
                h0 = torch.randn(B, H, K, V, device="cuda")
                o, s = recurrence(q, k, v, g, beta, initial_state=h0, delta=delta)
                o1, s1 = fwd.chunk_gdn_fwd(q, k, v, g, beta, initial_state=h0, delta=delta, config=FIRST)
                fo = fs = "-"
                ref = fla_member(gate, delta) if fla is not None else None
                if ref is not None:
                    try:
                        o2, s2 = ref(q, k, v, g, beta, h0)
                        fo, fs = f"{rel(o2, o):.2e}", f"{rel(s2, s):.2e}"
                    except Exception as e:  # noqa: BLE001
                        why = str(e).splitlines()[0][:70].replace("|", "/") if str(e) else ""
                        fo = fs = f"fla failed: {type(e).__name__} {why}"
                rep.add(f"| {NAMES[gate, delta]} | {str(dtype)[6:]} | {rel(o1, o):.2e} | "
                        f"{rel(s1, s):.2e} | {fo} | {fs} |")
            except Exception:  # noqa: BLE001
                rep.add(f"| {NAMES[gate, delta]} | {dtype} | failed: {traceback.format_exc(limit=3)!r} |")
    if "fwdacc" in stages:
        rep.add(f"### Accuracy: normwise rel. error vs the float64 oracle (B={B} T={T} H={H} K=V={K}, "
                "on the GPU; o / final state)\n\n| member | dtype | ours o | ours state | fla o | fla state |\n"
                "| --- | --- | --- | --- | --- | --- |")
        for dtype in args.acc_dtypes.split(","):
            accuracy(getattr(torch, dtype))
        rep.add("")
    if "fwdnan" in stages:
        nan_stage(rep, B, T, H, K, V, lambda: time.time() - t_start > args.budget)
    rep.add(f"(bench wall time {time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
