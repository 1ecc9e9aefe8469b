"""The twelve gates: each positive control is caught by its gate with the kind it should
have, the correct kernel of the same op passes that gate, failing cases replay through
their gate, and `kfuzz verify` renders and exits as documented. (A table: one row a control.)"""
import dataclasses
import importlib.util
import json
import re
import time
from collections import Counter
from pathlib import Path
import xml.etree.ElementTree as ET

import pytest
import torch
from click.testing import CliRunner

from kfuzz.cli import cli
from kfuzz.cli import verify  # noqa: F401  (registers the verb)
from kfuzz.gates import GATES, parse_gates, replay_gate_case, run_gate, run_gates
from kfuzz.gates.calls import poisoned_allocations
from kfuzz.case import Dist
from kfuzz.errors import KfuzzError
from kfuzz.target import get_target

CONTROLS = [
    # planted bug, the gate built to catch it, the verdict kind it must give, output
    ("layernorm.hotpath", "G01", "bound", "out"),
    ("softmax.clamp10", "G02", "bound", "out"),
    ("matmul.contig", "G04", "bound", "out"),
    ("layernorm.nan2zero", "G05", "nonfinite", "out"),
    ("layernorm.onepass", "G06", "nonfinite", "out"),
    ("cumsum.lowcarry", "G07", "bound", "out"),
    ("rowsum.shuffled", "G08", "nondeterminism", "out"),
    ("rowsum.alias", "G09", "contract", "out"),
    ("rowsum.zeroassumed", "G10", "stale", "out"),
    ("matmul.ptrcache", "G11", "stale", "out"),
    ("rmsnorm.badgrad", "G12", "bound", "grad.x"),
    ("causal_product.maskmul", "G05", "nonfinite", "out"),
    ("decay_scan.cumdiff", "G05", "nonfinite", "out"),
    ("rmsnorm.pairs", "G10", "stale", "out"),
    ("matmul.firstcache", "G11", "stale", "out"),
]


TRITON_HARNESSES = {"softmax", "rowsum"}     # their kernels are Triton's
CONTROL_PARAMS = [pytest.param(*r, id=f"{r[1]}-{r[0]}",
                               marks=[pytest.mark.triton_on_cpu] if r[0].split(".")[0] in TRITON_HARNESSES else [])
                  for r in CONTROLS]


@pytest.mark.parametrize("name, gate, kind, output", CONTROL_PARAMS)
def test_control_is_caught_by_its_gate_and_the_correct_kernel_passes(name, gate, kind, output, tmp_path):
    r = run_gate(GATES[gate], get_target(name), seed=0, out=tmp_path)
    assert r.status == "fail", r.reason
    case, v = r.first_failure
    assert (v.kind, v.output) == (kind, output), v.detail
    assert r.saved and all(p.exists() for p in r.saved)
    ok, again, _ = replay_gate_case(r.saved[0])      # the saved case fails the same way again
    assert ok, again.detail
    base = run_gate(GATES[gate], get_target(name.split(".")[0]), seed=0)
    assert base.status in ("pass", "n/a") and base.failures == 0, base.reason
    if name.split(".")[0] != "softmax":             # softmax is Triton: G12 is n/a, G02 applies
        assert base.status == "pass"


@pytest.mark.triton_on_cpu
def test_the_core_tail_control_is_caught_by_the_shape_gate():
    r = run_gate(GATES["G03"], get_target("rowsum.droptail"), seed=0)
    assert r.status == "fail" and r.first_failure[1].kind == "bound"
    # ... and not at the nominal shape, where its blocks divide D
    assert run_gate(GATES["G01"], get_target("rowsum.droptail"), seed=0).status == "pass"


@pytest.mark.parametrize("name", ["cumsum", "rmsnorm"])
def test_correct_torch_kernels_pass_all_twelve_over_seeds(name):
    for seed in (0, 1):
        results = run_gates(get_target(name), seed=seed)
        assert [r.gate for r in results] == list(GATES)
        bad = [(r.gate, r.reason) for r in results if r.status != "pass"]
        assert not bad, bad


@pytest.mark.triton_on_cpu
def test_gate_that_does_not_apply_says_why():
    r = run_gate(GATES["G12"], get_target("softmax"), seed=0)
    assert r.status == "n/a" and "no backward" in r.reason and r.cases == 0


def test_gate_cases_are_reproducible_from_the_seed():
    t = get_target("layernorm")
    for gid, gate in GATES.items():
        if gate.not_applicable(t):
            continue
        a = [c.hash for c in gate.cases(t, 7)]
        assert a == [c.hash for c in gate.cases(t, 7)], gid
        assert a != [c.hash for c in gate.cases(t, 8)], gid
        assert all(t.validate(c) is None for c in gate.cases(t, 7) if gid != "G04")


def test_poisoned_allocations_fill_fresh_memory_and_restore_torch_state():
    before = torch.are_deterministic_algorithms_enabled()
    with poisoned_allocations():
        assert torch.empty(37).isnan().all()
        assert torch.empty(5, dtype=torch.bfloat16).isnan().all()
    assert torch.are_deterministic_algorithms_enabled() == before


