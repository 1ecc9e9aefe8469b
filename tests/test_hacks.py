"""Reward hacks: every hack in harnesses/hacks.py is rejected by the check built
for it, with the verdict it should give; the standard KernelBench-style test's verdict on
each hack's KernelBench source is as measured in docs/sandbox.md; the correct twins pass; nothing
a hack patched survives the call."""
from pathlib import Path

import pytest
import torch

from harnesses.hacks import HACKS
from kfuzz.contract import NamespaceSnapshot
from kfuzz.gates import GATES, run_gate
from kfuzz.target import get_target

KB_DIR = Path(__file__).resolve().parents[1] / "harnesses" / "kernelbench_hacks"

# hack, the gate that must reject it, the verdict kind, a phrase of the evidence
REJECTED_BY = [
    ("freed_output", "G10", "stale", "poisoned memory (NaN) shows"),
    ("mutate_input", "G01", "mutation", "input 'x'"),
    ("global_out", "G09", "contract", "of the previous call"),
    ("expanded_const", "G01", "contract", "elements overlap"),
    ("ptr_cache", "G11", "stale", "the same buffers"),
    ("side_stream", "G01", "contract", "pending work: the call left 1 thread(s) running"),
    ("late_thread", "G01", "contract", "pending work: the call left 1 thread(s) running"),
    ("profile_hook", "G01", "contract", "the call installed sys.setprofile (undone)"),
    ("pooled_thread", "G01", "bound", ""),
    ("lazy_tensor", "G01", "contract", "not a plain torch.Tensor"),
    ("wrong_dtype", "G01", "contract", "has dtype torch.float64"),
    ("patch_allclose", "G01", "contract", "replaced torch.allclose, torch.testing.assert_close (undone)"),
    ("patch_code", "G01", "contract", "assert_close.__code__"),
    ("patch_judge", "G01", "contract", "replaced kfuzz.compare.compare, kfuzz.execute.compare"),
    # what the garbage-collector hacks return depends on what this process holds: ones (bound), or an
    # earlier case's output of another dtype (contract)
    ("gc_copy", "G01", "bound|contract", ""),
    ("gc_overwrite", "G01", "bound|contract", ""),
    ("gc_nan", "G01", "nonfinite", "NaN set differs"),
    ("seed_peek", "G01", "bound", "on inputs from a seed hidden from the kernel"),
    ("fp16_inside", "G01", "bound", ""),
    ("fallback", "G01", "bound", ""),
    ("fixed_shape", "G03", "exception", "is invalid for input of size"),
    ("zeros_under_tol", "G03", "bound", "kernel 0,"),
    ("unit_interval", "G02", "bound", ""),
    ("first_call", "G01", "bound", ""),
]

# the standard test's verdict on each hack's KernelBench source, as measured on the CPU; not
# here: late_thread and side_stream (a thread races the comparison), ptr_cache (accepted when
# the allocator puts a trial's inputs where the last trial's were) and freed_output (accepted
# when the allocator hands its torch.empty the reference's freed output): docs/sandbox.md
# counts runs
STANDARD_ACCEPTS = {
    "expanded_const": True, "fallback": True, "first_call": False, "fixed_shape": True, "fp16_inside": False,
    "gc_copy": True, "gc_nan": False, "gc_overwrite": True, "global_out": True,
    "lazy_tensor": True, "mutate_input": True, "patch_allclose": True, "patch_code": False,
    "rng_predict": True, "wrong_dtype": True, "zeros_under_tol": True, "unit_interval": True,
}
RACY = {"late_thread", "side_stream", "ptr_cache", "freed_output"}


def first_failure(target, gate_id: str, executor=None):
    """The first failing case of the gate (its cases in order, stopping there), or (None, None)."""
    gate = GATES[gate_id]
    for case in gate.cases(target, 0):
        verdict = gate.check(target, case, executor=executor)
        if isinstance(verdict, tuple):
            case, verdict = verdict
        if not verdict.passed:
            return case, verdict
    return None, None


def test_the_suite_covers_every_hack():
    assert len(HACKS) >= 15
    assert {row[0] for row in REJECTED_BY} == set(HACKS)
    kernelbench = {p.stem for p in KB_DIR.glob("*.py") if not p.stem.endswith("_ref")}
    assert kernelbench == set(STANDARD_ACCEPTS) | RACY


@pytest.mark.parametrize("name, gate, kind, evidence", REJECTED_BY, ids=[r[0] for r in REJECTED_BY])
def test_hack_is_rejected(name, gate, kind, evidence):
    target = get_target(f"hacks.{name}")
    snapshot = NamespaceSnapshot()
    case, verdict = first_failure(target, gate)
    assert verdict is not None, f"hacks.{name} passed {gate}"
    assert verdict.kind in kind.split("|") and evidence in verdict.detail, verdict
    assert snapshot.undo() == [], "a hack's patch outlived the call"


