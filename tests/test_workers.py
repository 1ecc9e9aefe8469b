"""Sandboxed workers: a segfault and a hang become verdicts with their cases saved, the
campaign goes on, and a worker's result is judged exactly as an in-process execution."""
import os
import signal
import time

import pytest

from kfuzz.campaign import run_campaign
from kfuzz.case import ArgCase, Case, Layout
from kfuzz.corpus import Corpus, iter_case_files, load
from kfuzz.execute import execute, judge
from kfuzz.errors import WorkerStartError
from kfuzz.executor import InProcess, Pool
from kfuzz.programs import settled
from kfuzz.target import get_target
from kfuzz.tensors import materialize

CRASHHANG = "searchsum.crashhang"
SEGFAULT = Case.make(CRASHHANG, "float32", 1, {"N": 2, "D": 8}, {"x": ArgCase(inject=((3, "nan"),))})
HANG = Case.make(CRASHHANG, "float16", 1, {"N": 2, "D": 128})
FINE = Case.make(CRASHHANG, "float32", 1, {"N": 3, "D": 40})


class ListEngine:
    """Proposes the given cases in turn, forever."""

    name = "list"

    def __init__(self, cases):
        self.cases, self.i = cases, 0

    def next_case(self):
        self.i += 1
        return self.cases[(self.i - 1) % len(self.cases)]

    def feedback(self, case, verdict):
        return None


def _drain(pool):
    out = []
    while pool.busy:
        out.extend(pool.results())
    return out


def _outputs(r, target):
    """The kernel's outputs in a ``call`` program's result (None when a verdict ended it)."""
    return settled(r, target, r.case, r.inputs)[0]


def test_segfault_and_hang_become_verdicts_and_the_pool_recovers():
    pool = Pool(get_target(CRASHHANG), jobs=1, timeout=3.0)
    try:
        got = {}
        for case in (SEGFAULT, HANG, FINE):
            pool.submit(case)
            (result,) = _drain(pool)
            got[case] = result
        assert got[SEGFAULT].verdict.kind == "crash" and got[SEGFAULT].verdict.exc_type == "SIGSEGV"
        assert got[HANG].verdict.kind == "timeout" and got[HANG].seconds >= 3.0
        assert got[FINE].verdict is None and _outputs(got[FINE], pool.target)["out"].shape == (3,)
        assert pool.restarts == 2
    finally:
        pool.close()


@pytest.mark.parametrize("case", [
    Case.make("searchsum.tailinf", "float32", 5, {"N": 3, "D": 33}, {"x": ArgCase(inject=((32, "inf"),))}),
    Case.make("searchsum.transbf16", "bfloat16", 5, {"N": 4, "D": 9}, {"x": ArgCase(Layout("permuted", perm=(1, 0)))}),
    Case.make("searchsum", "bfloat16", 5, {"N": 4, "D": 9}, {"x": ArgCase(Layout("permuted", perm=(1, 0)))}),
])
def test_a_workers_result_is_judged_as_in_process(case):
    target = get_target(case.target)
    pool = Pool(target, jobs=1, timeout=60.0)
    try:
        pool.submit(case)
        (result,) = _drain(pool)
    finally:
        pool.close()
    outputs, verdict = settled(result, target, case, result.inputs)
    verdict = verdict or judge(case, target, materialize(case, target), outputs)
    assert verdict.signature == execute(case, target).signature
    assert verdict.passed == (case.target == "searchsum")


def test_campaign_saves_crash_and_timeout_and_runs_to_its_limit(tmp_path):
    target = get_target(CRASHHANG)
    engine = ListEngine([FINE, SEGFAULT, FINE, HANG, FINE])
    stats = run_campaign(target, engine, Corpus(tmp_path), runs=8, jobs=2, timeout=3.0, minimize_seconds=0)
    assert stats.executions == 8
    slugs = {s.slug: n for s, n in stats.failures.items()}
    assert slugs == {"crash-SIGSEGV": 2, "timeout": 1}
    saved = {load(p)[0]: load(p)[1]["verdict"]["kind"] for p in iter_case_files([tmp_path / "crashes"])}
    assert saved == {SEGFAULT: "crash", HANG: "timeout"}
    assert stats.to_json()["failures"]["searchsum.crashhang/timeout"]["first_execution"] >= 1