def test_parse_gates_refuses_unknown_ids():
    assert parse_gates("g05, G08") == ["G05", "G08"]
    assert parse_gates(None) == list(GATES)
    with pytest.raises(KfuzzError, match="G13"):
        parse_gates("G05,G13")


def test_verify_cli_exit_codes_and_formats(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(cli, ["verify", "--target", "cumsum", "--gates", "G05,G08,G12", "--out", str(tmp_path)])
    assert ok.exit_code == 0, ok.output
    assert "G05 nonfinite" in ok.output and "3 pass, 0 fail, 0 n/a" in ok.output

    bad = runner.invoke(cli, ["verify", "--target", "rowsum.shuffled", "--gates", "G08", "--format", "json",
                              "--out", str(tmp_path)])
    assert bad.exit_code == 1
    doc = json.loads(bad.output)
    g08 = doc["gates"][0]
    assert g08["status"] == "fail" and g08["verdict"]["kind"] == "nondeterminism" and g08["saved"]
    replayed = runner.invoke(cli, ["verify", "--replay", g08["saved"][0]])
    assert replayed.exit_code == 0 and "still fails" in replayed.output
    here = runner.invoke(cli, ["verify", "--target", "rowsum.shuffled", "--gates", "G08", "--in-process",
                               "--out", str(tmp_path)])
    assert here.exit_code == 1 and "FAIL" in here.output

    junit = runner.invoke(cli, ["verify", "--target", "softmax", "--gates", "G12", "--format", "junit"])
    assert junit.exit_code == 0
    suite = ET.fromstring(junit.output)
    assert suite.get("skipped") == "1" and suite.find("testcase/skipped") is not None

    for args in (["verify", "--target", "cumsum", "--gates", "G99"], ["verify", "--target", "nosuch"]):
        r = runner.invoke(cli, args)
        assert r.exit_code == 2 and "kfuzz: error:" in r.output
    r = runner.invoke(cli, ["verify", "--target", "cumsum", "--timeout", "0"])
    assert r.exit_code == 2 and "Invalid value for '--timeout'" in r.output


def _refusing_target(name, kernel):
    from kfuzz.target import Arg, Dim, Output, Target, add_target, load_targets
    load_targets()
    return add_target(Target(name=name, kernel=kernel, reference=lambda x: x.sum(dim=-1),
                             args={"x": Arg(("N", "D"), layouts=("contiguous",))},
                             outputs={"out": Output(("N",))}, dims={"N": Dim(1, 8), "D": Dim(1, 64)},
                             dtypes=("float32",)))


def _dense_only(x):
    if not x.is_contiguous() or x.storage_offset() != 0:
        raise ValueError("x must be a dense, contiguous tensor")
    return x.sum(dim=-1)


@pytest.mark.parametrize("kernel, status", [
    (lambda x: x.sum(dim=-1), "fail"),   # accepts a layout its contract refuses, silently
    (_dense_only, "pass"),               # refuses it with a clear error
], ids=["silent", "raises"])
def test_g04_demands_an_error_for_a_refused_layout(kernel, status):
    t = _refusing_target(f"test_gates_g04_{status}", kernel)
    r = run_gate(GATES["G04"], t, seed=0)
    assert r.status == status, r.reason
    if status == "fail":
        assert r.first_failure[1].kind == "contract" and "refuses" in r.first_failure[1].detail


def test_range_gate_runs_on_a_target_without_dims(tmp_path):
    """Fixed-size inputs (a KernelBench problem without size constants) have no dims to scale by."""
    from kfuzz.target import Arg, Output, Target
    t = Target(name="fixed_relu", kernel=lambda x: (torch.relu(x),), reference=lambda x: (torch.relu(x),),
               args={"x": Arg((4, 3))}, outputs={"out": Output((4, 3))}, dims={}, dtypes=("float32",))
    r = run_gate(GATES["G06"], t, seed=0, out=tmp_path)
    assert r.status == "pass", r.reason


def _out_of_memory_target(name, calls_out_of_memory):
    """A correct row sum whose first ``calls_out_of_memory`` calls raise as CUDA's allocator does."""
    calls = []

    def kernel(x):
        calls.append(1)
        if len(calls) <= calls_out_of_memory:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                         "capacity of 79.18 GiB of which 1.83 GiB is free.")
        return x.sum(dim=-1)
    return _refusing_target(name, kernel), calls


