"""The standard test: the check that accepted the corpora's KernelBench kernels.

As KernelBench's and CUDA-L1's harnesses run it: ``get_init_inputs()``,
``Model`` and ``ModelNew`` each built after ``set_seed(42)`` (same seed, no
weight copy), 5 trial seeds drawn from it, fresh ``get_inputs()`` per trial at
the fixed shape, reference then solution under ``no_grad``, a shape check,
``torch.allclose(atol=1e-2, rtol=1e-2)``; both models in one process, in the
mode the accepting harness used (``KernelBenchPair.eval_mode``). The verdict
is that harness's, including being fooled by a solution that patches
``torch.allclose``; what such a solution replaced is put back afterwards
(``StandardVerdict.undone``), so kfuzz's later judgement in the same process
is not fooled too; so are torch's precision flags (TF32, cuDNN) that it set. The reported max
abs diff is NaN when an output holds NaN.

It runs the untrusted solution in this process: callers run it in a sandbox.
It refuses nothing: a solution that does not build, construct or run gets a
failing verdict naming why (compile, init, runtime, shape, mismatch).
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from kfuzz.compare import largest
from kfuzz.contract import NamespaceSnapshot, current_hooks, restore_hooks
from kfuzz.kernelbench.source import SEED, KernelBenchPair, outputs_of, pair_module, precision, set_seed

ATOL = RTOL = 1e-2
TRIALS = 5


@dataclass(frozen=True)
class StandardVerdict:
    """The standard test's verdict: ``reason`` is ``pass`` or compile, init, runtime, shape,
    mismatch, with the detail after a colon."""

    passed: bool
    reason: str
    max_abs_diff: float | None = None    # NaN where an output holds NaN (allclose then fails)
    trials: int = 0
    seconds: float = 0.0
    undone: tuple[str, ...] = ()         # what the solution replaced in torch & co., restored after

    def to_json(self) -> dict:
        diff = self.max_abs_diff
        if diff is not None and not math.isfinite(diff):
            diff = str(diff)              # "nan", "inf": a bare NaN token is not JSON
        return {"passed": self.passed, "reason": self.reason[:500], "max_abs_diff": diff,
                "trials": self.trials, "seconds": round(self.seconds, 3), "undone": list(self.undone)}


def _max_abs_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest elementwise |got - expected|: NaN where either holds a NaN (``allclose``
    without ``equal_nan`` fails there too; Python's ``max`` would keep an earlier number over
    a NaN, so the caller folds with ``_worse``); equal infinities differ by 0, as ``allclose``
    sees them. In float64 a chunk at a time (``compare.largest``): kfuzz's own measurement holds
    no float64 copy of a whole output (a 6 GiB float32 output would need 36 GiB more), so only
    the solution and the reference decide whether a test fits the GPU."""
    return largest(got, expected, lambda a, b: torch.where(a == b, 0.0, (a - b).abs()))


def _worse(a: float, b: float) -> float:
    return b if math.isnan(b) or b > a else a


def standard_test(pair: KernelBenchPair, device: str = "cpu", trials: int = TRIALS, atol: float = ATOL,
                  rtol: float = RTOL, seed: int = SEED) -> StandardVerdict:
    """The check that accepted the corpora's kernels, run in this process (untrusted code!).
    Its verdict is the original harness's, fooled as it would be by a solution that patches
    ``torch.allclose``; what the solution replaced in the watched namespaces (and any trace,
    profile or signal hook it left) is put back before returning, so later judgements in this
    process see the real torch, and ``undone`` names it, with the precision flags it changed (TF32,
    cuDNN: ``source.PRECISION``), put back as ``name=value``."""
    namespaces, hooks, flags = NamespaceSnapshot(), current_hooks(), set()
    try:
        with precision(None, flags):     # the harness ran with the flags as they were
            verdict = _standard_test(pair, device, trials, atol, rtol, seed)
    finally:
        undone = tuple(namespaces.undo() + restore_hooks(hooks) + sorted(flags))
    return dataclasses.replace(verdict, undone=undone)


def _standard_test(pair: KernelBenchPair, device: str, trials: int, atol: float, rtol: float,
                   seed: int) -> StandardVerdict:
    start = time.monotonic()

    def verdict(passed, reason, diff=None, n=0):
        return StandardVerdict(passed, reason, diff, n, time.monotonic() - start)
    try:
        ref, new = pair_module(pair, "ref"), pair_module(pair, "new")
    except Exception as e:
        return verdict(False, f"compile: {type(e).__name__}: {e}")
    try:
        with torch.no_grad():
            set_seed(seed)
            init = ref.get_init_inputs()
            set_seed(seed)
            model = ref.Model(*init).to(device).train(not pair.eval_mode)
            set_seed(seed)
            model_new = new.ModelNew(*init).to(device).train(not pair.eval_mode)
            set_seed(seed)
            trial_seeds = [int(torch.randint(0, 2**32 - 1, (1,)).item()) for _ in range(trials)]
    except Exception as e:
        return verdict(False, f"init: {type(e).__name__}: {e}")
    worst = 0.0
    for n, trial_seed in enumerate(trial_seeds):
        with torch.no_grad():
            set_seed(trial_seed)
            inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in ref.get_inputs()]
            set_seed(trial_seed)
            expected = outputs_of(model(*inputs))
            try:
                set_seed(trial_seed)
                got = outputs_of(model_new(*inputs))
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
            except Exception as e:
                return verdict(False, f"runtime: {type(e).__name__}: {e}", None, n + 1)
        if len(got) != len(expected) or any(
                not isinstance(g, torch.Tensor) or g.shape != e.shape for g, e in zip(got, expected)):
            return verdict(False, "shape: the outputs' shapes differ from the reference's", None, n + 1)
        for g, e in zip(got, expected):
            worst = _worse(worst, _max_abs_diff(g, e))
            # the verdict is exactly the original harness's: torch.allclose as it is bound now
            if not torch.allclose(g, e.to(g.device, g.dtype), atol=atol, rtol=rtol):
                return verdict(False, f"mismatch: max abs diff {worst:.3g} in trial {n + 1}", worst, n + 1)
    return verdict(True, "pass", worst, len(trial_seeds))