def test_in_process_runner_matches_execute():
    target = get_target("searchsum.tailinf")
    case = Case.make(target.name, "float32", 5, {"N": 3, "D": 33}, {"x": ArgCase(inject=((32, "inf"),))})
    runner = InProcess(target, coverage=True)
    runner.submit(case)
    (result,) = list(runner.results())
    verdict = judge(case, target, result.inputs, _outputs(result, target))
    assert verdict.signature == execute(case, target).signature and verdict.kind == "nonfinite"
    assert result.coverage   # the harness's own lines were traced


def test_cli_run_reports_crash_and_timeout_and_writes_stats(tmp_path):
    """The random engine's seed 10 proposes two NaN inputs (1st, 10th case) and a hang (4th)."""
    import json

    from click.testing import CliRunner

    from kfuzz.cli import cli
    from kfuzz.cli import run as _run  # noqa: F401  (registers the verb)
    stats_json = tmp_path / "stats.json"
    r = CliRunner().invoke(cli, ["run", "--target", CRASHHANG, "--runs", "12", "--seed", "10", "--jobs", "1",
                                 "--device", "cpu", "--timeout", "2", "--root", str(tmp_path), "--stats-json", str(stats_json),
                                 "--minimize-time", "0"])
    assert r.exit_code == 1, r.output
    stats = json.loads(stats_json.read_text())
    assert stats["executions"] == 12 and stats["jobs"] == 1 and stats["worker_restarts"] >= 2
    assert {k: v["count"] for k, v in stats["failures"].items()} == {
        "searchsum.crashhang/timeout": 1, "searchsum.crashhang/crash-SIGSEGV": 2}
    assert stats["failures"]["searchsum.crashhang/timeout"]["first_execution"] < 12
    assert len(stats["saved"]) == 2 and "crash-SIGSEGV" in r.output


def test_a_crash_in_the_pipeline_belongs_to_the_case_in_flight():
    """Two cases queued at once: the segfault is the first one's, the second still runs."""
    pool = Pool(get_target(CRASHHANG), jobs=1, timeout=30.0)
    try:
        pool.submit(SEGFAULT)
        pool.submit(FINE)
        got = {r.case: r for r in _drain(pool)}
    finally:
        pool.close()
    assert got[SEGFAULT].verdict.exc_type == "SIGSEGV" and got[SEGFAULT].inputs is not None
    assert got[FINE].verdict is None and _outputs(got[FINE], get_target(CRASHHANG))["out"].shape == (3,)


def test_a_worker_that_dies_in_its_next_case_leaves_the_answered_one_judged():
    """The worker answers one case, begins the one queued behind it and dies there before kfuzz
    reads the answer: its violation channel closed with the process, which is the next case's
    crash, not a violation of the case that answered."""
    pool = Pool(get_target(CRASHHANG), jobs=1, timeout=30.0)
    try:
        pool.submit(FINE)
        pool.submit(SEGFAULT)
        (w,) = pool.workers
        w.process.join(30)    # both cases ran before kfuzz reads anything
        assert w.process.exitcode is not None
        got = {r.case: r for r in _drain(pool)}
    finally:
        pool.close()
    assert got[FINE].verdict is None and _outputs(got[FINE], get_target(CRASHHANG))["out"].shape == (3,)
    assert got[SEGFAULT].verdict.exc_type == "SIGSEGV"


def test_large_inputs_and_outputs_do_not_deadlock_the_pipe():
    """256 KiB each way, two cases in flight: more than a pipe holds, so kfuzz must not block
    sending while the worker blocks sending its reply."""
    target = get_target("cumsum")
    cases = [Case.make("cumsum", "float32", seed, {"N": 64, "D": 1024}) for seed in range(4)]
    pool = Pool(target, jobs=1, timeout=60.0)
    old = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("deadlocked on a full pipe"))
    signal.alarm(120)
    try:
        for case in cases:
            pool.submit(case)
        results = _drain(pool)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        pool.close()
    assert [r.case for r in results] == cases
    for r in results:
        assert judge(r.case, target, r.inputs, _outputs(r, target)).passed