@pytest.mark.parametrize("device, out_of_memory, status, calls, rerun", [
    ("cuda", 1, "pass", 2, None),      # the GPU was shared: a second run fits
    ("cuda", 2, "fail", 2, 1),         # out of memory again: the verdict, confirmed
    ("cpu", 1, "fail", 1, None),       # a worker's memory is its own: no second run
], ids=["gpu-once", "gpu-twice", "cpu"])
def test_a_kernel_out_of_a_gpus_memory_runs_once_more_and_only_a_second_failure_counts(
        device, out_of_memory, status, calls, rerun, monkeypatch):
    """A GPU's memory is shared with kfuzz's own processes (the oracle's, the kernel's other
    workers): a case whose kernel ran out of it runs once more, after this process gave its
    cached memory back; a second failure is the verdict, marked ``memory_rerun``, which the audit
    needs before it counts an out-of-memory failure on a GPU as the kernel's."""
    from kfuzz.audit import judge_record, run_one_gate
    from kfuzz.gates.base import MEMORY_RERUN
    # the kernel runs in this process on the CPU; whether its device's memory is shared is looked up
    target, called = _out_of_memory_target(f"test_gates_oom_{device}_{out_of_memory}", out_of_memory)
    monkeypatch.setattr("kfuzz.gates.base.shares_memory", lambda d: device == "cuda")
    case = next(iter(GATES["G01"].cases(target, 0)))
    v = GATES["G01"].judge_case(target, case)
    assert len(called) == calls and v.passed == (status == "pass"), v
    if not v.passed:
        assert v.exc_type == "resource-memory" and v.metrics.get(MEMORY_RERUN) == rerun
    called.clear()
    gate = []     # the gate's record as the audit writes it (its kernel run here, on the CPU)
    run_one_gate("G01", target, 0, "cpu", None, lambda kind, d: gate.append(d))
    record = {"device": device, "alone": True, "standard": {"passed": True, "reason": "pass"},
              "gates": {"G01": gate[0]}}
    judged = judge_record(record)
    if device == "cuda" and out_of_memory == 1:
        assert not judged["violations"] and not judged["incomplete"]
    else:
        assert judged["violations"] == ["G01"] and not judged["incomplete"], judged
    # a GPU's out-of-memory failure recorded without a second run is not the kernel's: incomplete
    if gate[0]["status"] == "fail" and device == "cuda":
        del record["gates"]["G01"]["verdict"]["metrics"][MEMORY_RERUN]
        assert judge_record(record)["violations"] == [] and judge_record(record)["incomplete"]


# the kernel side in a sandboxed worker (kfuzz.programs) ----------------------------------------

def _first_failing(gate, target):
    for case in gate.cases(target, 0):
        v = gate.check(target, case)
        if isinstance(v, tuple):
            case, v = v
        if not v.passed:
            return case, v
    raise AssertionError(f"{target.name} passed {gate.id}")


@pytest.mark.parametrize("name, gate, kind, output", CONTROL_PARAMS)
def test_a_worker_gives_the_gates_verdicts_of_this_process(name, gate, kind, output):
    """Each gate's kernel program (call, repeat, guarded, poisoned, rebind, backward) run by the
    sandboxed executor: the control's first failing case fails the same way, and the correct
    kernel's first cases pass, as they do in this process."""
    from kfuzz.executor import Sandboxed
    g, planted = GATES[gate], get_target(name)
    case, here = _first_failing(g, planted)
    with Sandboxed(planted, timeout=60) as ex:
        there = g.check(planted, case, executor=ex)
    assert there.signature == here.signature, (there.detail, here.detail)
    correct = get_target(name.split(".")[0])
    with Sandboxed(correct, timeout=60) as ex:
        if g.not_applicable(correct, ex) is None:
            for case in list(g.cases(correct, 0))[:2]:
                v = g.check(correct, case, executor=ex)
                assert (v[1] if isinstance(v, tuple) else v).passed, v


def test_a_segfault_under_verify_is_that_gates_crash_and_verify_finishes(tmp_path):
    r = CliRunner().invoke(cli, ["verify", "--target", "searchsum.crashhang", "--gates", "G05,G08",
                                 "--format", "json", "--out", str(tmp_path)])
    assert r.exit_code == 1, r.output
    g05, g08 = json.loads(r.output)["gates"]
    assert g05["status"] == "fail" and g05["verdict"]["kind"] == "crash"
    with_nan = [c for c in GATES["G05"].cases(get_target("searchsum.crashhang"), 0)
                if any(v == "nan" for _, a in c.args for _, v in a.inject)]
    assert g05["verdict"]["exc_type"] == "SIGSEGV" and g05["failures"] == len(with_nan)   # NaN cases only
    assert g08["status"] == "pass"                        # a fresh worker after each death
    replayed = CliRunner().invoke(cli, ["verify", "--replay", g05["saved"][0]])
    assert replayed.exit_code == 0 and "still fails" in replayed.output


def test_a_hang_is_a_timeout_and_the_next_program_gets_a_fresh_worker():
    from kfuzz.case import Case
    from kfuzz.executor import Sandboxed
    from kfuzz.programs import Program, called
    from kfuzz.tensors import materialize
    t = get_target("searchsum.crashhang")
    hang, fine = (Case.make(t.name, dt, 1, {"N": 2, "D": d}) for dt, d in (("float16", 128), ("float32", 40)))
    with Sandboxed(t, timeout=2.0) as ex:
        r = ex.run(Program("call", hang, {"case": materialize(hang, t)}))
        assert r.verdict.kind == "timeout" and ex.worker is None
        outputs, verdict = called(ex, t, fine, materialize(fine, t))
        assert verdict is None and outputs["out"].shape == (2,) and ex.spawned == 2


