"""Bounds-check every memory access of Triton kernels run under the interpreter (CPU).

    TRITON_INTERPRET=1 python tools/interpreter_memcheck.py               # GDN forward, NaN/Inf sweep
    TRITON_INTERPRET=1 python tools/interpreter_memcheck.py --backward    # forward and backward

On a GPU an access outside every tensor is an illegal address (the CUDA context is lost)
or, worse, a silent read of another tensor; under the interpreter it is a read or write of
whatever host memory lies there. ``install()`` wraps the interpreter's masked load and
store: every address a lane with a true mask touches must lie inside one tensor argument
of the launch (from its first element to one past its last), else the launch raises
``RuntimeError("memcheck: ...")`` naming the kernel, the program and the argument nearest
to the address. A memcheck, not a race or miscompile detector: what it passes is the
kernel's index and mask arithmetic, as the interpreter runs it. It hooks Triton's
interpreter internals (`GridExecutor._init_args_hst`, `InterpreterBuilder.create_masked_*`,
Triton 3.9).

The sweep (``main``) runs `gdn.chunk_fwd.chunk_gdn_fwd` (and with ``--backward``
`gdn.chunk_bwd.chunk_gdn_bwd` after it, on the forward's T as `gdn.op` runs it) for every family member with one NaN or +Inf in q,
k, v, g, beta or the initial state (B2 T130 H1 K=V=32, bf16: three chunks, the last one
partial), so the exact and resume parts run; one line per run, exit 1 on any out-of-bounds
access. On the H200 faults of docs/findings.md the forward's 62
runs passed, and 66 forward-and-backward runs at other shapes (K 24 V 20, K 184 V 1, K 32
V 16; NaN in k, g or the initial state), so that fault is not in the index arithmetic.

``masked_out(fn)`` surveys instead the masked-off lanes: per kernel and argument,
the farthest address outside every argument that a masked lane presents. Those read nothing
here; on a GPU a pipelined load is an asynchronous copy issued with zero size at that address
(a hypothesis for the state pass's fault in docs/findings.md, which it did not explain). At that fault's
case (bf16 B4 T16 H16 K33 V64) the state pass's u load reaches byte 229374 of u's 131072 in
the chunk itself (48 rows past the sequence's end), before any chunk the GPU's pipeline
fetches ahead.
"""
from __future__ import annotations

import inspect
import os
import sys

import numpy as np


# None, or a dict that the check fills with masked-off lanes outside every argument (see
# `masked_out`): the interpreter computes every lane's address, masked or not, as Triton does
# on GPUs, where a pipelined load is an asynchronous copy issued with zero size at the lane's
# address (sm_90 PTX; the state pass's fault in docs/findings.md)
MASKED_OUT: dict | None = None


def masked_out(fn):
    """Run ``fn()`` with the memcheck installed and return {(kernel, argument, "load" or
    "store"): (byte, size)}: for each, the masked-off lane's address outside every argument
    that lies farthest from the argument's start, as a byte offset from it (negative before
    it), and the argument's size in bytes.  The argument is the one the access's live lanes
    address, else the nearest.  Those lanes read nothing under the interpreter; on a GPU a
    load that Triton pipelines still presents their addresses."""
    global MASKED_OUT
    install()
    MASKED_OUT = {}
    try:
        fn()
        return dict(MASKED_OUT)
    finally:
        MASKED_OUT = None