@pytest.mark.parametrize("layout", [Layout(), Layout("permuted", perm=(1, 0)), Layout("strided", step=(2, 3)),
                                    Layout("offset", offset=5), Layout("expanded", dims=(0,))])
def test_inputs_cross_the_pipe_bit_for_bit_with_their_layout(layout):
    """What the worker rebuilds is the storage kfuzz materialized: values, NaN fillers of
    strided views, offsets, strides."""
    import torch

    from kfuzz.wire import geometry, pack, rebuild, unpack
    target = get_target("searchsum")
    case = Case.make("searchsum", "bfloat16", 7, {"N": 5, "D": 9}, {"x": ArgCase(layout, inject=((4, "nan"),))})
    x = materialize(case, target)["x"]
    (_, geo), (storage,) = unpack(pack(("case", geometry(x)), [x]))
    y = rebuild(storage, geo)
    assert (y.shape, y.stride(), y.storage_offset(), y.dtype) == (x.shape, x.stride(), x.storage_offset(), x.dtype)
    raw = lambda t: torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())  # noqa: E731
    assert torch.equal(raw(x), raw(y))


def test_a_jit_compile_longer_than_the_timeout_is_not_a_hang():
    """The first call compiles for SLOW_JIT = 2 s (announced as kfuzz.jit notes), over the
    1 s timeout: the clock stops while it compiles, so the case passes."""
    pool = Pool(get_target("searchsum.slowjit"), jobs=1, timeout=1.0)
    try:
        pool.submit(Case.make("searchsum.slowjit", "float32", 1, {"N": 3, "D": 40}))
        (result,) = _drain(pool)
        assert result.verdict is None and result.seconds >= 2.0
    finally:
        pool.close()


def test_tritons_compile_hook_names_the_kernel_and_its_jit_key():
    """The hook kfuzz installs in Triton's knobs is called as Triton's JIT calls it (keyword
    arguments, the kernel as a JitFunctionInfo) and labels the begin note: name#hash of the key."""
    pytest.importorskip("triton")
    from triton import knobs
    from triton.runtime.jit import JitFunctionInfo

    from kfuzz import jit
    sent = []
    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    previous = jit.listen(sent.append)
    try:
        for key in ("k1", "k1", "k2"):
            skip = knobs.runtime.jit_cache_hook(key=key, repr="chunk_fwd[...]",
                                                fn=JitFunctionInfo(None, "chunk_fwd", None),
                                                compile={}, is_manual_warmup=False, already_compiled=False)
            assert skip is False            # Triton compiles as usual
            knobs.runtime.jit_post_compile_hook(key=key, repr="", fn=None, compile={}, is_manual_warmup=False,
                                                already_compiled=False)
    finally:
        jit.listen(previous)
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved
    credit = jit.Credit()
    assert all(credit.take(m, 0.0) for m in sent) and sent[1] == jit.END
    assert credit.compiled[0] == credit.compiled[1] == jit.label("chunk_fwd", "k1") != credit.compiled[2]
    assert credit.compiled[2].startswith("chunk_fwd#")


def test_a_compile_that_never_ends_is_a_hang_past_the_allowance():
    pool = Pool(get_target("searchsum.slowjit"), jobs=1, timeout=1.0, compile_allowance=1.5)
    try:
        pool.submit(Case.make("searchsum.slowjit", "float16", 1, {"N": 2, "D": 128}))
        (result,) = _drain(pool)
        assert result.verdict.kind == "timeout" and 2.5 <= result.seconds < 10
    finally:
        pool.close()