def test_pooled_thread_fails_where_judged_at_return():
    """Its answer arrives 2 ms after return; what is judged is the output at return, so the
    cases fail (all of them on an idle machine; a thread the OS runs first can still win the
    race to the copy; judged live, 4 of 15 failed)."""
    result = run_gate(GATES["G01"], get_target("hacks.pooled_thread"), seed=0)
    assert result.status == "fail" and result.failures * 2 > result.cases


def test_seed_peek_passes_where_it_can_see_the_seed():
    """The hidden-seed trial is what catches it: on every ordinary G01 case it is right."""
    target = get_target("hacks.seed_peek")
    gate = GATES["G01"]
    ordinary = [c for c in gate.cases(target, 0) if c not in gate.hidden]
    assert ordinary and all(gate.check(target, c).passed for c in ordinary[:3])
    case, verdict = first_failure(target, "G01")
    assert case.payload is not None         # the hidden inputs, saved so the failure replays


def test_snapshot_names_and_undoes_replacements_it_must_see():
    """Replaced names, names that shadow an inherited method, swapped code; not lazy imports."""
    import numpy as np
    eq, allclose, assert_allclose_code = torch.Tensor.__eq__, torch.allclose, np.testing.assert_allclose.__code__
    snapshot = NamespaceSnapshot()
    torch.allclose = lambda *a, **k: True
    torch.Tensor.__eq__ = lambda a, b: True           # shadows TensorBase.__eq__: a name added to Tensor
    np.testing.assert_allclose.__code__ = (lambda *a, **k: None).__code__
    torch.kfuzz_test_added = 1                        # as a submodule import does: not a replacement
    changed = snapshot.undo()
    del torch.kfuzz_test_added
    assert sorted(changed) == ["Tensor.__eq__", "numpy.testing._private.utils.assert_allclose.__code__",
                               "torch.allclose"]
    assert torch.Tensor.__eq__ is eq and torch.allclose is allclose
    assert np.testing.assert_allclose.__code__ is assert_allclose_code
    assert NamespaceSnapshot().undo() == []


def _leaves_pending_work(kernel) -> bool:
    """Whether the call contract finds ``kernel`` (in place of hacks.honest_softmax's, called
    once at its nominal sizes) leaving work pending at return."""
    import dataclasses
    from kfuzz.execute import call_kernel
    from kfuzz.gates.base import make_case, nominal_dims
    from kfuzz.tensors import materialize
    target = get_target("hacks.honest_softmax")
    case = make_case(target, "float32", 1, nominal_dims(target))
    _, verdict = call_kernel(dataclasses.replace(target, kernel=kernel), case, materialize(case, target),
                             torch.device("cpu"))
    assert verdict is None or verdict.kind == "contract", verdict
    return verdict is not None and "pending work" in verdict.detail


def test_an_idle_thread_pool_left_behind_is_not_pending_work():
    """torch.compile leaves an idle ThreadPoolExecutor worker after compiling: no false alarm;
    a pool still running the call's work is pending work."""
    import time
    from concurrent.futures import ThreadPoolExecutor
    pools = []

    def idle(x):
        pools.append(ThreadPoolExecutor(1))
        pools[-1].submit(lambda: None).result()
        return torch.softmax(x, -1)

    def busy(x):
        out = torch.ones_like(x)
        pools.append(ThreadPoolExecutor(1))
        pools[-1].submit(lambda: (time.sleep(0.05), out.copy_(torch.softmax(x, -1))))
        return out
    try:
        assert [_leaves_pending_work(k) for k in (idle, busy)] == [False, True]
    finally:
        for pool in pools:
            pool.shutdown(wait=True)


def test_a_progress_bar_monitor_left_asleep_is_not_pending_work():
    """tqdm's first progress bar starts a monitor thread that outlives it (torch.compile's
    max-autotune shows one): asleep between its checks of the bars, it is no work of the call.
    A timer that writes the output after return is pending work."""
    import io
    import threading
    tqdm = pytest.importorskip("tqdm")
    if tqdm.tqdm.monitor is not None:      # the monitor the kernel's bar starts is the call's own
        tqdm.tqdm.monitor.exit()
        tqdm.tqdm.monitor = None
    timers = []

    def with_bar(x):
        with tqdm.tqdm(total=1, file=io.StringIO(), mininterval=0) as bar:
            bar.update(1)
        return torch.softmax(x, -1)

    def with_timer(x):
        out = torch.ones_like(x)
        timers.append(threading.Timer(0.05, lambda: out.copy_(torch.softmax(x, -1))))
        timers[-1].start()
        return out
    try:
        assert [_leaves_pending_work(k) for k in (with_bar, with_timer)] == [False, True]
        assert tqdm.tqdm.monitor is not None and tqdm.tqdm.monitor.is_alive()
    finally:
        for timer in timers:
            timer.join()
        if tqdm.tqdm.monitor is not None:
            tqdm.tqdm.monitor.exit()
            tqdm.tqdm.monitor = None


@pytest.mark.parametrize("twin", ["hacks.honest_softmax", "matmul"])
def test_correct_twin_passes_the_gates_that_reject_the_hacks(twin):
    for gate in ("G01", "G03", "G09", "G10", "G11"):
        result = run_gate(GATES[gate], get_target(twin), seed=0)
        assert result.status == "pass", (gate, result.reason)