def install():
    """Wrap the interpreter's masked loads and stores with the bounds check (idempotent)."""
    import triton.runtime.interpreter as interp
    if getattr(interp, "_kfuzz_memcheck", False):
        return
    extents: list[tuple[int, int, str]] = []
    launch = {"kernel": "?"}
    init = interp.GridExecutor._init_args_hst

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = init(self, args_dev, kwargs)
        extents.clear()
        launch["kernel"] = getattr(self.fn, "__name__", "?")
        names = list(inspect.signature(self.fn).parameters)
        for name, a in [*zip(names, args_hst), *kwargs_hst.items()]:
            if hasattr(a, "data_ptr") and a.numel() > 0:
                last = sum((s - 1) * st for s, st in zip(a.shape, a.stride()))
                extents.append((a.data_ptr(), a.data_ptr() + (last + 1) * a.element_size(), name))
        return args_hst, kwargs_hst

    def check(ptrs, mask, what):
        addr = np.asarray(ptrs.data)
        on = np.broadcast_to(np.asarray(mask.data), addr.shape).astype(bool)
        live = addr[on].reshape(-1)
        if MASKED_OUT is not None:
            _note_masked_out(addr[~on].reshape(-1), live, what)
        inside = np.zeros(live.shape, dtype=bool)
        for lo, hi, _ in extents:
            inside |= (live >= lo) & (live < hi)
        if not inside.all():
            bad = int(live[~inside][0])
            lo, hi, name = min(extents, key=lambda e: min(abs(bad - e[0]), abs(bad - e[1])),
                               default=(0, 0, "?"))
            raise RuntimeError(f"memcheck: {what} outside every argument of {launch['kernel']} "
                               f"(program {tuple(interp.interpreter_builder.grid_idx)}): "
                               f"{int((~inside).sum())} lanes, the first at byte {bad - lo} of "
                               f"`{name}` ({hi - lo} bytes)")

    def _note_masked_out(dead, live, what):
        """The farthest a masked-off lane's address lies outside every argument, per (kernel,
        argument, load or store), in MASKED_OUT: the argument the access's live lanes address
        (the first live lane's), else the nearest one."""
        if dead.size == 0 or not extents:
            return
        inside = np.zeros(dead.shape, dtype=bool)
        for lo, hi, _ in extents:
            inside |= (dead >= lo) & (dead < hi)
        owner = [e for e in extents if live.size and e[0] <= int(live[0]) < e[1]]
        for bad in np.unique(dead[~inside]):
            bad = int(bad)
            lo, hi, name = owner[0] if owner else min(
                extents, key=lambda e: min(abs(bad - e[0]), abs(bad - e[1])))
            far = bad - lo
            key = (launch["kernel"], name, what)
            if key not in MASKED_OUT or abs(far) > abs(MASKED_OUT[key][0]):
                MASKED_OUT[key] = (far, hi - lo)

    load, store = interp.InterpreterBuilder.create_masked_load, interp.InterpreterBuilder.create_masked_store

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        check(ptrs, mask, "load")
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, cache_policy)
    interp.GridExecutor._init_args_hst = init_args
    interp.InterpreterBuilder.create_masked_load = masked_load
    interp.InterpreterBuilder.create_masked_store = masked_store
    interp._kfuzz_memcheck = True


MEMBERS = [(gate, delta) for gate in ("none", "scalar", "vector") for delta in (True, False)]
INPUTS = ("q", "k", "v", "g", "beta", "h0")


def gdn_sweep(B=2, T=130, H=1, K=32, V=32, values=(float("nan"), float("inf")),
              members=MEMBERS, inputs=INPUTS, backward=False):
    """(run name, None or the memcheck error) for every member x input x value: the forward,
    and with ``backward`` the backward after it (cotangents drawn too).  Inputs as
    `tools/bench_gdn.py` draws them, bf16, on the CPU."""
    import torch
    from bench_gdn import inputs as draw   # (it puts the repository root on sys.path)
    import gdn.chunk_bwd as bwd
    import gdn.chunk_fwd as fwd
    for gate, delta in members:
        for name in inputs:
            for val in values:
                q, k, v, g, beta = draw(B, T, H, K, V, torch.bfloat16, gate, delta, seed=3, device="cpu")
                gen = torch.Generator().manual_seed(3)
                x = dict(q=q, k=k, v=v, g=g, beta=beta, h0=torch.randn(B, H, K, V, generator=gen))
                if x[name] is None:
                    continue
                t = x[name]
                at = (1, 0, 5, 7) if name == "h0" else (0, min(70, T - 1), 0) + ((9,) if t.dim() == 4 else ())
                t[at] = val
                run = f"{gate}-{'delta' if delta else 'linear'} {name}={val}"
                try:
                    _, _, inverse = fwd.chunk_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                      initial_state=x["h0"], delta=delta,
                                                      return_inverse=True)
                    if backward:
                        do = torch.randn(B, T, H, V, generator=gen).bfloat16()
                        bwd.chunk_gdn_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], do,
                                          torch.randn(B, H, K, V, generator=gen), initial_state=x["h0"],
                                          delta=delta, inverse=inverse)
                    yield run, None
                except Exception as e:  # noqa: BLE001  (the interpreter wraps the memcheck's error)
                    if "memcheck:" not in str(e):
                        raise
                    yield run, str(e)[str(e).index("memcheck:"):]


def main():
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run under the interpreter: TRITON_INTERPRET=1 python tools/interpreter_memcheck.py")
    install()
    bad = 0
    for run, err in gdn_sweep(backward="--backward" in sys.argv[1:]):
        bad += err is not None
        print(f"{run}: {err or 'ok'}", flush=True)
    print(f"{'NOTOK' if bad else 'ALLOK'}: {bad} run(s) touched memory outside their arguments")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