def test_a_timed_campaign_ends_within_seconds_of_its_limit_even_while_compiling(tmp_path):
    """A case whose compile never ends holds the kernel's clock for up to the allowance
    (600 s) and the --timeout is a minute; the campaign still ends within 5 s of --time,
    and the case in flight is dropped and counted, not judged or saved."""
    forever = Case.make("searchsum.slowjit", "float16", 1, {"N": 2, "D": 128})
    start = time.monotonic()
    stats = run_campaign(get_target("searchsum.slowjit"), ListEngine([forever]), Corpus(tmp_path),
                         seconds=12.0, jobs=1, timeout=60.0)
    assert time.monotonic() - start < 12.0 + 5.0
    assert stats.unfinished >= 1 and stats.executions == 0 and not stats.failures
    assert not (tmp_path / "crashes").exists()


def test_a_terminated_campaign_still_writes_its_summary(tmp_path):
    """SIGTERM (a machine's end, a scheduler) stops `kfuzz run` as Ctrl-C does: the cases in
    flight are dropped, the summary and --stats-json are written, and the exit code is 130."""
    pytest.importorskip("atheris", reason="the coverage engine needs atheris (the dev extra)")
    import json
    import subprocess
    import sys
    stats_json = tmp_path / "stats.json"
    p = subprocess.Popen([sys.executable, "-c", "from kfuzz.cli import main; main()", "run", "--target",
                          "softmax", "--engine", "atheris", "--time", "300", "--jobs", "1", "--root", str(tmp_path),
                          "--stats-json", str(stats_json)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any((tmp_path / "seeds").rglob("*.zst")) and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.5)   # running: the coverage engine has kept a case
        time.sleep(1.0)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, out
    stats = json.loads(stats_json.read_text())
    assert stats["interrupted"] is True and stats["executions"] > 0 and not stats["failures"]
    assert "interrupted" in out


def test_a_helper_process_still_starting_leaves_ctrl_c_to_kfuzz():
    """A Ctrl-C reaches the whole process group, also a helper (a judge, a fuzzer, the zygote)
    whose interpreter is still starting, before it could ignore SIGINT itself: started inside
    ``launcher.helpers_ignore_ctrl_c`` it begins with SIGINT ignored and runs to its end; this
    process's own handler is back after the block."""
    import multiprocessing
    from kfuzz.launcher import helpers_ignore_ctrl_c
    ctx = multiprocessing.get_context("spawn")
    before = signal.getsignal(signal.SIGINT)
    with helpers_ignore_ctrl_c():
        p = ctx.Process(target=time.sleep, args=(1.0,))
        p.start()
    assert signal.getsignal(signal.SIGINT) is before
    os.kill(p.pid, signal.SIGINT)       # while it imports: a KeyboardInterrupt or a SIGINT death without
    p.join(60)
    assert p.exitcode == 0, p.exitcode


def test_ctrl_c_ends_the_campaign_and_its_workers_and_judges_without_a_traceback(tmp_path):
    """A terminal's Ctrl-C sends SIGINT to the whole process group: kfuzz's process stops as on
    SIGTERM (summary, exit 130), and its zygote, workers and judges leave the ending to it,
    without a KeyboardInterrupt traceback each."""
    pytest.importorskip("atheris", reason="the coverage engine needs atheris (the dev extra)")
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "from kfuzz.cli import main; main()", "run", "--target",
                          "softmax", "--engine", "atheris", "--time", "300", "--jobs", "1", "--judges", "1",
                          "--root", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not any((tmp_path / "seeds").rglob("*.zst")) and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.5)   # running: the coverage engine has kept a case
        time.sleep(1.0)
        os.killpg(p.pid, signal.SIGINT)
        out, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130 and "interrupted" in out, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out


def test_a_target_whose_import_breaks_forked_copies_runs_in_workers():
    """``harnesses.forkfragile`` ends any forked copy of the process that imported it (as a
    library that initialises CUDA at import does): workers import their target after they are
    forked, so every case passes, none is a crash."""
    import harnesses.forkfragile  # noqa: F401  (registers the target here; the worker imports it itself)
    target = get_target("forkfragile")
    pool = Pool(target, jobs=1, timeout=30.0)
    try:
        cases = [Case.make("forkfragile", "float32", seed, {"N": 2, "D": 8}) for seed in range(3)]
        for case in cases:
            pool.submit(case)
        results = _drain(pool)
    finally:
        pool.close()
    assert [r.verdict for r in results] == [None] * 3 and pool.restarts == 0
    for r in results:
        assert judge(r.case, target, r.inputs, _outputs(r, target)).passed