def test_a_gates_program_does_not_count_a_jit_compile_as_run_time():
    """The verify/audit executor stops a program's clock while its kernel compiles (kfuzz.jit):
    searchsum.slowjit's first call compiles for 2 s, over the 1 s timeout."""
    from kfuzz.case import Case
    from kfuzz.executor import Sandboxed
    from kfuzz.programs import called
    from kfuzz.tensors import materialize
    t = get_target("searchsum.slowjit")
    fine = Case.make(t.name, "float32", 1, {"N": 2, "D": 40})
    with Sandboxed(t, timeout=1.0) as ex:
        outputs, verdict = called(ex, t, fine, materialize(fine, t))
        assert verdict is None and outputs["out"].shape == (2,) and ex.spawned == 1


def test_verify_jobs_runs_gates_at_once_with_the_same_results(tmp_path):
    """--jobs 2: each gate in its own process; the same verdicts, cases and order as one by one."""
    args = ["verify", "--target", "rowsum.shuffled", "--gates", "G05,G08,G01", "--format", "json", "--in-process"]
    one = CliRunner().invoke(cli, args + ["--out", str(tmp_path / "one")])
    two = CliRunner().invoke(cli, args + ["--out", str(tmp_path / "two"), "--jobs", "2"])
    assert one.exit_code == two.exit_code == 1, two.output
    a, b = json.loads(one.output)["gates"], json.loads(two.output)["gates"]
    assert [g["gate"] for g in b] == ["G05", "G08", "G01"]
    assert [(g["status"], g["cases"], g.get("case")) for g in a] == [(g["status"], g["cases"], g.get("case")) for g in b]
    assert b[1]["status"] == "fail" and b[1]["saved"]


def test_verify_verbose_reports_every_case_as_it_ends(tmp_path, capfd):
    """--verbose: one stderr line per case judged (gate, index, seconds, verdict), with and
    without --jobs (a gate process writes to the stderr it inherits)."""
    args = ["verify", "--target", "rowsum.shuffled", "--gates", "G04,G08", "--out", str(tmp_path)]
    for extra in ([], ["--jobs", "2"]):
        r = CliRunner().invoke(cli, args + extra + ["-v"])
        err = r.stderr + capfd.readouterr().err
        cases = re.findall(r"^  (G0[48]) case +(\d+) +[\d.]+s (\w+)$", err, flags=re.M)
        counts = {g: int(n) for g, n in re.findall(r"^(G0[48]) \S+ +\w+ +(\d+) case", r.stdout, flags=re.M)}
        assert r.exit_code == 1 and counts["G04"] > 0 and counts["G08"] > 0, r.output
        for gid in ("G04", "G08"):
            assert [int(i) for g, i, _ in cases if g == gid] == list(range(counts[gid]))
        assert any(g == "G08" and kind != "pass" for g, _, kind in cases)


