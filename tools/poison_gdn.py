"""Run the GDN op (forward and backward) with its scratch memory filled on purpose, to find
reads of memory a kernel did not write.

    python tools/poison_gdn.py --case '{"target": "gdn_bwd", "dtype": "bfloat16", "seed": 560586626,
        "dims": {"B": 1, "H": 3, "K": 17, "T": 1, "V": 17}, "args": {...}}' --device cuda --runs 200

Every tensor that the gdn modules allocate with ``torch.empty``/``empty_like`` (hand-offs
between launches, flags, the outputs themselves) is left as it comes (``asis``), or filled
with zeros (``zero``), NaN (``nan``: floats; integers 1, int8 flags too), or huge finite values
(``huge``: 3e38; integers -1).  A kernel that reads only what it wrote gives the same bits
under every fill.  On a GPU the caching allocator hands back memory holding earlier values, so
a read of unwritten memory shows there as a sporadic NaN; on the CPU fresh memory is mostly
zeros and the same read stays harmless, so the fills make it show everywhere.
``nanpool`` keeps torch.empty as it is but first fills the device's free memory with NaN (a
large NaN tensor allocated and freed, so the caching allocator's next blocks hold NaN): what a
campaign's process sees after a case with NaN inputs.

`fills` and `reversed_programs` (the interpreter's programs in reverse grid order) are the
context managers that tests use (tests/test_gdn_poison.py).  The command line
replays a case (as JSON: `kfuzz show` prints it) ``--runs`` times under each fill on
``--device`` (after ``--before``'s case each time, where given) and prints, per fill, the runs whose outputs hold a NaN or Inf where the float64
oracle's are finite, and the outputs' bits that differ from the ``zero`` fill's; with
``--sites`` it then poisons one allocation site (file:line) at a time, to name the buffer
whose unwritten part is read.  Exit 1 when any fill changed a result, else 0.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FILLS = ("zero", "nan", "huge")
_FLOAT = {"zero": 0.0, "nan": float("nan"), "huge": 3e38}
_INT = {"zero": 0, "nan": 1, "huge": -1}


def _fill(t: torch.Tensor, fill: str) -> torch.Tensor:
    if fill == "asis" or t.numel() == 0:
        return t
    if t.is_floating_point():
        t.fill_(_FLOAT[fill])
    elif t.dtype != torch.bool:
        t.fill_(_INT[fill])
    return t


class _FilledTorch:
    """``torch`` as a gdn module sees it, with ``empty``/``empty_like`` filled (``site``: only
    the allocations made from that "file:line" of a gdn module; the caller's frame names it)."""

    def __init__(self, fill: str, site: str | None, seen: set):
        self._fill, self._site, self._seen = fill, site, seen

    def __getattr__(self, name):
        return getattr(torch, name)

    def _filled(self, t):
        f = sys._getframe(2)
        where = f"{Path(f.f_code.co_filename).name}:{f.f_lineno}"
        self._seen.add(where)
        return _fill(t, self._fill) if self._site in (None, where) else t

    def empty(self, *a, **kw):
        return self._filled(torch.empty(*a, **kw))

    def empty_like(self, *a, **kw):
        return self._filled(torch.empty_like(*a, **kw))


def gdn_modules() -> list:
    """The imported gdn modules that allocate through ``torch``."""
    import gdn.chunk_bwd  # noqa: F401  (the launchers: every allocation of the op)
    import gdn.chunk_fwd  # noqa: F401
    return [m for n, m in sorted(sys.modules.items())
            if (n == "gdn" or n.startswith("gdn.")) and getattr(m, "torch", None) is torch]


@contextlib.contextmanager
def fills(fill: str, site: str | None = None):
    """Within the block, the gdn modules' ``torch.empty``/``empty_like`` give tensors filled
    by ``fill`` (one of FILLS, or "asis"); with ``site`` ("chunk_bwd.py:391") only those
    allocated there.  Yields the set of sites seen."""
    seen: set = set()
    mods = gdn_modules()
    proxy = _FilledTorch(fill, site, seen)
    for m in mods:
        m.torch = proxy
    try:
        yield seen
    finally:
        for m in mods:
            m.torch = torch


@contextlib.contextmanager
def reversed_programs():
    """Within the block, the Triton interpreter runs every launch's programs in reverse grid
    order.  Programs of one launch run concurrently on a GPU, in no order: a program that
    reads what another program of the same launch writes gives a result that depends on the
    order, and the interpreter's fixed order hides it."""
    import triton.runtime.interpreter as interp
    orig = interp.InterpreterBuilder.set_grid_idx

    def set_grid_idx(self, x, y, z):
        return orig(self, self.grid_dim[0] - 1 - x, self.grid_dim[1] - 1 - y, self.grid_dim[2] - 1 - z)
    interp.InterpreterBuilder.set_grid_idx = set_grid_idx
    try:
        yield
    finally:
        interp.InterpreterBuilder.set_grid_idx = orig


def nan_pool(device) -> None:
    """Fill the device's free cached memory with NaN: the next allocations of the caching
    allocator then start as NaN (CUDA; nothing on the CPU)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    free = torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    blocks = []
    for size in (1 << 30, 1 << 26, 1 << 22, 1 << 20, 1 << 16):   # bytes: big, then the small pool
        for _ in range(4 if size >= 1 << 26 else 64):
            if size > free // 2:
                break
            blocks.append(torch.full((size // 4,), float("nan"), device=dev))
    del blocks


def op_outputs(x: dict, cu=None, delta: bool = True, save_states: bool = True, config=None) -> list:
    """(o, final state, dq, dk, dv, dg, dbeta, dh0) of `gdn.op.gdn_attention` on inputs x
    (q, k, v, g, beta, h0, do, dht; g, beta, h0 may be None); ``config``: a `gdn.config.GDNConfig`
    (default: the shipped one)."""
    from gdn.config import DEFAULT
    from gdn.op import gdn_attention
    names = [n for n in ("q", "k", "v", "g", "beta", "h0") if x.get(n) is not None]
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in names}
    with torch.enable_grad():
        o, ht = gdn_attention(leaves["q"], leaves["k"], leaves["v"], leaves.get("g"), leaves.get("beta"),
                              initial_state=leaves.get("h0"), output_final_state=True,
                              cu_seqlens=cu, delta=delta, save_states=save_states, config=config or DEFAULT)
        grads = torch.autograd.grad((o, ht), [leaves[n] for n in names], (x["do"], x["dht"]),
                                    allow_unused=True)
    got = dict(zip(names, grads))
    return [o, ht] + [got.get(n) for n in ("q", "k", "v", "g", "beta", "h0")]


OUTPUT_NAMES = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().cpu()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def differences(a: list, b: list) -> list[str]:
    """What differs bit for bit between two `op_outputs` results, one line per output."""
    out = []
    for name, x, y in zip(OUTPUT_NAMES, a, b):
        if (x is None) != (y is None):
            out.append(f"{name}: None in one result only")
        elif x is not None and not torch.equal(bits(x), bits(y)):
            idx = (bits(x) != bits(y)).reshape(-1).nonzero()[:, 0]
            i = int(idx[0])
            out.append(f"{name}: {len(idx)} element(s) differ, first at flat index {i}: "
                       f"{float(x.detach().reshape(-1)[i])} against {float(y.detach().reshape(-1)[i])}")
    return out


def _case_inputs(case_json: str, device: str):
    from kfuzz import target as targets
    from kfuzz.case import SCHEMA, Case
    from kfuzz.tensors import materialize
    case = Case.from_json({"args": {}, "payload": None, "kfuzz": SCHEMA, **json.loads(case_json)})
    targets.prepare_triton()
    if case.target not in targets.load_targets():
        import harnesses.gdn  # noqa: F401  (registers the GDN targets where kfuzz is not installed)
    target = targets.get_target(case.target)
    return case, target, materialize(case, target, device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", required=True, help="a gdn_bwd* case as JSON (target, dtype, seed, dims, args)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--fills", default="asis,nanpool,zero,nan,huge")
    ap.add_argument("--sites", action="store_true", help="then poison (nan) one allocation site at a time")
    ap.add_argument("--before", default=None,
                    help="a case (JSON) whose kernel runs before every run: what a campaign's process ran "
                         "earlier (its NaN left in freed memory, in shared memory, in caches)")
    a = ap.parse_args(argv)
    from kfuzz.execute import oracle_outputs
    case, target, inputs = _case_inputs(a.case, a.device)
    if not case.target.startswith("gdn_bwd"):
        ap.error(f"--case: a gdn_bwd* case is needed; got target {case.target!r}")
    oracle = {k: v.cpu() for k, v in oracle_outputs(target, inputs, "cpu").items()}
    before = _case_inputs(a.before, a.device) if a.before else None

    def once(fill, site=None):
        if before is not None:
            before[1].kernel(**before[2])
        if fill == "nanpool":
            nan_pool(a.device)
        with fills("asis" if fill == "nanpool" else fill, site) as seen:
            out = target.kernel(**inputs)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        return dict(zip(oracle, out)), seen

    def bad_outputs(out):
        return [n for n, t in out.items()
                if bool((~torch.isfinite(t.float().cpu()) & torch.isfinite(oracle[n].float())).any())]

    changed = False
    reference, sites = None, set()
    for fill in a.fills.split(","):
        bad_runs, first, diff_runs = 0, None, 0
        for _ in range(a.runs):
            try:
                out, seen = once(fill)
            except Exception:  # noqa: BLE001 - a fault is a finding; show it
                traceback.print_exc()
                print(f"{fill}: RAISED")
                return 1
            sites |= seen
            if fill == "zero" and reference is None:
                reference = out
            bad = bad_outputs(out)
            bad_runs += bool(bad)
            first = first or bad
            if reference is not None and differences(list(reference.values()), list(out.values())):
                diff_runs += 1
        changed |= bad_runs > 0 or diff_runs > 0
        print(f"{fill}: {bad_runs}/{a.runs} runs non-finite where the oracle is finite {first or ''}; "
              f"{diff_runs if reference is not None else 'n/a'} differ from the zero fill's bits", flush=True)
    if a.sites:
        for site in sorted(sites):
            out, _ = once("nan", site)
            bad = bad_outputs(out)
            d = differences(list(reference.values()), list(out.values())) if reference else []
            print(f"site {site}: {'non-finite ' + str(bad) if bad else 'finite'}; {d[:2] if d else 'same bits'}",
                  flush=True)
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