def test_a_zygote_that_is_unsafe_to_fork_gives_way_to_a_fresh_one(tmp_path, monkeypatch):
    """A module preloaded into the zygote that starts a thread makes forking it unsafe: the
    zygote says so, and the worker comes from a zygote of its own (a spawn) instead."""
    import os
    import sys

    from kfuzz import launcher
    (tmp_path / "threadstarter.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tainted = launcher.Launcher()
    try:
        assert tainted.ensure(("threadstarter",)) is not None and "threads" in tainted.hazard
        monkeypatch.setattr(launcher, "_shared", [tainted])
        r, w = os.pipe()
        child = launcher.start(("os", "write"), (b"ok",), (w,), preload=("threadstarter",))
        os.close(w)
        assert child.launcher is not tainted and child.launcher.single
        assert os.read(r, 10) == b"ok"
        child.join(30)
        assert child.exitcode == 0
        child.release()
        os.close(r)
    finally:
        tainted.close()
    assert "threadstarter" not in sys.modules    # imported by the zygote, never by kfuzz's process


def test_a_worker_holds_no_descriptor_of_kfuzz_but_its_own(tmp_path):
    """Whatever kfuzz's process holds open (a results file, say), a worker holds only its pipe,
    its violation channel and the standard descriptors (stdin and stdout on /dev/null)."""
    import os

    from kfuzz import launcher
    held = open(tmp_path / "results.jsonl", "w")
    r, w = os.pipe()
    try:
        child = launcher.start(("tests.test_workers", "_report_fds"), (), (w,))
        os.close(w)
        got = os.read(r, 4000).decode()
        child.join(30)
        child.release()
    finally:
        os.close(r)
        held.close()
    fds = dict(line.split(" ", 1) for line in got.splitlines())
    assert fds["0"] == fds["1"] == "/dev/null"
    handed = [target for n, target in fds.items() if n not in ("0", "1", "2")]
    assert len(handed) == 1 and handed[0].startswith("pipe:"), fds   # the pipe it was handed, and nothing else


def _report_fds(fd: int) -> None:
    """What this process holds open, one ``fd target`` line each, to ``fd``."""
    import os
    lines = []
    for n in range(1024):
        try:
            lines.append(f"{n} {os.readlink(f'/proc/self/fd/{n}')}")
        except OSError:
            pass
    os.write(fd, "\n".join(lines).encode())


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_worker_tries_fewer_namespaces_before_it_gives_up(monkeypatch):
    """Where CUDA does not start inside a worker's namespaces, kfuzz retries with fewer (no user
    namespace, then none) and remembers the level that works; here CUDA never starts, so every
    level is tried and the error says why (the worker's own exception, from its last try)."""
    from kfuzz import sandbox, workers
    monkeypatch.setattr(workers, "_levels", {})
    with pytest.raises(RuntimeError, match=r"worker for 'searchsum' could not start: \w+(Error)?: .*CUDA"):
        workers.Worker("searchsum", None, "cuda", False, sandbox.Policy())
    assert workers._levels["cuda"] == ["none"] and workers.isolation_level("cpu") == "full"


def test_a_worker_whose_gpu_is_full_keeps_its_namespaces_and_says_the_memory_is_taken():
    """CUDA that does not start for want of the GPU's memory (other processes hold it) ends the
    worker with ``DEVICE_FULL`` at every isolation level: fewer namespaces would not help, and a
    kernel that fills the GPU must not lower its neighbours' isolation. Any other CUDA start
    failure tries fewer namespaces, then is the error itself. The error kfuzz raises for a full
    GPU is read as ``resource-memory`` (an audit runs such a kernel again alone)."""
    import torch

    from kfuzz import sandbox, workers
    from kfuzz.audit import ended_by_gpu_state
    from kfuzz.audit.kernel import error_kind
    full = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"),
            RuntimeError("CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation'")]
    for level in sandbox.ISOLATION_LEVELS:
        assert [workers.start_failure(e, level) for e in full] == [workers.DEVICE_FULL] * 2
    other = RuntimeError("CUDA driver initialization failed, you might not have a CUDA gpu.")
    assert [workers.start_failure(other, level) for level in sandbox.ISOLATION_LEVELS] == [
        workers.CUDA_UNAVAILABLE, workers.CUDA_UNAVAILABLE, None]
    said = RuntimeError("worker for 'softmax' did not start: CUDA out of memory on cuda:0 (other processes hold "
                        "the GPU's memory)")
    assert error_kind(said) == sandbox.MEMORY and error_kind(other) == "RuntimeError"
    assert ended_by_gpu_state({"gates": {"G05": {"status": "error", "exc_type": error_kind(said)}}})
    assert ended_by_gpu_state({"gates": {}, "error": {"error": str(said), "exc_type": error_kind(said)}})