def test_verify_jobs_gives_each_gate_process_its_share_of_the_cpus(tmp_path, monkeypatch):
    """--jobs N: each gate process starts with cpu_count // N torch threads (the oracle's
    autograd runs on the CPU there), and the share is what the pool's initializer sets."""
    import os
    import kfuzz.cli.verify as v
    made = []
    real = v.ProcessPoolExecutor

    def spy(*a, **kw):
        made.append(kw)
        return real(*a, **kw)
    monkeypatch.setattr(v, "ProcessPoolExecutor", spy)
    r = CliRunner().invoke(cli, ["verify", "--target", "cumsum", "--gates", "G05,G08", "--jobs", "2",
                                 "--in-process", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert made[0]["initializer"] is v._share_cpus
    assert made[0]["initargs"] == (max(1, (os.cpu_count() or 1) // 2),)
    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    try:
        v._share_cpus(1)
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env


@pytest.mark.triton_on_cpu
def test_the_cache_warmer_calls_the_kernel_on_every_case_the_gates_run(capsys):
    """tools/warm_triton_cache.py (a device verify's compiles, spread over processes first)
    enumerates exactly the cases the gates judge, and calls the kernel on each."""
    import importlib
    import sys
    from pathlib import Path

    from kfuzz.gates import GATES, run_gate
    from kfuzz.target import get_target
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))   # spawned children inherit it
    try:
        warm = importlib.import_module("warm_triton_cache")
        want = sum(run_gate(GATES[g], get_target("softmax")).cases for g in ("G03", "G05"))
        assert len(warm.gate_cases("softmax", "G03,G05", 0)) == want > 0
        assert warm.main(["--target", "softmax", "--device", "cpu", "--jobs", "2", "--gates", "G04"]) == 0
    finally:
        sys.path.pop(0)
    cases = list(GATES["G04"].cases(get_target("softmax"), 0))
    first, rest = warm.rounds(cases)
    assert len({warm.compile_class(c) for c in first}) == len(first) > 1
    assert {warm.compile_class(c) for c in rest} <= {warm.compile_class(c) for c in first}
    assert f"softmax: {len(cases)} case(s) called in 2 process(es) ({len(first)} compile classes), " \
           "0 raised" in capsys.readouterr().out


@pytest.mark.triton_on_cpu
def test_the_gate_parts_run_every_case_once_and_judge_as_the_gate_does():
    """tools/gate_part.py (a gate's cases spread over processes on the device): its parts
    together run the gate's cases, each once, with the gate's verdicts: a planted bug's
    failures (softmax.clamp10 under G02) and the correct kernel's passes."""
    import importlib
    import io
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    try:
        part = importlib.import_module("gate_part")
    finally:
        sys.path.pop(0)
    for name in ("softmax.clamp10", "softmax"):
        whole = run_gate(GATES["G02"], get_target(name), seed=0)
        out = io.StringIO()
        runs = [part.run_part(name, "G02", i, 3, out=out) for i in range(3)]
        assert sum(r[0] for r in runs) == whole.cases > 0
        assert sum(r[1] for r in runs) == whole.failures
        assert max(r[2] for r in runs) == pytest.approx(whole.worst_ratio)
        indices = sorted(int(ln.split()[2].rstrip(":")) for ln in out.getvalue().splitlines()
                         if ln.startswith("G02 case"))
        assert indices == list(range(whole.cases))
        assert (whole.failures > 0) == (name == "softmax.clamp10")
    with pytest.raises(SystemExit):
        part.main(["--target", "softmax", "--gate", "G02", "--part", "3/3"])


@pytest.mark.triton_on_cpu
def test_run_case_runs_one_case_and_says_how_it_ended(monkeypatch, capsys):
    """tools/run_case.py (one case, in this process, for a fault's traceback on the device):
    a correct kernel's case returns (exit 0), a kernel that raises is reported with its
    traceback (exit 1), and bad JSON, a case the contract refuses and an unknown target are
    refused by name (exit 2)."""
    import importlib
    import json
    import sys
    from pathlib import Path
    from kfuzz import target as targets
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    try:
        run_case = importlib.import_module("run_case")
    finally:
        sys.path.pop(0)
    case = {"target": "softmax", "dtype": "float32", "seed": 3, "dims": {"N": 4, "D": 33}}
    assert run_case.main([json.dumps(case)]) == 0
    assert "CASE RETURNED" in capsys.readouterr().out
    softmax = get_target("softmax")

    def boom(**_):
        raise RuntimeError("planted: the kernel faults")
    monkeypatch.setattr(targets, "get_target", lambda name: dataclasses.replace(softmax, kernel=boom))
    assert run_case.main([json.dumps(case)]) == 1
    captured = capsys.readouterr()
    assert "CASE RAISED" in captured.out and "planted: the kernel faults" in captured.err
    monkeypatch.undo()
    for bad, named in (("{not json", "not json"),
                       (json.dumps(dict(case, dims={"N": 4, "D": 100000})), "D"),
                       (json.dumps(dict(case, target="nosuch")), "nosuch")):
        with pytest.raises(SystemExit) as e:
            run_case.main([bad])
        assert e.value.code == 2 and named in capsys.readouterr().err


# one special in one argument (G05, G06) ------------------------------------------------------------
@pytest.mark.parametrize("name, says", [
    ("causal_product.maskmul", "in 'k' at index"),     # a later key's NaN reaches earlier outputs
    ("decay_scan.cumdiff", "-inf in 'g' at index"),    # a legal -inf gate: NaN across its chunk
])
def test_a_single_injection_failure_names_the_argument_the_value_and_the_index(name, says):
    r = run_gate(GATES["G05"], get_target(name), seed=0)
    assert r.status == "fail" and says in r.reason, r.reason


def test_specials_go_where_the_domain_maps_them_to_a_value_of_their_kind():
    from kfuzz.gates.specials import SINGLE_CASES
    t = get_target("gdn_fwd")      # g = -softplus(u): +inf becomes -inf; k normalized: Inf becomes NaN
    got = {}
    for c in GATES["G05"].cases(t, 0):
        injected = [(n, v) for n, a in c.args for _, v in a.inject]
        if len(injected) == 1:
            got.setdefault((c.dtype, injected[0][0]), set()).add(injected[0][1])
    assert got[("float32", "g")] == {"nan", "-inf"} and got[("float32", "k")] == {"nan"}
    assert got[("float32", "beta")] == {"nan"} and got[("float32", "q")] == {"nan", "inf", "-inf"}
    per_dtype = [sum(1 for c in GATES["G05"].cases(t, 0) if c.dtype == dt) for dt in t.dtypes]
    assert max(per_dtype) <= SINGLE_CASES + 1
    extremes = {v for c in GATES["G06"].cases(t, 0) for n, a in c.args if n == "g" for _, v in a.inject}
    assert extremes == {"-max"}      # softplus sends max to -max; tiny and subnormal to -log 2


def test_single_injections_reach_the_first_middle_and_last_index_of_every_dim():
    from kfuzz.gates.specials import probe_positions
    assert probe_positions((4, 5)) == [(2, 2), (0, 2), (3, 2), (2, 0), (2, 4), (0, 0), (3, 4)]
    t = get_target("layernorm")
    flats = {p for c in GATES["G05"].cases(t, 0) if c.dtype == "float32" for n, a in c.args
             if n == "x" and len(a.inject) == 1 for p, _ in a.inject}
    n, d = 16, 64
    assert {0, n * d - 1, (n // 2) * d + d // 2, (n // 2) * d, (n // 2) * d + d - 1, d // 2, (n - 1) * d + d // 2} <= flats


# KernelBench-format controls for the classes of G07 and G11 ------------------------------------------
KB_CONTROLS = [
    # file, the gate built to catch it (None: a correct kernel), the verdict kind it must give
    ("fp16_running_total", "G07", "bound"),
    ("fp16_cumsum_carry", "G07", "bound"),
    ("cached_first", "G11", "stale"),
    ("correct_sum", None, None),
    ("correct_cumsum", None, None),
]


@pytest.mark.parametrize("stem, gate, kind", KB_CONTROLS, ids=[r[0] for r in KB_CONTROLS])
def test_kernelbench_controls_fail_their_gate_and_correct_ones_pass(stem, gate, kind):
    from pathlib import Path
    from kfuzz.kernelbench import read_corpus
    from kfuzz.kernelbench import as_target
    folder = Path(__file__).resolve().parents[1] / "harnesses" / "kernelbench_controls"
    entry = next(e for e in read_corpus(folder) if e.key.endswith(":" + stem))
    t = as_target(entry.pair)
    for gid in ("G07", "G11"):
        r = run_gate(GATES[gid], t, seed=0)
        if gid == gate:
            assert r.status == "fail" and r.first_failure[1].kind == kind, r.reason
        elif gate is None:
            assert r.status == "pass", (gid, r.reason)
    if stem == "fp16_cumsum_carry":     # the carry goes wrong past 2048 only: the long cases catch it
        assert "exact 2050.0" in run_gate(GATES["G07"], t, seed=0).reason


def test_g10_and_g11_cases_reach_odd_sizes_and_shared_elements():
    t = get_target("rmsnorm")
    dims = [c.dim for c in GATES["G10"].cases(t, 0)]
    assert {"N": 13, "D": 67} in dims and {"N": 7, "D": 131} in dims
    kept = [c for c in GATES["G11"].cases(t, 0) if c.args]
    assert {a.inject[0][0] for c in kept for n, a in c.args if n == "x"} == {0, 16 * 64 // 2, 16 * 64 - 1}


@pytest.mark.triton_on_cpu
def test_bench_gates_puts_each_call_in_its_own_column(capsys):
    """tools/bench_gates.py: a kernel that sleeps shows its time in the kernel column, the
    columns add up to the gate's total, and the bare share is the calls' part of it."""
    spec = importlib.util.spec_from_file_location(
        "bench_gates", Path(__file__).resolve().parents[1] / "tools" / "bench_gates.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    base = get_target("softmax")

    def slow(**inputs):
        time.sleep(0.05)
        return base.kernel(**inputs)

    seconds, calls = Counter(), Counter()
    target = bench.timed(dataclasses.replace(base, kernel=slow), seconds, calls)
    result = run_gate(GATES["G01"], target, seed=0)
    assert result.status == "pass" and calls["kernel"] >= result.cases > 0
    assert seconds["kernel"] >= 0.05 * calls["kernel"]
    assert calls["oracle"] > 0 and calls["trusted"] > 0      # the reference, told apart by its dtype
    assert bench.main(["softmax", "--gates", "G01", "--device", "cpu"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| G01 "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    total, kernel, oracle, trusted, judging, share = map(float, cells[3:9])
    # every number is printed rounded to 0.005: the checks allow that much on each
    assert kernel + oracle + trusted + judging == pytest.approx(total, abs=0.025)
    bare = kernel + oracle + trusted
    assert share == pytest.approx(bare / total, abs=0.005 + (0.015 + 0.005 * bare / total) / total)


def test_bench_gates_profile_lists_the_functions_with_the_most_time_of_their_own(capsys):
    """tools/bench_gates.py --profile N: after the gate's row, N functions from cProfile, by
    their own time, the first no faster than the next."""
    spec = importlib.util.spec_from_file_location(
        "bench_gates", Path(__file__).resolve().parents[1] / "tools" / "bench_gates.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["softmax", "--gates", "G01", "--device", "cpu", "--profile", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("| G01 "))
    assert out[at + 2].startswith("The 4 functions with the most time of their own")
    header = out.index("```", at) + 1
    assert out[header].split()[:3] == ["ncalls", "tottime", "percall"]
    rows = out[header + 1:out.index("```", header)]
    assert len(rows) == 4
    own = [float(r.split()[1]) for r in rows]
    assert own == sorted(own, reverse=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the oracle runs where the kernel ran")
def test_the_gates_run_the_oracle_and_the_trusted_implementation_where_the_kernel_ran_on_cuda():
    """Each value and call gate whose kernel ran on a GPU runs the float64 oracle and the trusted
    implementation there too (as a campaign's judges and G12 do), not on the CPU: every call of
    the reference sees tensors on the GPU."""
    from kfuzz.executor import InProcess
    base = get_target("softmax")
    seen = []

    def reference(**inputs):
        seen.append({t.device.type for t in inputs.values() if isinstance(t, torch.Tensor)})
        return base.reference(**inputs)
    target = dataclasses.replace(base, reference=reference)
    results = run_gates(target, ["G01", "G04", "G05", "G06", "G10", "G11"], device="cuda",
                        executor=InProcess(target, "cuda"))
    assert all(r.status != "error" for r in results), [(r.gate, r.reason) for r in results]
    assert seen and all(s == {"cuda"} for s in seen), seen


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: its memory runs out")
def test_a_case_whose_oracle_does_not_fit_the_gpu_is_judged_on_the_cpu_on_cuda():
    """Where the oracle's side runs out of the GPU's memory in kfuzz's process, the gate judges
    the case again with it on the CPU: a verdict, not a gate that could not run."""
    from kfuzz.executor import InProcess
    base = get_target("softmax")

    def reference(**inputs):
        if any(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs.values()):
            raise torch.OutOfMemoryError("CUDA out of memory (planted)")
        return base.reference(**inputs)
    target = dataclasses.replace(base, reference=reference)
    (result,) = run_gates(target, ["G01"], device="cuda", executor=InProcess(target, "cuda"))
    assert result.status == "pass" and result.cases > 0, (result.status, result.reason)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gates_comparisons_on_the_gpu_give_the_cpus_statuses_on_cuda(monkeypatch):
    """With every comparison on the GPU where the oracle ran there (the threshold set to one
    element), G01, G05 and G12 give a correct softmax (in torch, so that it runs on either
    device) and one that turns NaN into 0 the statuses they give on the CPU."""
    import kfuzz.execute
    from kfuzz.executor import InProcess
    base = get_target("hacks.honest_softmax")
    quiet = dataclasses.replace(base, kernel=lambda **a: torch.nan_to_num(base.kernel(**a)))
    monkeypatch.setattr(kfuzz.execute, "COMPARE_ON_DEVICE_MIN", 1)
    for target, want in ((base, ["pass", "pass", "pass"]), (quiet, [None, "fail", None])):
        on = {d: [r.status for r in run_gates(target, ["G01", "G05", "G12"], device=d, executor=InProcess(target, d))]
              for d in ("cpu", "cuda")}
        assert on["cuda"] == on["cpu"], on
        assert all(w is None or w == got for w, got in zip(want, on["cuda"])), on


def _float8_target(kernel):
    from kfuzz.target import Arg, Dim, Output, Target
    return Target(name="double8", kernel=kernel, reference=lambda x: x * 2, args={"x": Arg(shape=("N",))},
                  outputs={"out": Output(shape=("N",))}, dims={"N": Dim(1, 64)},
                  dtypes=("float8_e4m3fn", "float8_e5m2"))


@pytest.fixture
def float8_without_predicates(monkeypatch):
    """torch as releases without ``isfinite``, ``isnan`` and ``isinf`` for float8 have it
    (torch 2.11 on the CPU): each raises NotImplementedError on a one-byte float tensor."""
    for name in ("isfinite", "isnan", "isinf"):
        def refuses(x, *a, _torch=getattr(torch, name), _name=name, **kw):
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.element_size() == 1:
                raise NotImplementedError(f'"{_name}" not implemented for {x.dtype}')
            return _torch(x, *a, **kw)
        monkeypatch.setattr(torch, name, refuses)


def test_a_float8_target_is_judged_by_every_gate(float8_without_predicates):
    """float8 inputs and outputs (which torch cannot compare, reduce or promote on the CPU, and
    in some releases cannot test for NaN or Inf) are judged as any others: a correct kernel
    passes every gate, one that maps NaN to 0 fails G05, one that adds 1 fails G01 on its bound,
    and one whose calls differ is measured against its reference's own spread in G08."""
    right = _float8_target(lambda x: (x.float() * 2).to(x.dtype))
    for gid, gate in GATES.items():
        r = run_gate(gate, right, seed=0)
        assert r.status == "pass", (gid, r.reason)
    drops_nan = _float8_target(lambda x: torch.nan_to_num(x.float() * 2, nan=0.0).to(x.dtype))
    r = run_gate(GATES["G05"], drops_nan, seed=0)
    assert r.status == "fail" and r.first_failure[1].kind == "nonfinite", r.reason
    adds_one = _float8_target(lambda x: (x.float() * 2 + 1).to(x.dtype))
    r = run_gate(GATES["G01"], adds_one, seed=0)
    assert r.status == "fail" and r.first_failure[1].kind == "bound", r.reason
    calls = iter(range(1 << 30))
    wobbly = _float8_target(lambda x: (x.float() * 2 * (1 + 0.25 * (next(calls) % 2))).to(x.dtype))
    limited = dataclasses.replace(wobbly, trusted=wobbly.kernel, options={"reference_limited": True})
    for t, status in ((wobbly, "fail"), (limited, "pass")):
        r = run_gate(GATES["G08"], t, seed=0)
        assert r.status == status, (status, r.reason)


def _wobbly(scale):
    """A sum whose last bits change from call to call (every other call scales by 1 + scale),
    as a nondeterministic reduction's do."""
    calls = iter(range(1 << 30))
    return lambda x: x.sum(dim=-1) * (1 + scale * (next(calls) % 2))


@pytest.mark.parametrize("kernel_scale, trusted_scale, limited, status", [
    (2 ** -22, 2 ** -22, True, "pass"),      # as unrepeatable as the reference itself: reference-limited
    (2 ** -10, 2 ** -22, True, "fail"),      # far past what the reference's own runs differ by
    (2 ** -22, 0.0, True, "fail"),           # the reference repeats bitwise: the kernel's own nondeterminism
    (2 ** -22, 2 ** -22, False, "fail"),     # a target that does not judge against its reference's float32
], ids=["as-the-reference", "beyond-it", "reference-repeats", "not-reference-limited"])
def test_g08_excuses_only_the_nondeterminism_the_reference_itself_shows(kernel_scale, trusted_scale, limited,
                                                                         status):
    from kfuzz.target import Arg, Dim, Output, Target
    t = Target(name="wobbly_sum", kernel=_wobbly(kernel_scale), reference=lambda x: x.sum(dim=-1),
               trusted=_wobbly(trusted_scale), args={"x": Arg(("N", "D"))}, outputs={"out": Output(("N",))},
               dims={"N": Dim(1, 8), "D": Dim(1, 64)}, dtypes=("float32",),
               options={"reference_limited": True} if limited else {})
    gate = GATES["G08"]
    v = gate.check(t, next(iter(gate.cases(t, 0))))
    assert v.passed == (status == "pass"), v.detail
    if status == "pass":
        assert v.detail.startswith("reference-limited: calls on the same inputs differ"), v.detail
    else:
        assert v.kind == "nondeterminism"
        assert ("the reference in float32 differs run to run too" in v.detail) == (limited and trusted_scale > 0)


def _transposed_as_contiguous(x):
    """Reads a transposed input's memory as if it were contiguous (strides and offsets handled)."""
    if x.dim() == 2 and x.stride() == (1, x.shape[0]):
        return torch.as_strided(x, x.shape, (x.shape[1], 1), x.storage_offset())
    return x


@pytest.mark.parametrize("kernel, status, values_wrong", [
    (lambda x: torch.relu(_transposed_as_contiguous(x) - 5), "fail", False),   # the layout misread
    (lambda x: torch.relu(x.half().float() - 5), "pass", True),   # right layouts, half-precision values
    (lambda x: torch.relu(x.contiguous() - 5), "pass", False),
], ids=["misreads-a-transpose", "half-precision", "correct"])
def test_g04_draws_each_layout_again_where_the_nominal_draw_leaves_the_output_constant(kernel, status,
                                                                                     values_wrong):
    """relu(x - 5) is 0 almost everywhere on normal inputs: a kernel that misreads a transposed
    input passes every nominal layout case. G04's wide draw (100 times the spread) shows it; a
    kernel whose layouts are right and whose values are not (G02's finding) passes G04, saying so."""
    from kfuzz.target import Arg, Dim, Output, Target
    t = Target(name="relu_shift", kernel=kernel, reference=lambda x: torch.relu(x - 5),
               args={"x": Arg(("N", "D"))}, outputs={"out": Output(("N", "D"))},
               dims={"N": Dim(1, 64), "D": Dim(1, 64)}, dtypes=("float32",))
    gate = GATES["G04"]
    verdicts = [(c, gate.check(t, c)) for c in gate.cases(t, 0)]
    nominal = [v for c, v in verdicts if c.arg("x").dist == Dist()]
    wide = [(c, v) for c, v in verdicts if c.arg("x").dist != Dist()]
    assert all(v.passed for v in nominal)                 # the nominal draw shows nothing
    assert len(wide) == 1 and wide[0][0].arg("x").layout.kind == "permuted"
    assert wide[0][1].passed == (status == "pass"), wide[0][1].detail
    assert (wide[0][1].detail or "").startswith("outside the layouts: the same values laid out contiguously "
                                                "fail too") == values_wrong
    assert run_gate(gate, t, seed=0).status == status


def test_a_gate_case_whose_minimizing_raises_is_kept_as_found_and_says_why(tmp_path, monkeypatch):
    """The audit keeps a failing gate's case minimized by the gate's own check (here G05's on a
    planted NaN-to-zero kernel: fewer dims, and it replays); where judging a candidate raises,
    the case found is kept, its record names the error, and it still replays to the failure."""
    import kfuzz.minimize
    from kfuzz.audit import save_gate_case
    from kfuzz.corpus import load
    target = get_target("layernorm.nan2zero")
    r = run_gate(GATES["G05"], target, seed=0)
    case, verdict = r.first_failure
    got = save_gate_case(tmp_path / "a", target, "G05", case, verdict, "cpu", 0, executor=None)
    small, record = load(got["case_file"])
    assert got["minimized"] is True and sum(small.dim.values()) < sum(case.dim.values()), (small.dim, case.dim)
    assert replay_gate_case(got["case_file"])[0]

    def boom(*args, **kwargs):
        raise RuntimeError("the oracle raised on a candidate")
    monkeypatch.setattr(kfuzz.minimize, "minimize_failure", boom)
    kept = save_gate_case(tmp_path / "b", target, "G05", case, verdict, "cpu", 0, executor=None)
    found, record = load(kept["case_file"])
    assert kept["minimized"] is False and found == case, kept
    assert "RuntimeError: the oracle raised on a candidate" in record["minimize"]["error"], record
    assert replay_gate_case(kept["case_file"])[0]
