"""Campaigns on any machine: devices checked before anything runs, workers spread over GPUs,
the oracle judged in parallel processes, the minimizer's own budget, progress without a
terminal, an interrupt during worker startup, compile-aware scheduling."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from kfuzz.campaign import run_campaign, worker_devices
from kfuzz.case import ArgCase, Case, Dist, Layout
from kfuzz.cli import cli
from kfuzz.corpus import Corpus, load
from kfuzz.devices import DeviceError, resolve_device, spread
from kfuzz.engines.random import RandomEngine
from kfuzz.errors import WorkerStartError
from kfuzz.executor import Pool
from kfuzz.execute import execute, judge, kernel_stage
from kfuzz.judges import Judges
from kfuzz.schedule import CompileHistory, Scheduler, smallest, specialization
from kfuzz.target import Arg, Dim, Output, Target, add_target, get_target
from test_workers import ListEngine

import kfuzz.cli.audit, kfuzz.cli.minimize, kfuzz.cli.replay, kfuzz.cli.run, kfuzz.cli.verify  # noqa: F401,E401  (register the verbs)

OVERFLOW = Case.make("softmax.nomax", "float32", 3, {"N": 4, "D": 33},
                     {"x": ArgCase(dist=Dist("scaled", (("factor", 100.0),)))})


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


# devices -----------------------------------------------------------------------------------------

def test_auto_is_cuda_only_where_a_gpu_is_visible():
    assert resolve_device("auto", cuda_count=0) == "cpu"
    assert resolve_device("auto", cuda_count=2) == "cuda"
    assert resolve_device("CUDA:1", cuda_count=2) == "cuda:1"
    for bad, count in (("cuda", 0), ("cuda:2", 2), ("gpu", 1), ("cuda0", 1), ("", 0)):
        if bad == "":
            assert resolve_device(bad, cuda_count=count) == "cpu"    # empty is the default
            continue
        with pytest.raises(DeviceError):
            resolve_device(bad, cuda_count=count)


@pytest.mark.parametrize("verb", [
    ("run", "--target", "softmax.nomax", "--runs", "3", "--root", "{tmp}"),
    ("verify", "--target", "softmax.nomax", "--gates", "G01", "--out", "{tmp}/out"),
    ("replay", "crashes/softmax.nomax"),
    ("audit", "{tmp}/corpus.jsonl", "--out", "{tmp}/out"),
])
@pytest.mark.parametrize("device", ["cuda", "tpu", "cuda:7"])
def test_a_device_this_machine_lacks_exits_2_and_saves_nothing(tmp_path, verb, device):
    import torch
    if torch.cuda.is_available() and device != "tpu":
        pytest.skip("this machine has CUDA")
    r = invoke(*(a.format(tmp=tmp_path) for a in verb), "--device", device)
    assert r.exit_code == 2 and "--device" in r.output
    assert not any(tmp_path.iterdir())


def test_minimize_refuses_a_device_this_machine_lacks(tmp_path):
    import torch
    path = Corpus(tmp_path).save_failure(OVERFLOW, execute(OVERFLOW))
    before = sorted(p.name for p in path.parent.iterdir())
    r = invoke("minimize", str(path), "--device", "cuda" if not torch.cuda.is_available() else "npu")
    assert r.exit_code == 2 and "--device" in r.output
    assert sorted(p.name for p in path.parent.iterdir()) == before


def test_the_cpu_device_chooses_tritons_interpreter_also_where_a_gpu_is_visible(monkeypatch):
    """Triton runs on CPU tensors only under its interpreter: a device of cpu chooses it, a
    cuda device does not, and with no device named it follows torch's view of the machine; a
    setting the user made is kept."""
    from kfuzz.target import prepare_triton
    for device, expected in (("cpu", "1"), ("cuda", None), ("cuda:1", None),
                             (None, None if torch.cuda.is_available() else "1")):
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        prepare_triton(device)
        assert os.environ.get("TRITON_INTERPRET") == expected, device
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    prepare_triton("cpu")
    assert os.environ["TRITON_INTERPRET"] == "0"


def test_a_triton_kernel_compiled_for_the_gpu_on_cpu_tensors_is_an_error_of_the_device_not_a_verdict(monkeypatch):
    """In a process whose Triton compiles for the GPU, a Triton kernel called on the cpu device
    raises on its first pointer: a DeviceError naming the interpreter, not an exception verdict
    against the kernel; under the interpreter the same message is the kernel's own exception."""
    from kfuzz.execute import call_kernel

    def compiled(x):
        raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")
    target = dataclasses.replace(get_target("softmax"), name="softmax.compiled", kernel=compiled)
    case = Case.make("softmax", "float32", 0, {"N": 2, "D": 8})
    inputs = {"x": torch.zeros(2, 8)}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(DeviceError, match="Triton's interpreter"):
        call_kernel(target, case, inputs, torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out, verdict = call_kernel(target, case, inputs, torch.device("cpu"))
    assert out is None and verdict.kind == "exception" and verdict.exc_type == "ValueError"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the machine's default is compiled Triton")
@pytest.mark.parametrize("jobs", ["0", "1"])
def test_a_triton_target_on_the_cpu_of_a_gpu_machine_runs_under_the_interpreter(tmp_path, jobs):
    """``--device cpu`` on a GPU machine: the correct Triton softmax passes, in process and in
    workers (a Triton kernel compiled for the GPU would raise on every CPU tensor)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", "from kfuzz.cli import main; main()", "run", "--target", "softmax",
                        "--device", "cpu", "--runs", "4", "--jobs", jobs, "--root", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 executions" in r.stdout and "0 failure signature(s)" in r.stdout, r.stdout


def test_workers_spread_over_the_gpus_one_pool_each():
    assert spread(5, [0, 1]) == [(0, 3), (1, 2)]
    assert spread(1, [0, 1, 2]) == [(0, 1)]
    assert spread(4, []) == [(None, 4)]
    assert worker_devices("cuda", 5, cuda_count=2) == ["cuda:0"] * 3 + ["cuda:1"] * 2
    assert worker_devices("cuda", 3, cuda_count=1) == ["cuda"] * 3      # one GPU: every worker on it
    assert worker_devices("cuda:1", 2, cuda_count=4) == ["cuda:1"] * 2  # the one named
    assert worker_devices("cpu", 2, cuda_count=4) == ["cpu"] * 2


# judging -----------------------------------------------------------------------------------------

def test_a_judge_process_gives_the_verdict_judged_here():
    target = get_target("softmax.nomax")
    # the last one's message is larger than a pipe holds unread: it goes through a sender thread
    cases = [OVERFLOW, Case.make("softmax.nomax", "float32", 4, {"N": 3, "D": 17}),
             Case.make("softmax.nomax", "float32", 5, {"N": 64, "D": 512})]
    ran, here = {}, {}
    for case in cases:     # before the judges start: their pool's threads are not the kernel's
        inputs, outputs, verdict = kernel_stage(case, target)
        assert verdict is None
        ran[case] = inputs, outputs
        here[case] = judge(case, target, inputs, outputs)
    judges = Judges(target, processes=1, account=lambda c: c.dim["D"])
    try:
        for case, (inputs, outputs) in ran.items():
            judges.submit(case, inputs, outputs, case)
        got = {}
        deadline = time.monotonic() + 120
        while judges.busy and time.monotonic() < deadline:
            got.update(judges.done(5.0))
    finally:
        judges.close()
    assert {c: v.signature for c, v in got.items()} == {c: v.signature for c, v in here.items()}
    assert not got[OVERFLOW].passed and got[cases[1]].passed
    # each case's judging seconds summed under its class (here its D), as a campaign's costs
    widths = sorted({c.dim["D"] for c in cases})
    assert sorted(judges.by_account) == widths
    assert sum(n for n, _ in judges.by_account.values()) == len(cases)
    assert all(s > 0 for _, s in judges.by_account.values())
    assert abs(sum(s for _, s in judges.by_account.values()) - judges.seconds) < 1e-9


def test_a_judge_that_dies_is_replaced_and_its_results_judged_again():
    target = get_target("softmax.nomax")
    case = Case.make("softmax.nomax", "float32", 4, {"N": 3, "D": 17})
    inputs, outputs, _ = kernel_stage(case, target)
    judges = Judges(target, processes=1)
    try:
        judges.submit(case, inputs, outputs, "warm")       # the pool's process exists once used
        deadline = time.monotonic() + 600   # a hang guard: a loaded machine starts a judge slowly
        got = []
        while judges.busy and time.monotonic() < deadline:
            got += judges.done(5.0)
        for judge_ in [j for js in judges.judges.values() for j in js]:
            judge_.process.kill()
            judge_.process.join(10)
        judges.submit(case, inputs, outputs, "again")
        while judges.busy and time.monotonic() < deadline:
            got += judges.done(5.0)
    finally:
        judges.close()
    assert [tag for tag, v in got if v.passed] == ["warm", "again"]
    assert judges.restarts == 1 and judges.errors == []


def test_results_dropped_at_a_judge_never_come_back_as_later_ones():
    """A judge answers in order; the answers still due for dropped results are discarded, so a
    result submitted after a drop gets its own verdict, not a dropped one's."""
    target = get_target("softmax.nomax")
    failing, passing = OVERFLOW, Case.make("softmax.nomax", "float32", 4, {"N": 3, "D": 17})
    ran = {case: kernel_stage(case, target)[:2] for case in (failing, passing)}
    judges = Judges(target, processes=1)
    try:
        for tag in ("dropped-1", "dropped-2"):
            judges.submit(failing, *ran[failing], tag)
        assert judges.drop() == 2 and judges.busy == 0
        judges.submit(passing, *ran[passing], "kept")
        got, deadline = [], time.monotonic() + 600
        while judges.busy and time.monotonic() < deadline:
            got += judges.done(5.0)
    finally:
        judges.close()
    assert [(tag, v.passed) for tag, v in got] == [("kept", True)]


def test_an_oracle_that_raises_is_kfuzz_s_error_not_a_verdict():
    def reference(x):
        raise ArithmeticError("the oracle cannot")
    target = add_target(Target(name="raising_oracle", kernel=lambda x: (x.sum(dim=-1),), reference=reference,
                               args={"x": Arg(("N", "D"))}, outputs={"out": Output(("N",))},
                               dims={"N": Dim(1, 4), "D": Dim(1, 8)}))
    case = Case.make("raising_oracle", "float32", 1, {"N": 2, "D": 3})
    inputs, outputs, _ = kernel_stage(case, target)
    judges = Judges(target, processes=0)
    judges.submit(case, inputs, outputs, "tag")
    assert judges.done() == [] and judges.busy == 0
    assert len(judges.errors) == 1 and "ArithmeticError: the oracle cannot" in judges.errors[0]


# out of memory -----------------------------------------------------------------------------------

def _memory_target(name: str, fails: int) -> Target:
    """A row sum whose first ``fails`` calls (in this process) run out of memory."""
    calls = [0]

    def kernel(x):
        calls[0] += 1
        if calls[0] <= fails:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return (x.sum(dim=-1),)
    return add_target(Target(name=name, kernel=kernel, reference=lambda x: (x.sum(dim=-1),),
                             args={"x": Arg(("N", "D"))}, outputs={"out": Output(("N",))},
                             dims={"N": Dim(1, 4), "D": Dim(1, 8)}))


@pytest.mark.parametrize("fails, failures", [(1, 0), (2, 1)])
def test_an_out_of_memory_crash_runs_once_more_before_it_is_a_verdict(tmp_path, fails, failures):
    """Another process's peak can take a shared GPU's memory from a case that needs little: the
    case runs again, and only a second out-of-memory crash is saved as its failure."""
    target = _memory_target(f"oom_{fails}", fails)
    case = Case.make(target.name, "float32", 1, {"N": 2, "D": 3})
    stats = run_campaign(target, ListEngine([case]), Corpus(tmp_path), runs=1, jobs=0, minimize_seconds=0)
    assert stats.executions == 1 and stats.memory_reruns == 1
    assert len(stats.failures) == failures == len(stats.saved)
    if failures:
        (sig,) = stats.failures
        assert sig.kind == "crash" and sig.exc_type == "resource-memory"


def test_a_case_whose_oracle_does_not_fit_the_memory_is_judged_on_the_cpu_and_counted(tmp_path):
    """A judge whose oracle runs out of memory judges the case again on the CPU (the same
    definition): the verdict stands, and the campaign counts it (``judged_on_cpu``), so that
    a campaign slowed by a full GPU says so."""
    calls = [0]

    def oracle(x):
        calls[0] += 1
        if calls[0] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return (x.double().sum(dim=-1),)
    target = add_target(Target(name="oom_oracle", kernel=lambda x: (x.sum(dim=-1),), reference=oracle,
                               args={"x": Arg(("N", "D"))}, outputs={"out": Output(("N",))},
                               dims={"N": Dim(1, 4), "D": Dim(1, 8)}))
    case = Case.make(target.name, "float32", 1, {"N": 2, "D": 3})
    stats = run_campaign(target, ListEngine([case]), Corpus(tmp_path), runs=1, jobs=0, minimize_seconds=0)
    assert stats.executions == 1 and not stats.failures and stats.judged_on_cpu == 1 and calls[0] >= 2
    assert stats.to_json()["judged_on_cpu"] == 1 and stats.gpu_least_free is None     # no GPU here


def test_an_out_of_memory_crash_runs_again_alone_once_every_worker_is_idle(tmp_path, monkeypatch):
    """The second run of a case that ran out of memory is sent when no other case is in
    flight (the memory the others held is theirs no longer), and no new case is sent while
    it runs: searchsum.oomrows runs out of memory on 13 rows, every time, so it is saved."""
    target = get_target("searchsum.oomrows")
    rows = [2, 3, 13, *range(1, 13), *range(1, 13)]      # one case of 13 rows, then 24 others
    cases = [Case.make(target.name, "float32", i, {"N": n, "D": 64}) for i, n in enumerate(rows)]
    sent = []     # (rows, cases in flight when it was sent)
    submit = Pool.submit

    def spied(self, program, affinity=None):
        sent.append((program.case.dim["N"], self.busy))
        return submit(self, program, affinity)
    monkeypatch.setattr(Pool, "submit", spied)
    stats = run_campaign(target, ListEngine(cases), Corpus(tmp_path), runs=len(cases), jobs=2, timeout=30.0,
                         minimize_seconds=0)
    assert stats.memory_reruns == 1 and stats.executions == len(cases)
    (sig,) = stats.failures
    assert sig.kind == "crash" and sig.exc_type == "resource-memory" and len(stats.saved) == 1
    runs = [i for i, (n, _) in enumerate(sent) if n == 13]
    assert len(runs) == 2 and sent[runs[1]][1] == 0
    after = sent[runs[1] + 1:]
    assert after and all(busy == 0 for _, busy in after[:1])     # the next case waited for it


def test_a_worker_that_cannot_start_stops_the_campaign_early_and_keeps_what_it_found(tmp_path, monkeypatch):
    """A worker whose GPU stays full past ``DEVICE_WAITS`` (here: a replacement after the
    first crash cannot start) ends the campaign as its time limit would: ``stopped`` names the
    error, the failure found before is saved and still minimized, and ``kfuzz run`` exits 2
    where it found nothing."""
    from kfuzz import workers
    target = get_target("searchsum.crashhang")
    crash = Case.make(target.name, "float32", 0, {"N": 2, "D": 3}, {"x": ArgCase(inject=((0, "nan"),))})
    spawn, spawned = Pool._spawn, []

    def full_after_first(self, i, wait=True):
        spawned.append(i)
        if len(spawned) > self.jobs:
            raise WorkerStartError(f"worker for {target.name!r} did not start: CUDA out of memory on cuda "
                                           "(other processes hold the GPU's memory), 5 tries")
        return spawn(self, i, wait)
    monkeypatch.setattr(Pool, "_spawn", full_after_first)
    stats = run_campaign(target, ListEngine([crash]), Corpus(tmp_path), seconds=30.0, jobs=1, timeout=30.0,
                         minimize_seconds=5)
    assert stats.stopped and "CUDA out of memory" in stats.stopped and stats.seconds < 20
    assert len(stats.saved) == 1 and stats.saved[0].exists()
    assert stats.to_json()["stopped"] == stats.stopped
    assert stats.minimized[stats.saved[0]] == {"error": stats.stopped}   # the minimizer's pool could not start
    spawned.extend(range(9))     # every start is refused
    r = invoke("run", "--target", "searchsum", "--device", "cpu", "--time", "30", "--root", str(tmp_path / "r"),
                "--stats-json", str(tmp_path / "s.json"))
    assert r.exit_code == 2 and "the campaign stopped early, at 0 s: worker for" in r.output
    assert json.loads((tmp_path / "s.json").read_text())["stopped"].endswith("5 tries")


# the minimizer's budget --------------------------------------------------------------------------

def test_the_minimizer_has_a_budget_of_its_own(tmp_path):
    """A failure found at the campaign's first case, and the campaign's time spent to its end:
    minimizing still runs to a fixed point, after --time, within --minimize-time."""
    target = get_target("softmax.nomax")
    start = time.monotonic()
    stats = run_campaign(target, ListEngine([OVERFLOW]), Corpus(tmp_path), seconds=2.0, jobs=0,
                         minimize_seconds=120.0)
    assert stats.seconds < 2.0 + 5.0 and stats.minimize_seconds > 0
    assert time.monotonic() - start < stats.seconds + stats.minimize_seconds + 5
    (path,) = stats.saved
    case, record = load(path)
    assert record["minimize"]["fixed_point"] and case.dim == {"N": 1, "D": 1}
    assert len(list(path.parent.glob("*.case.zst"))) == 1     # the case as found was replaced


def test_without_a_minimizing_budget_the_failure_is_saved_as_found(tmp_path):
    stats = run_campaign(get_target("softmax.nomax"), ListEngine([OVERFLOW]), Corpus(tmp_path), runs=2,
                         jobs=0, minimize_seconds=0)
    (path,) = stats.saved
    assert load(path)[0] == OVERFLOW and stats.failures and stats.minimize_seconds == 0


def test_a_sandboxed_minimizer_shrinks_a_crash():
    from kfuzz.executor import Pool
    from kfuzz.minimize import minimize
    target = get_target("searchsum.crashhang")
    crash = Case.make(target.name, "float32", 1, {"N": 3, "D": 8}, {"x": ArgCase(inject=((3, "nan"), (9, "inf")))})
    with Pool(target, 1, timeout=30.0) as executor:
        m = minimize(crash, target, executor=executor, max_seconds=240)
    assert m.verdict.kind == "crash" and m.verdict.exc_type == "SIGSEGV"
    assert m.case.dim == {"N": 1, "D": 1} and m.case.arg("x").inject == ((0, "nan"),)


# progress, known failures, interrupts -----------------------------------------------------------

def test_status_lines_appear_without_a_terminal(tmp_path):
    r = invoke("run", "--target", "softmax", "--time", "6", "--status-interval", "0.5", "--jobs", "0",
               "--root", str(tmp_path))
    assert r.exit_code == 0, r.output
    lines = [line for line in r.output.splitlines() if line.startswith("kfuzz run softmax:") and "executions" in line]
    assert len(lines) >= 3, r.output
    assert "/s)" in lines[-1] and "failure signature(s)" in lines[-1] and "compile(s)" in lines[-1]


def test_a_failure_matching_an_open_saved_case_is_counted_and_named(tmp_path):
    corpus = Corpus(tmp_path)
    corpus.save_failure(OVERFLOW, execute(OVERFLOW))
    stats = run_campaign(get_target("softmax.nomax"), ListEngine([OVERFLOW]), corpus, runs=3, jobs=0)
    (sig,) = stats.failures
    assert stats.known[sig] == 3 and not stats.saved
    r = invoke("run", "--target", "softmax.nomax", "--runs", "30", "--jobs", "0", "--root", str(tmp_path))
    assert r.exit_code == 1 and "already saved; not saved again" in r.output


def test_an_interrupt_during_worker_startup_still_writes_the_summary(tmp_path):
    stats_json = tmp_path / "stats.json"
    p = subprocess.Popen([sys.executable, "-c", "from kfuzz.cli import main; main()", "run", "--target", "softmax",
                          "--time", "300", "--jobs", "2", "--root", str(tmp_path), "--stats-json", str(stats_json)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = p.stderr.readline()          # printed just before the workers start
        assert first.startswith("kfuzz run softmax"), first
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, out + err
    stats = json.loads(stats_json.read_text())
    assert stats["interrupted"] is True and stats["executions"] == 0
    assert "interrupted" in out


# compile-aware scheduling ------------------------------------------------------------------------

def test_the_scheduler_opens_one_specialization_at_a_time_and_keeps_to_its_compile_share():
    target = get_target("softmax")
    schedule = Scheduler(target, RandomEngine(target, seed=1), share=0.25, workers=4)
    first = schedule.next_case(elapsed=0.0, compile_seconds=0.0)
    schedule.observe(first, compile_seconds=10.0)
    # one new key in flight at a time while compiling has taken at most 1/4 of 4 workers' time
    more = [schedule.next_case(elapsed=20.0, compile_seconds=10.0) for _ in range(8)]
    assert len({specialization(target, c) for c in [first] + more}) == 2 and len({c.hash for c in more}) == 8
    # past the share, every draw reuses an opened specialization
    for c in more:
        schedule.observe(c, compile_seconds=0.0)
    later = [schedule.next_case(elapsed=20.0, compile_seconds=30.0) for _ in range(20)]
    assert {specialization(target, c) for c in later} <= {specialization(target, c) for c in [first] + more}
    assert len({c.hash for c in later}) == 20 and schedule.held >= 20


def test_a_specialization_in_flight_goes_to_no_second_worker_once_compiles_are_seen():
    target = get_target("softmax")

    class Repeating(RandomEngine):       # draws one case of a new specialization, again and again
        def next_case(self):
            return Case.make("softmax", "float32", 7, {"N": 3, "D": 77})

    schedule = Scheduler(target, Repeating(target, seed=1), share=1.0, workers=4)
    compiled = Case.make("softmax", "float32", 1, {"N": 2, "D": 5})
    schedule.observe(compiled, compile_seconds=4.0)
    opened = schedule.next_case(elapsed=10.0, compile_seconds=4.0)
    assert opened.dim == {"N": 3, "D": 77}
    # while its first case is out, its draws become cases of the compiled specialization
    again = [schedule.next_case(elapsed=10.0, compile_seconds=4.0) for _ in range(5)]
    assert {specialization(target, c) for c in again} == {specialization(target, compiled)}
    schedule.observe(opened, compile_seconds=6.0)
    assert schedule.next_case(elapsed=11.0, compile_seconds=10.0).dim == {"N": 3, "D": 77}


def test_the_dims_walk_keeps_costly_dims_by_the_chance_its_target_gives_them():
    """The scheduler's walk over a key's dims steps to dims of a lower keep chance
    (``options["keep"]``) with the ratio of the two chances: from the same start, its cases
    cost less in all, and the costly ones are fewer, still walked to."""
    base = get_target("softmax")

    class Elsewhere(RandomEngine):      # every draw a new specialization: each case comes from the walk
        def next_case(self):
            return Case.make("softmax", "float32", 7, {"N": 3, "D": 77})

    def walk(target):
        schedule = Scheduler(target, Elsewhere(target, seed=1), seed=1)
        schedule.observe(Case.make("softmax", "float32", 1, {"N": 1, "D": 9}), compile_seconds=10.0)
        cases = [schedule.next_case(elapsed=100.0, compile_seconds=1e6) for _ in range(2000)]
        return [c.dim["N"] * c.dim["D"] for c in cases]
    plain = walk(base)
    kept = walk(dataclasses.replace(base, options={**base.options, "keep": lambda d: min(1.0, 32 / (d["N"] * d["D"]))}))
    assert sum(kept) < sum(plain) / 2
    assert 0 < sum(w > 256 for w in kept) < sum(w > 256 for w in plain) / 3


class _NewKey(RandomEngine):
    """Draws one case of a specialization not yet run, again and again."""
    def next_case(self):
        return Case.make("softmax", "float32", 7, {"N": 3, "D": 77})


def test_a_new_specialization_waits_until_its_expected_compile_fits_the_share():
    """A key is opened only while compiling, its expected compile included, stays within the
    share: a warm campaign whose first key loaded in 1 s still prices a key that no campaign
    compiled on this cache at the 15 s the history recorded, and one the history lists at 0."""
    target = get_target("softmax")
    loaded = Case.make("softmax", "float32", 1, {"N": 2, "D": 5})
    opened = {"N": 3, "D": 77}

    def first_new(history, elapsed):
        schedule = Scheduler(target, _NewKey(target, seed=1), share=0.25, workers=1, history=history)
        schedule.observe(loaded, compile_seconds=1.0)
        return schedule.next_case(elapsed=elapsed, compile_seconds=1.0).dim == opened
    # without a history, the 1-s load is the longest compile seen: 1 + 1 <= 0.25 * (9 + 1)
    assert first_new((frozenset(), 0.0), elapsed=9.0)
    # the history's 15 s: held at 9 s (1 + 15 > 0.25 * 24), opened once 1 + 15 <= 0.25 * (elapsed + 15)
    assert not first_new((frozenset(), 15.0), elapsed=9.0)
    assert not first_new((frozenset(), 15.0), elapsed=48.0)
    assert first_new((frozenset(), 15.0), elapsed=49.0)
    # a key an earlier campaign ran on this cache loads from it: expected 0, 1 <= 0.25 * 9
    new_key = specialization(target, Case.make("softmax", "float32", 7, opened))
    assert first_new((frozenset({repr(new_key)}), 15.0), elapsed=9.0)


def test_the_compile_history_keeps_what_campaigns_ran_and_survives_a_bad_file(tmp_path):
    path = tmp_path / "triton" / "kfuzz-compiles.json"
    target = get_target("softmax")
    schedule = Scheduler(target, RandomEngine(target, seed=1))
    a, b = Case.make("softmax", "float32", 1, {"N": 2, "D": 5}), Case.make("softmax", "float32", 1, {"N": 3, "D": 77})
    schedule.observe(a, compile_seconds=12.0)
    history = CompileHistory(path)
    assert history.of("softmax") == (frozenset(), 0.0)
    history.add("softmax", schedule)
    history.save()
    later = Scheduler(target, RandomEngine(target, seed=1))
    later.observe(b, compile_seconds=0.5)       # a load: the longest stays the 12 s compile
    again = CompileHistory(path)
    again.add("softmax", later)
    again.save()
    keys, longest = CompileHistory(path).of("softmax")
    assert keys == {repr(specialization(target, a)), repr(specialization(target, b))} and longest == 12.0
    assert CompileHistory(path).of("gdn_bwd") == (frozenset(), 0.0)
    path.write_text('{"softmax": {"keys": [1, "k"], "longest": "x"}, "torn')
    assert CompileHistory(path).of("softmax") == (frozenset(), 0.0)       # unreadable: no history
    path.write_text('{"softmax": {"keys": [1, "k"], "longest": -3}}')
    assert CompileHistory(path).of("softmax") == (frozenset({"k"}), 0.0)  # only what is well formed
    path.write_text('{"softmax": {"keys": ["k"], "longest": 1}}' + " " * (16 << 20))
    assert CompileHistory(path).of("softmax") == (frozenset(), 0.0)       # too large to read


def test_a_campaign_writes_the_specializations_it_ran_into_the_caches_history(tmp_path):
    target = get_target("softmax")
    path = tmp_path / "cache" / "kfuzz-compiles.json"
    stats = run_campaign(target, RandomEngine(target, seed=3), Corpus(tmp_path / "root"), runs=5, jobs=0,
                         minimize_seconds=0, compile_history=path)
    keys, longest = CompileHistory(path).of("softmax")
    assert stats.executions == 5 and keys and longest == 0.0       # the CPU compiles nothing
    assert len(keys) == stats.specializations
    # where the judging went, by specialization, costliest first (judged in this process here)
    assert sum(n for _, n, _, _ in stats.costs) == 5 and len(stats.costs) == min(stats.specializations, 10)
    assert [s for _, _, s, _ in stats.costs] == sorted((s for _, _, s, _ in stats.costs), reverse=True)
    assert stats.to_json()["costs"] == stats.costs


def test_the_specialization_key_names_a_pointer_off_a_16_byte_boundary():
    target = get_target("softmax")
    case = Case.make("softmax", "float32", 1, {"N": 2, "D": 5})

    def at(offset):
        return dataclasses.replace(case, args=(("x", ArgCase(layout=Layout("offset", offset=offset))),))
    assert specialization(target, at(4)) == specialization(target, at(8)) != specialization(target, at(1))


def test_the_gdn_targets_declare_a_specialization_that_spans_many_sequence_lengths():
    target = get_target("gdn_bwd")
    key = {specialization(target, Case.make("gdn_bwd", "bfloat16", 0, dict(B=2, T=t, H=3, K=20, V=30)))
           for t in (70, 100, 333, 900)}
    assert len(key) == 1
    assert specialization(target, Case.make("gdn_bwd", "bfloat16", 0, dict(B=2, T=70, H=3, K=21, V=30))) not in key
    assert specialization(target, Case.make("gdn_bwd", "bfloat16", 0, dict(B=2, T=64, H=3, K=20, V=30))) not in key


def test_redrawn_cases_vary_the_dims_a_declared_key_leaves_free():
    target = get_target("gdn_bwd")
    schedule = Scheduler(target, RandomEngine(target, seed=2), share=0.25, workers=4)
    first = Case.make("gdn_bwd", "float32", 1, dict(B=1, T=40, H=3, K=20, V=30))
    schedule.observe(first, compile_seconds=30.0)       # past the share: every new key is held
    held = [schedule.next_case(elapsed=10.0, compile_seconds=30.0) for _ in range(80)]
    assert schedule.held >= 60
    assert {specialization(target, c) for c in held} == {specialization(target, first)}
    # without the walk over the free dims, every held case would have the first case's B, T, H
    # (over seeds 0-9, 80 draws give 13 to 21 distinct ones)
    assert len({(c.dim["B"], c.dim["T"], c.dim["H"]) for c in held}) >= 12


def test_a_campaign_that_compiles_keeps_to_its_share_and_runs_many_shapes_a_specialization(tmp_path, monkeypatch):
    """searchsum.keyjit compiles for 0.3 s at each (dtype, D's power of 2) in each worker: two
    workers spend about a quarter of their time compiling, the rest on cases of compiled keys,
    whose N (a dim no key names) varies. (Opening every new key, they judge a few hundred
    cases and compile fifty times.)"""
    target = get_target("searchsum.keyjit")
    drawn = []
    next_case = Scheduler.next_case
    monkeypatch.setattr(Scheduler, "next_case", lambda self, *a: drawn.append(next_case(self, *a)) or drawn[-1])
    stats = run_campaign(target, RandomEngine(target, seed=4), Corpus(tmp_path), seconds=10.0, jobs=2,
                         timeout=30.0, minimize_seconds=0)
    assert stats.compiles >= 2 and not stats.failures and stats.executions > 10 * stats.compiles
    assert stats.compile_seconds <= 0.25 * 2 * stats.seconds + 2 * 0.3 * 2     # the share, and what was in flight
    by_key: dict = {}
    for case in drawn:
        by_key.setdefault(specialization(target, case), set()).add(case.dim["N"])
    assert len(by_key) <= stats.specializations + 1          # compiled, or the one in flight at the end
    assert max(len(ns) for ns in by_key.values()) >= 4


def test_a_kernels_jit_key_new_to_the_earlier_cases_of_its_specialization_is_a_miss():
    """A label seen before is a load from the cache, a kernel new to the key a code path: only
    the same kernel at another JIT key is a trigger that the key does not name."""
    target = get_target("softmax")
    schedule = Scheduler(target, RandomEngine(target, seed=1))
    case = Case.make("softmax", "float32", 1, {"N": 2, "D": 5})
    assert schedule.observe(case, 1.0, ("main#a", "tail#a")) == []
    assert schedule.observe(case, 1.0, ("main#a", "exact#b")) == []
    assert schedule.observe(case, 1.0, ("main#c", "tail#a")) == ["main#c"]
    other = Case.make("softmax", "float16", 1, {"N": 2, "D": 5})
    assert schedule.observe(other, 1.0, ("main#d",)) == []
    # an autotuner's configs, or two values of a constexpr, within one case: no miss
    third = Case.make("softmax", "bfloat16", 1, {"N": 2, "D": 5})
    assert schedule.observe(third, 1.0, ("tuned#1", "tuned#2", "tuned#3")) == []
    assert schedule.observe(third, 1.0, ("tuned#2", "tuned#4", "tuned#4")) == ["tuned#4"]


@pytest.mark.parametrize("jobs", [0, 1])
def test_a_campaign_names_the_compiles_its_targets_specialization_misses(tmp_path, jobs):
    """searchsum.misskey's JIT key holds N's parity, which its declared specialization does not
    name: the campaign counts those compiles and logs them by label; searchsum.keyjit, the
    same JIT with a key its declaration names, has compiles and no miss."""
    import json

    from harnesses import controls_search
    controls_search._keys.clear()     # in process, as a fresh worker: nothing compiled yet
    stats = {}
    for name in ("searchsum.misskey", "searchsum.keyjit"):
        target = get_target(name)
        stats[name] = run_campaign(target, RandomEngine(target, seed=5), Corpus(tmp_path / name), runs=60,
                                   jobs=jobs, timeout=30.0, minimize_seconds=0)
    missed, kept = stats["searchsum.misskey"], stats["searchsum.keyjit"]
    assert missed.specialization_misses >= 1 and not missed.failures
    assert all(w.startswith("misskey#") for w, _, _ in missed.miss_log)
    assert kept.compiles >= 1 and kept.specialization_misses == 0 and not kept.miss_log
    logged = json.loads(json.dumps(missed.to_json()))
    assert logged["specialization_misses"] == missed.specialization_misses
    assert all(labels and labels[0].startswith("misskey#") for _, _, _, labels in logged["compile_log"])


def test_a_cold_start_opens_with_the_targets_smallest_case_then_draws_as_the_engine_does():
    target = get_target("softmax")
    lows = {n: d.lo for n, d in target.dims.items()}
    cold = Scheduler(target, RandomEngine(target, seed=1), workers=4, cold=True)
    first = cold.next_case(0.0, 0.0)
    assert first.dim == lows and first.dtype in target.dtypes
    target.validate(first)
    cold.observe(first, compile_seconds=5.0)
    assert any(cold.next_case(1.0, 0.0).dim != lows for _ in range(10))
    # a warm (CPU) campaign takes the engine's first draw as it comes
    warm = Scheduler(target, RandomEngine(target, seed=1), workers=4)
    assert warm.next_case(0.0, 0.0) == RandomEngine(target, seed=1).next_case()


def test_smallest_keeps_a_case_whose_lowest_dims_the_target_refuses():
    target = get_target("softmax")
    case = RandomEngine(target, seed=3).next_case()
    refusing = dataclasses.replace(target, constraint=lambda dims: "too small" if dims["D"] < 2 else None)
    assert smallest(refusing, case) is case
    assert smallest(target, case).dim == {n: d.lo for n, d in target.dims.items()}


@pytest.mark.parametrize("workers", [1, 8])
def test_a_cold_start_draws_nothing_more_until_its_first_case_is_back(workers):
    """With one worker too: a second case queued behind the first would be a fresh draw, a
    second specialization compiled before the first verdict."""
    target = get_target("softmax")
    cold = Scheduler(target, RandomEngine(target, seed=1), workers=workers, cold=True)
    assert not cold.waiting_first
    first = cold.next_case(0.0, 0.0)
    assert cold.waiting_first
    cold.observe(first, compile_seconds=5.0)
    assert not cold.waiting_first
    warm = Scheduler(target, RandomEngine(target, seed=1), workers=workers)
    warm.next_case(0.0, 0.0)
    assert not warm.waiting_first


def test_without_compiles_the_scheduler_passes_the_engines_draws():
    target = get_target("softmax")
    schedule = Scheduler(target, RandomEngine(target, seed=1), workers=4)
    schedule.observe(schedule.next_case(0.0, 0.0), compile_seconds=0.0)
    drawn = [schedule.next_case(elapsed=5.0, compile_seconds=0.0) for _ in range(10)]
    assert schedule.held == 0 and len({specialization(target, c) for c in drawn}) >= 8


def test_a_pool_sends_a_specialization_to_the_workers_that_ran_it():
    from kfuzz.executor import Pool
    target = get_target("softmax")
    cases = [Case.make("softmax", "float32", s, {"N": 2, "D": 5 + s}) for s in range(4)]
    with Pool(target, 2, timeout=60.0) as pool:
        pool.submit(cases[0], affinity="a")
        pool.submit(cases[1], affinity="a")      # worker 0 has room and ran "a"
        pool.submit(cases[2], affinity="b")      # a new one: the least busy worker
        placed = [[p.case for p, _, _ in w.queue] for w in pool.workers]
        got, deadline = [], time.monotonic() + 120
        while pool.busy and time.monotonic() < deadline:
            got += pool.results(deadline)
    assert placed == [cases[:2], cases[2:3]]
    assert sorted(r.program.case.seed for r in got) == [0, 1, 2]
    assert pool.ran == [{"a"}, {"b"}]


def test_the_stage_benchmark_prints_each_sides_stages_and_the_ratio(tmp_path):
    """``tools/bench_stages.py`` runs a target's cases both ways in one process and prints
    each stage's microseconds a case, each side's sum and the bare loop's ratio; and the worker's
    and the judge's sides alone and side by side."""
    import os
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "tools/bench_stages.py", "--targets", "hacks.honest_softmax", "--cases", "12",
                        "--device", "cpu", "--profile", "4", "--side-by-side", "0.5"], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "KFUZZ_FIXTURES": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    stages_table, side_by_side = p.stdout.split("####")
    rows = [line.split(" | ") for line in stages_table.splitlines() if line.startswith("| ") and "---" not in line]
    stages = {(r[0].strip("| "), r[1]) for r in rows[1:]}
    assert {("worker", "answer (programs.answer)"), ("judge", "judged"), ("bare loop", "kernel"),
            ("kfuzz's process", "all")} <= stages
    assert all(float(r[2].strip(" |")) > 0 for r in rows[1:])
    assert "bare loop / kfuzz's busiest process:" in p.stdout and "programs.py" in p.stdout
    sides = {r[0].strip("| "): [float(x.strip(" |")) for x in r[1:]] for r in
             (line.split(" | ") for line in side_by_side.splitlines() if line.startswith("| ") and "---" not in line)
             if r[0] != "| side"}
    assert set(sides) == {"worker", "judge"} and all(v > 0 for vs in sides.values() for v in vs)


def test_the_campaign_benchmark_lists_each_failure_and_keeps_its_case(tmp_path):
    """``tools/bench_campaign.py`` names each failure signature a campaign found, with its saved
    case, copied into ``--cases`` so that it outlives the work folder."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_campaign", "tools/bench_campaign.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    saved = tmp_path / "run" / "crashes" / "abc.case.zst"
    saved.parent.mkdir(parents=True)
    saved.write_bytes(b"case")
    stats = {"failures": {"gdn_bwd/nonfinite-dq": {"count": 3, "first_execution": 41}}, "saved": [str(saved)]}
    lines = bench.failures("gdn_bwd", 4, "warm", stats, tmp_path / "kept")
    kept = tmp_path / "kept" / "gdn_bwd-4-warm-abc.case.zst"
    assert lines == ["- gdn_bwd --jobs 4 warm: gdn_bwd/nonfinite-dq (3 execution(s), first at execution 41)",
                     f"  - saved: {kept}"]
    assert kept.read_bytes() == b"case"
    assert bench.failures("gdn_bwd", 4, "cold", {"failures": {}, "saved": []}, None) == []