@pytest.mark.parametrize("state, said", [
    ("_DeviceBusy", r"cpu is busy or unavailable \(cudaErrorDevicesUnavailable\)"),
    ("_DeviceFull", r"CUDA out of memory on cpu \(other processes hold the GPU's memory\)")])
def test_a_worker_whose_gpu_is_busy_or_full_starts_again_at_the_same_isolation_level(monkeypatch, state, said):
    """A GPU that answers a context's creation with "busy or unavailable" (many processes
    starting CUDA at once) ends the worker with ``DEVICE_BUSY`` at every isolation level, one
    whose memory other processes hold (kfuzz's own workers and judges among them) with
    ``DEVICE_FULL``: states that pass. The worker is started again, at the same level, after
    ``DEVICE_WAITS``; past them, or where the next wait would end past ``give_up_at``, the
    error (``WorkerStartError``) names the state and the tries."""
    from kfuzz import sandbox, workers
    busy = RuntimeError("CUDA error: CUDA-capable device(s) is/are busy or unavailable\n"
                        "Search for `cudaErrorDevicesUnavailable' in https://docs.nvidia.com/cuda/")
    assert [workers.start_failure(busy, level) for level in sandbox.ISOLATION_LEVELS] == [
        workers.DEVICE_BUSY] * len(sandbox.ISOLATION_LEVELS)
    monkeypatch.setattr(workers, "_levels", {})
    monkeypatch.setattr(workers, "DEVICE_WAITS", (0.0, 0.0))
    real, starts, said_state = workers.Worker._await_ready, [], [2]

    def await_ready(self):
        starts.append(self.level)
        if said_state[0]:
            said_state[0] -= 1
            self.kill()
            raise getattr(workers, state)()
        real(self)
    monkeypatch.setattr(workers.Worker, "_await_ready", await_ready)
    w = workers.Worker("searchsum", None, "cpu", False, sandbox.Policy())
    try:
        assert starts == ["full"] * 3 and w.process.is_alive()
    finally:
        w.kill()
    said_state[0], starts[:] = 9, []
    with pytest.raises(WorkerStartError, match=rf"worker for 'searchsum' did not start: {said}, 3 tries"):
        workers.Worker("searchsum", None, "cpu", False, sandbox.Policy())
    assert starts == ["full"] * 3 and workers.isolation_level("cpu") == "full"
    monkeypatch.setattr(workers, "DEVICE_WAITS", (5.0, 5.0))
    said_state[0], starts[:] = 9, []
    began = time.monotonic()
    with pytest.raises(WorkerStartError, match=rf"did not start: {said}, 1 try"):
        workers.Worker("searchsum", None, "cpu", False, sandbox.Policy(), give_up_at=time.monotonic() + 1.0)
    assert starts == ["full"] and time.monotonic() - began < 5.0