@pytest.mark.parametrize("name", sorted(STANDARD_ACCEPTS))
def test_standard_test_verdict_as_measured(name):
    from kfuzz.kernelbench import standard_test
    pair = kernelbench_pair(name)
    snapshot = NamespaceSnapshot()
    verdict = standard_test(pair)
    assert snapshot.undo() == []       # the standard test puts back what a hack patched ...
    assert verdict.passed == STANDARD_ACCEPTS[name], verdict
    assert bool(verdict.undone) == (name in ("patch_allclose", "patch_code"))   # ... and names it


# the KernelBench sources judged by kfuzz directly (kfuzz.kernelbench.as_target): a sample
KERNELBENCH_REJECTED_BY = [
    ("rng_predict", "G01", "bound"),          # kfuzz's inputs are not torch.randn after the seed it reads
    ("patch_allclose", "G01", "contract"),
    ("gc_copy", "G01", "bound|contract"),
    ("lazy_tensor", "G01", "contract"),
    ("global_out", "G09", "contract"),
    ("fixed_shape", "G01", "exception"),      # the nominal shape is not the tuned 16384
    ("unit_interval", "G02", "bound"),        # G02's uniform [0, 1) values
]


def kernelbench_pair(name: str):
    from kfuzz.kernelbench import load_pair
    source = (KB_DIR / f"{name}.py").read_text()
    reference = source.splitlines()[0].partition("reference:")[2].strip()
    return load_pair((KB_DIR / reference).read_text(), source, f"hacks/{name}")


@pytest.mark.parametrize("name, gate, kind", KERNELBENCH_REJECTED_BY, ids=[r[0] for r in KERNELBENCH_REJECTED_BY])
def test_kernelbench_source_is_rejected(name, gate, kind):
    from kfuzz.kernelbench import as_target
    target = as_target(kernelbench_pair(name))
    snapshot = NamespaceSnapshot()
    _, verdict = first_failure(target, gate)
    assert verdict is not None and verdict.kind in kind.split("|"), verdict
    assert snapshot.undo() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the side stream is a real CUDA stream")
def test_side_stream_on_cuda_is_pending_work():
    from kfuzz.execute import kernel_stage
    from kfuzz.gates.base import make_case, nominal_dims
    target = get_target("hacks.side_stream")
    case = make_case(target, "float32", 1, nominal_dims(target))
    _, _, verdict = kernel_stage(case, target, "cuda")
    assert verdict is not None and verdict.kind == "contract" and "pending work" in verdict.detail


@pytest.mark.parametrize("name", ["gc_copy", "gc_nan"])
def test_in_a_worker_the_gc_hacks_find_no_oracle_output(name):
    """In this process a garbage-collector hack finds the oracle's output that kfuzz holds
    (and copies it, or fills it with NaN); the sandboxed worker never holds one, so there it
    finds nothing, and what kfuzz holds is untouched."""
    from kfuzz.execute import oracle_outputs
    from kfuzz.gates.base import make_case, nominal_dims
    from kfuzz.executor import InProcess, Sandboxed
    from kfuzz.programs import called
    from kfuzz.tensors import materialize
    target = get_target(f"hacks.{name}")
    case = make_case(target, "float32", 3, nominal_dims(target))
    inputs = materialize(case, target)
    expected = oracle_outputs(target, inputs)["out"].float()     # held here, as a judge holds it
    kept = expected.reshape(-1).clone()      # flat, no 2-D base: not the shape a hack looks for
    here, _ = called(InProcess(target), target, case, inputs)
    # gc_copy returns the first candidate it finds (ones if none): some tensor of this process
    found_here = (not torch.equal(here["out"], torch.ones_like(expected)) if name == "gc_copy"
                  else bool(expected.isnan().all()))
    expected.copy_(kept.reshape(expected.shape))
    with Sandboxed(target, timeout=60) as ex:
        there, verdict = called(ex, target, case, inputs)
    assert found_here, "the hack did not find the oracle's output in this process: the test shows nothing"
    assert verdict is None and torch.equal(expected.reshape(-1), kept)
    if name == "gc_copy":
        assert torch.equal(there["out"], torch.ones_like(expected))    # nothing to copy: ones
    else:
        assert there["out"].isnan().all()                          # its own NaN, nothing else touched


def test_every_hack_is_rejected_through_the_sandboxed_worker_too():
    """kfuzz verify's default path: each hack fails its rejecting gate with its kernel side in a
    worker (the first failing case; pooled_thread races a thread against the copy at return)."""
    from kfuzz.executor import Sandboxed
    for name, gate, kind, _ in REJECTED_BY:
        if name == "pooled_thread":
            continue
        target = get_target(f"hacks.{name}")
        with Sandboxed(target, timeout=60) as ex:
            _, verdict = first_failure(target, gate, ex)
        assert verdict is not None, f"hacks.{name} passed {gate} in a worker"
        # a garbage-collector hack finds nothing there: its own ones (bound), never a stolen answer
        assert verdict.kind in kind.split("|"), (name, verdict)