def test_a_pool_whose_replacement_does_not_start_gives_the_crash_then_raises_until_restarted(monkeypatch):
    """A crash whose worker's replacement does not start (its GPU still full) is still a
    result; the program queued behind it is dropped (counted in ``busy`` until ``abandon``),
    and the next call raises the start's error, until ``restart`` tries a fresh worker."""
    from kfuzz import workers
    target = get_target(CRASHHANG)
    pool = Pool(target, 1, "cpu", 30.0)
    spawn, refuse = Pool._spawn, [True]

    def spawn_or_refuse(self, i, wait=True):
        if refuse[0] and self.started[i]:
            raise WorkerStartError("worker for 'searchsum.crashhang' did not start: CUDA out of memory on "
                                           "cuda (other processes hold the GPU's memory), 5 tries")
        return spawn(self, i, wait)
    monkeypatch.setattr(Pool, "_spawn", spawn_or_refuse)
    try:
        pool.submit(SEGFAULT)
        pool.submit(FINE)
        (crashed,) = list(pool.results())
        assert crashed.verdict.kind == "crash" and crashed.verdict.exc_type == "SIGSEGV" and pool.busy == 1
        with pytest.raises(WorkerStartError, match="did not start"):
            list(pool.results())
        with pytest.raises(WorkerStartError, match="did not start"):
            pool.submit(FINE)
        assert pool.abandon() == 1 and pool.busy == 0
        refuse[0] = False
        pool.restart()
        assert pool.run(FINE).verdict is None
    finally:
        pool.close()


def test_a_gpu_out_of_memory_is_named_after_the_resource_not_the_exception():
    """A GPU that ran out of memory (torch's allocator, or Triton's driver call that ended the
    call as a CUDA error) is the crash ``resource-memory``; other CUDA errors keep their type."""
    from kfuzz.programs import resource_crash
    from kfuzz.verdict import Verdict
    named = [resource_crash(Verdict("t", "crash", detail="CUDA error in the call: Triton Error [CUDA]: out of memory",
                                    exc_type="RuntimeError")),
             resource_crash(Verdict("t", "exception", detail="OutOfMemoryError: CUDA out of memory. Tried to allocate "
                                    "2.00 GiB", exc_type="OutOfMemoryError")),
             resource_crash(Verdict("t", "exception", detail="RuntimeError: CUDA error: out of memory",
                                    exc_type="RuntimeError"))]
    assert [(v.kind, v.exc_type) for v in named] == [("crash", "resource-memory")] * 3
    kept = resource_crash(Verdict("t", "crash", detail="CUDA error in the call: an illegal memory access was "
                                  "encountered", exc_type="AcceleratorError"))
    assert (kept.kind, kept.exc_type) == ("crash", "AcceleratorError")
    wrong = resource_crash(Verdict("t", "exception", detail="ValueError: shape out of range", exc_type="ValueError"))
    assert (wrong.kind, wrong.exc_type) == ("exception", "ValueError")


def test_a_crash_verdict_goes_back_without_tensors():
    """A program whose verdict is a crash (a CUDA error after the call, which leaves the
    device's memory unreadable) answers with the verdict alone: no output or input travels, so
    packing the answer reads nothing on the faulted device; in process, nothing is copied back.
    Other verdicts keep their tensors."""
    import torch
    from kfuzz.programs import answer, register_program
    from kfuzz.verdict import Verdict
    from kfuzz.wire import unpack

    def crashing(target, program, inputs, device):
        return (Verdict(target.name, "crash", detail="CUDA error after the call: misaligned address"),
                {"out": {"y": torch.ones(3)}}, {})

    def raising(target, program, inputs, device):
        return (Verdict(target.name, "exception", detail="ValueError: no"), {"out": {"y": torch.ones(3)}}, {})
    def out_of_memory(target, program, inputs, device):    # an exception that resource_crash makes a crash
        return (Verdict(target.name, "exception", detail="OutOfMemoryError: CUDA out of memory.",
                        exc_type="OutOfMemoryError"), {"out": {"y": torch.ones(3)}}, {})
    register_program("kfuzz-test-crashing", crashing)
    register_program("kfuzz-test-raising", raising)
    register_program("kfuzz-test-out-of-memory", out_of_memory)
    target = get_target("softmax")
    case = Case.make("softmax", "float32", 1, {"N": 2, "D": 5})
    msg, crashed = answer(target, case, "kfuzz-test-crashing", {}, [], [], "cpu", None)
    (kind, back, verdict, facts, cpu, edges), tensors = unpack(msg)
    assert crashed and kind == "program-done" and verdict["kind"] == "crash" and back == [] and tensors == []
    msg, crashed = answer(target, case, "kfuzz-test-raising", {}, [], [], "cpu", None)
    (kind, back, verdict, facts, cpu, edges), tensors = unpack(msg)
    assert not crashed and verdict["kind"] == "exception" and [b[:2] for b in back] == [["out", "y"]] and len(tensors) == 1
    # the in-process executor copies nothing back after a crash either
    from kfuzz.programs import Program
    with InProcess(target) as ex:
        assert ex.run(Program("kfuzz-test-crashing", case)).outputs == {}
        assert list(ex.run(Program("kfuzz-test-raising", case)).outputs) == ["out"]
        r = ex.run(Program("kfuzz-test-out-of-memory", case))
        assert (r.verdict.kind, r.verdict.exc_type, r.outputs) == ("crash", "resource-memory", {})
    msg, crashed = answer(target, case, "kfuzz-test-out-of-memory", {}, [], [], "cpu", None)
    (kind, back, verdict, facts, cpu, edges), tensors = unpack(msg)
    assert crashed and verdict["exc_type"] == "resource-memory" and back == [] and tensors == []


def test_inputs_that_do_not_fit_on_the_device_are_a_memory_crash_not_the_workers_death(monkeypatch):
    """Moving kfuzz's inputs to the device happens before the kernel runs; where the device's
    memory is taken (a GPU shared with other processes), the answer is the crash
    ``resource-memory`` (what the audit runs again alone), not a worker dead of the exception
    (a kernel's ``exit-1``). Any other error there is kfuzz's own and still raises."""
    import torch
    from kfuzz import programs
    from kfuzz.execute import storage_bytes
    from kfuzz.wire import geometry, unpack
    target = get_target("softmax")
    case = Case.make("softmax", "float32", 1, {"N": 2, "D": 5})
    x = torch.ones(2, 5)
    layouts, storages = [("in", "x", geometry(x))], [storage_bytes(x)]

    def full(storage, geo, device):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB.")
    monkeypatch.setattr(programs, "rebuild", full)
    msg, crashed = programs.answer(target, case, "call", {}, layouts, storages, "cpu", None)
    (kind, back, verdict, facts, cpu, edges), tensors = unpack(msg)
    assert crashed and (verdict["kind"], verdict["exc_type"]) == ("crash", "resource-memory") and back == []
    assert "inputs did not fit on cpu" in verdict["detail"]

    def broken(storage, geo, device):
        raise ValueError("a layout kfuzz got wrong")
    monkeypatch.setattr(programs, "rebuild", broken)
    with pytest.raises(ValueError):
        programs.answer(target, case, "call", {}, layouts, storages, "cpu", None)


def test_a_process_moved_during_the_walk_of_the_children_files_is_still_found(monkeypatch):
    """The children files are read one process at a time: a child that exits between the
    worker's list and its own hands its child to the worker unseen by that walk. The walk is
    taken again until two agree, so the grandchild is found (simulated /proc: the worker 1, its
    child 2 exiting, the grandchild 3)."""
    from kfuzz import processes
    lists = iter([[2], [2, 3]])
    last = {"1": [2]}

    def kids(pid):
        if pid == 1:
            last["1"] = next(lists, last["1"])
            return last["1"]
        return []
    monkeypatch.setattr(processes, "_kids", kids)
    monkeypatch.setattr(processes, "_state", lambda pid: "Z" if pid == 2 else "S")
    assert processes.descendants(1) == [3]


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_a_process_gives_back_the_gpu_memory_a_large_case_left_cached():
    """After a case, a worker or a judge keeps at most CACHE_KEPT of GPU memory cached by
    torch's allocator: the GPU's other processes need it for their launches."""
    import torch
    from kfuzz.execute import CACHE_KEPT, release_device_memory
    big = torch.empty(CACHE_KEPT + (1 << 30), dtype=torch.uint8, device="cuda")
    del big
    assert torch.cuda.memory_reserved() > CACHE_KEPT
    release_device_memory("cuda")
    assert torch.cuda.memory_reserved() <= CACHE_KEPT
    release_device_memory("cpu")     # nothing to give back
