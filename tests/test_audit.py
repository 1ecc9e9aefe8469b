"""The KernelBench adapter and the audit: controls caught, corpus rows as recorded, resumable."""
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import re
import signal
import textwrap
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kfuzz.audit import append_record, done_keys, judge_record, run_audit
import kfuzz.cli.audit  # noqa: F401  (registers the verb)
from kfuzz.cli import cli
from kfuzz.errors import KfuzzError
from kfuzz.kernelbench import (KernelBenchError, WeightsContractError, as_target, infer_contract, load_pair,
                               load_weights, pair_module, read_corpus, size_constants, standard_test)
from kfuzz.kernelbench.build import fell_back
from kfuzz.kernelbench.source import derived_sizes

ROOT = Path(__file__).resolve().parents[1]
CONTROLS = ROOT / "harnesses" / "kernelbench_controls"
CORPORA = ROOT.parent / "shared" / "corpora"
CI_ROWS = ROOT / "reports" / "audit" / "ci_rows.json"
ESCAPES = ROOT / "harnesses" / "kernelbench_hacks" / "escapes"


@pytest.fixture(autouse=True)
def audit_key(tmp_path_factory, monkeypatch):
    """Every test signs and verifies results with a key of its own, outside its results folder."""
    path = tmp_path_factory.mktemp("key") / "audit.key"
    monkeypatch.setenv("KFUZZ_AUDIT_KEY", str(path))
    return path


@pytest.fixture(scope="session")
def probe_marker(tmp_path_factory):
    """kfuzz's probe extension built once a test run (``check_build_step``, no precompiled
    header), for all of the run's xdist workers (the first to need it builds it under a lock,
    the others find its marker): the marker that says so, for tests about solutions' builds
    rather than the probe's."""
    import fcntl
    import shutil
    from kfuzz.audit import check_build_step
    if not (shutil.which("ninja") and shutil.which("c++")):
        pytest.skip("no ninja or C++ compiler here: load_inline cannot build")
    run = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run = run.parent            # the run's folder, one for all of its workers
    cache = run / "probed"
    cache.mkdir(exist_ok=True)
    with open(run / "probed.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        check_build_step("cpu", cache)      # at once where the marker is there
    (marker,) = cache.glob("probe-built-*")
    return marker


def probed(cache: Path, marker: Path) -> Path:
    """``cache``, made, holding the session's probe marker: the audit builds no probe there."""
    import shutil
    cache.mkdir(parents=True, exist_ok=True)
    shutil.copy(marker, cache / marker.name)
    return cache


def control(stem):
    return next(e for e in read_corpus(CONTROLS) if e.key.endswith(":" + stem))


def test_load_pair_refuses_sources_it_cannot_use():
    ref = (CONTROLS / "reference_sum.py").read_text()
    with pytest.raises(KernelBenchError, match="defines no ModelNew"):
        load_pair(ref, "import torch\n", "p")
    with pytest.raises(KernelBenchError, match="does not parse"):
        load_pair("def (:\n", "class ModelNew: pass\n", "p")
    with pytest.raises(KernelBenchError, match="get_init_inputs"):
        load_pair("class Model: pass\ndef get_inputs(): return []\n", "class ModelNew: pass\n", "p")


def test_size_constants_become_dims_with_symbolic_shapes():
    pair = control("correct_linear").pair
    assert size_constants(pair.ref_code) == {"batch_size": 16, "in_features": 256, "out_features": 128}
    c = infer_contract(pair)
    # out_features sizes no input: it stays fixed; the others size x directly
    assert c.arg_shapes == (("batch_size", "in_features"),) and c.fixed == ("out_features",)
    t = as_target(pair)
    assert t.shape_of(t.outputs["out"].shape, {"batch_size": 3, "in_features": 5}) == (3, 128)


def test_standard_test_accepts_what_the_gates_reject():
    # the planted bugs pass the standard test (that is the point of the audit) ...
    for stem in ("zeros_under_tolerance", "fp16_accumulation", "drops_nan"):
        v = standard_test(control(stem).pair)
        assert v.passed and v.trials == 5, (stem, v)
    # ... and a wrong kernel at the fixed shape does not
    pair = control("skips_tail").pair
    broken = load_pair(pair.ref_code, pair.custom_code.replace("// 256 * 256", "// 512 * 256"), "wrong")
    v = standard_test(broken)
    assert not v.passed and v.reason.startswith("mismatch")


SHARED_NAMES_REF = """import torch
import torch.nn as nn


def scale_of(n):
    return 1.0 / n


class Model(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features))
        self.register_buffer("h", torch.zeros(batch_size, features))

    def forward(self, x):
        return x * self.weight * scale_of(x.shape[-1]) + self.h


batch_size = 8
features = 32


def get_inputs():
    return [torch.randn(batch_size, features)]


def get_init_inputs():
    return [features]
"""


def test_a_solution_reads_the_references_names_as_the_accepting_harness_ran_it():
    """KernelBench executes the reference and then the solution into one namespace, so a
    solution that reads the reference's size constant and helper without defining them was
    accepted. It passes the standard test and G03 here too, with the reference's constant sized
    along in the solution's module; without them it raises NameError."""
    from kfuzz.gates import GATES, run_gate
    solution = SHARED_NAMES_REF.split("\n\n\nbatch_size")[0].replace("class Model(", "class ModelNew(").replace(
        "def scale_of(n):\n    return 1.0 / n\n", "")
    assert "batch_size = " not in solution and "def scale_of" not in solution
    pair = load_pair(SHARED_NAMES_REF, solution, "shared_names")
    v = standard_test(pair)
    assert v.passed and v.trials == 5, v
    r = run_gate(GATES["G03"], as_target(pair), seed=0)
    assert r.status == "pass" and r.cases > 3, r.reason


def test_weights_are_loaded_strictly():
    ref = pair_module(control("drops_bias").pair, "ref").Model(8, 4)
    dropped = pair_module(control("drops_bias").pair, "new").ModelNew(8, 4)
    with pytest.raises(WeightsContractError, match="missing"):
        load_weights(dropped, ref)
    renamed = pair_module(control("correct_linear").pair, "new").ModelNew(8, 4)
    assert load_weights(renamed, ref) == "by position"
    assert torch.equal(renamed.w, ref.linear.weight)


def test_resumable_results(tmp_path):
    entries = [control("correct_sum"), control("drops_nan")]
    first = list(run_audit(entries, tmp_path, ["G05"], jobs=2, timeout=120))
    assert {r["key"] for r in first} == {e.key for e in entries}
    assert list(run_audit(entries, tmp_path, ["G05"], jobs=2)) == []      # all done: nothing rerun
    with open(tmp_path / "results.jsonl", "a") as f:
        f.write('{"key": "torn')                                            # a write cut short
    assert done_keys(tmp_path) == {e.key for e in entries}
    append_record(tmp_path, {**first[0], "ended": "timeout"})
    assert done_keys(tmp_path, retry=True) == {e.key for e in entries} - {first[0]["key"]}
    # a complete record, audited again when named
    (again,) = run_audit(entries, tmp_path, ["G05"], jobs=2, timeout=120, redo=[first[1]["key"]])
    assert again["key"] == first[1]["key"]


def test_kernels_audited_before_start_first_the_slowest_first(tmp_path):
    """A retry starts the kernels it audits again before those never audited, the slowest (its
    last record's seconds) first, so that a run cut short spends its time where it is needed;
    the others keep the corpora's order. One kernel at a time: records come in start order."""
    entries = [control("correct_sum"), control("drops_nan"), control("correct_linear")]
    keys = [e.key for e in entries]
    for key, seconds in ((keys[0], 40.0), (keys[1], 90.0)):      # both killed for time before
        append_record(tmp_path, {"key": key, "gates": {}, "standard": {"passed": True, "reason": "pass"},
                                 "ended": "timeout", "phase": "gates", "seconds": seconds})
    got = [r["key"] for r in run_audit(entries, tmp_path, ["G05"], jobs=1, timeout=120, retry=True)]
    assert got == [keys[1], keys[0], keys[2]], got


def test_audit_cli_refuses_a_missing_corpus(tmp_path):
    r = CliRunner().invoke(cli, ["audit", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path)])
    assert r.exit_code == 2 and "no such corpus" in r.output


def test_audit_cli_refuses_to_redo_a_kernel_not_in_its_corpora(tmp_path):
    r = CliRunner().invoke(cli, ["audit", str(CONTROLS), "--redo", "kernelbench_controls:nope", "--out",
                                 str(tmp_path / "out")])
    assert r.exit_code == 2 and "--redo kernelbench_controls:nope: no such kernel" in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_audit_cli_redoes_the_keys_of_a_file(tmp_path, monkeypatch):
    """--redo @FILE: the keys listed in FILE, whitespace-separated, beside keys given one by one;
    a file that cannot be read, or a key in it not in the corpora, is bad input."""
    asked = {}

    def run_audit(entries, out, gates, **kw):
        asked.update(kw)
        return (record for record in ())
    monkeypatch.setattr("kfuzz.audit.run_audit", run_audit)
    (tmp_path / "keys").write_text("kernelbench_controls:drops_nan\n  kernelbench_controls:skips_tail\n")
    args = ["audit", str(CONTROLS), "--out", str(tmp_path / "out"), "--device", "cpu"]
    r = CliRunner().invoke(cli, args + ["--redo", f"@{tmp_path / 'keys'}", "--redo", "kernelbench_controls:drops_bias"])
    assert sorted(asked["redo"]) == [f"kernelbench_controls:{k}" for k in
                                                          ("drops_bias", "drops_nan", "skips_tail")], (r.output, asked)
    r = CliRunner().invoke(cli, args + ["--redo", f"@{tmp_path / 'none'}"])
    assert r.exit_code == 2 and "cannot read the file of keys" in r.output, r.output
    (tmp_path / "keys").write_text("kernelbench_controls:nope")
    r = CliRunner().invoke(cli, args + ["--redo", f"@{tmp_path / 'keys'}"])
    assert r.exit_code == 2 and "no such kernel" in r.output, r.output


def test_an_audit_redoes_each_unsigned_record_once(tmp_path, audit_key):
    """redo_unsigned (--redo-unsigned): a kernel whose record carries no HMAC (an older kfuzz's)
    is audited again, and its new record, signed, ends that: a second run redoes nothing."""
    from kfuzz.audit import RESULTS, read_results
    entry = control("correct_sum")
    out = tmp_path / "out"
    out.mkdir()
    old = {"key": entry.key, "expect": entry.expect, "standard": {"passed": True, "reason": "pass"},
           "gates": {"G05": {"status": "fail", "kind": "nonfinite"}}}
    (out / RESULTS).write_text(json.dumps(old) + "\n")
    run = dict(gates=["G05"], trust_unsigned=True, allow_unconfined=True, timeout=120)
    assert list(run_audit([entry], out, **run)) == []                  # taken as recorded
    redone = list(run_audit([entry], out, redo_unsigned=True, **run))
    assert [r["key"] for r in redone] == [entry.key] and redone[0]["gates"]["G05"]["status"] == "pass"
    assert read_results(out / RESULTS, trust_unsigned=True).unsigned_keys == set()
    assert list(run_audit([entry], out, redo_unsigned=True, **run)) == []


def test_ci_audit_controls_and_cpu_rows(tmp_path):
    """The CPU-runnable CUDA-L1 rows named in reports/audit/ci_rows.json end as recorded there, and
    every control ends as planted (each kernel in its own sandboxed process)."""
    spec = json.loads(CI_ROWS.read_text())
    entries = read_corpus(CONTROLS)
    corpus = CORPORA / spec["corpus"]
    if corpus.is_file():
        digest = hashlib.sha256(corpus.read_bytes()).hexdigest()
        assert digest == spec["sha256"], f"{corpus} changed (sha256 {digest}); re-measure reports/audit/ci_rows.json"
        entries += [e for e in read_corpus(corpus) if e.key.rsplit(":", 1)[1] in spec["rows"]]
    records = list(run_audit(entries, tmp_path, spec["gates"], jobs=2, timeout=60))
    assert len(records) == len(entries)
    for r in records:
        j = judge_record(r)
        assert not r.get("ended") and all(g["status"] != "error" for g in r["gates"].values()), r["key"]
        if r["expect"] is not None:
            # G01, G05, G11 and the weights contract catch every planted bug on their own
            assert j["violation"] == (r["expect"] != "none"), (r["key"], j)
            assert r["standard"]["passed"], r["key"]
        else:
            row = r["key"].rsplit(":", 1)[1]
            want = spec["rows"][row]
            # a gate whose outcome follows the hidden seed (``seed_dependent``) is not pinned
            free = set(spec.get("seed_dependent", {}).get(row, {}).get("gates", ()))
            got = [v for v in j["violations"] if v not in free]
            pinned = [v for v in want["violations"] if v not in free]
            assert (j["standard"], got) == (want["standard"], pinned), r["key"]
    if not corpus.is_file():
        pytest.skip(f"controls audited; {corpus} is absent (the corpora are not in the repo), "
                    f"so the {len(spec['rows'])} CUDA-L1 rows were not")


def test_a_worker_finds_a_pair_by_name():
    """kb:<corpus>:<row> names resolve in any process: the gates' CLI and a sandboxed worker."""
    from kfuzz.execute import judge
    from kfuzz.gates.base import make_case, nominal_dims
    from kfuzz.target import get_target
    from kfuzz.tensors import materialize
    from kfuzz.executor import WorkerPool
    t = get_target(f"kb:{CONTROLS}:skips_tail")
    pool = WorkerPool(t, jobs=1)
    try:
        case = make_case(t, "float32", 1, nominal_dims(t))
        pool.submit(case)
        (r,) = list(pool.results())
        assert r.verdict is None and judge(case, t, materialize(case, t), r.outputs).kind == "bound"
    finally:
        pool.close()


def test_a_worker_whose_target_does_not_load_says_why_and_a_full_gpu_reads_as_memory(tmp_path):
    """A worker resolves its ``kb:`` target itself (the reference run at its sizes); where that
    raises, the worker's start fails with the error's own words, not a bare exit code, so that a
    GPU's memory taken by other kernels (a reference run out of it) is read as a memory failure
    (``sandbox.resource_kind``: the audit runs such a kernel again, alone)."""
    from kfuzz import sandbox
    from kfuzz.workers import Worker
    folder = tmp_path / "controls"
    folder.mkdir()
    (folder / "reference_full.py").write_text((CONTROLS / "reference_relu.py").read_text().replace(
        "        return torch.relu(x)",
        "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')"))
    (folder / "relu.py").write_text("# reference: reference_full.py\nimport torch\nimport torch.nn as nn\n\n\n"
                                    "class ModelNew(nn.Module):\n    def forward(self, x):\n"
                                    "        return torch.relu(x)\n")
    with pytest.raises(RuntimeError) as failed:
        Worker(f"kb:{folder}:relu", None, "cpu", False, sandbox.Policy(), resolve={"weights": "seed"})
    said = str(failed.value)
    assert "could not load its target" in said and "CUDA out of memory" in said, said
    assert sandbox.resource_kind(type(failed.value).__name__, said) == sandbox.MEMORY


def test_a_solution_that_does_not_construct_has_no_weights_contract_to_judge(tmp_path):
    """ModelNew(*get_init_inputs()) raises (a name the solution never defined): its standard test
    fails at init and every gate on the exception; the weights contract has nothing to load into,
    so it is n/a saying why, not a check of kfuzz's that could not run (``error``)."""
    from kfuzz.audit import audit_kernel, weights_failures
    from kfuzz.kernelbench import read_corpus
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "reference_relu.py").write_text((CONTROLS / "reference_relu.py").read_text())
    (folder / "undefined.py").write_text("# reference: reference_relu.py\nimport torch\nimport torch.nn as nn\n\n\n"
                                         "class ModelNew(nn.Module):\n    def __init__(self):\n"
                                         "        super().__init__()\n        self.n = batch\n\n"
                                         "    def forward(self, x):\n        return torch.relu(x)\n")
    (entry,) = [e for e in read_corpus(folder) if e.key.endswith("undefined")]
    got = {}
    audit_kernel(entry, "cpu", ["G01"], 0, lambda kind, d: got.setdefault(kind, []).append(d), timeout=120)
    assert got["standard"][0]["reason"].startswith("init: NameError"), got["standard"]
    (weights,) = got["weights"]
    assert weights["status"] == "n/a" and "NameError" in weights["detail"], weights
    assert weights_failures({"weights": weights}) == []
    assert got["gate"][0]["status"] == "fail" and got["gate"][0]["kind"] == "exception", got["gate"]


# the standard test's report and its side effects ----------------------------------------------

IDENTITY_REF = """import torch
import torch.nn as nn
n = 8
class Model(nn.Module):
    def forward(self, x):
        return x * 1.0
def get_inputs():
    return [torch.randn(n)]
def get_init_inputs():
    return []
"""


def identity_pair(forward: str, name: str):
    """A tiny KernelBench pair: the identity as reference, ``forward`` as the solution's body."""
    new = f"import torch\nimport torch.nn as nn\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        {forward}\n"
    return load_pair(IDENTITY_REF, new, name)


@pytest.mark.parametrize("forward, passed, diff", [
    ("return x.clone()", True, 0.0),
    ("return x + 0.5", False, 0.5),
    ("return torch.full_like(x, float('nan'))", False, "nan"),          # was reported as 0
    ("y = x.clone(); y[3] = float('nan'); return y + 0.5", False, "nan"),
])
def test_standard_test_reports_nan_as_the_max_abs_diff(forward, passed, diff):
    v = standard_test(identity_pair(forward, f"diff/{forward}"))
    assert v.passed == passed, v
    if diff == "nan":
        assert v.max_abs_diff != v.max_abs_diff and "max abs diff nan" in v.reason, v
        assert v.to_json()["max_abs_diff"] == "nan"      # plain JSON: no bare NaN token
    else:
        assert v.max_abs_diff == pytest.approx(diff, abs=1e-6), v


def test_the_standard_tests_difference_is_measured_a_chunk_at_a_time_with_the_same_value(monkeypatch):
    """The max abs diff folds float64 chunks of the outputs (``compare.largest``: kfuzz's own
    measurement holds no float64 copy of a whole output, which at a KernelBench problem's nominal
    size can pass a GPU's memory): a NaN or the largest difference in any chunk, equal
    infinities and a strided output give the value the whole-output formula gives."""
    import kfuzz.compare
    from kfuzz.kernelbench import standard

    def whole(g, e):
        g, e = g.double(), e.double()
        return float(torch.where(g == e, 0.0, (g - e).abs()).max())
    monkeypatch.setattr(kfuzz.compare, "BOUND_CHUNK", {"cpu": 7})
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(10, 9, generator=gen)
    g = e + 1e-3 * torch.randn(10, 9, generator=gen)
    g[8, 4] += 0.25                                     # the largest difference, in a late chunk
    g[0, 0] = e[0, 0] = float("inf")                    # equal infinities differ by 0
    assert standard._max_abs_diff(g, e) == pytest.approx(whole(g, e)) == pytest.approx(0.25, abs=1e-2)
    assert standard._max_abs_diff(g.t(), e.t()) == standard._max_abs_diff(g, e)     # strided
    g[5, 3] = float("nan")                              # a NaN in a middle chunk, smaller ones after
    assert math.isnan(standard._max_abs_diff(g, e)) and math.isnan(whole(g, e))
    assert standard._max_abs_diff(g[:0], e[:0]) == 0.0


def test_standard_test_restores_what_the_solution_patched():
    from kfuzz.contract import NamespaceSnapshot
    original = torch.allclose
    pair = identity_pair("torch.allclose = lambda *a, **k: True\n        return x * 0", "patches/allclose")
    snapshot = NamespaceSnapshot()
    try:
        v = standard_test(pair)
        patched_after = torch.allclose is not original
    finally:
        snapshot.undo()                 # whatever happens, the rest of the suite gets torch back
    # the original harness is fooled by the patched allclose, and so is its replica ...
    assert v.passed, v
    # ... but torch is whole again once it returns, and the verdict names what was undone
    assert not patched_after
    assert v.undone == ("torch.allclose",), v


# gate cases of kb: targets on disk -------------------------------------------------------------

def test_a_kb_target_saves_its_cases_in_one_folder_and_replays_them(tmp_path):
    """A kb: name holds '/' and ':'; its corpus folder is one path component, and replay finds
    the target from the case's own target field."""
    from kfuzz.corpus import SUFFIX, Corpus, target_folder
    from kfuzz.gates import GATES, replay_gate_case, run_gate
    from kfuzz.target import get_target
    for name in ("kb:/a/b.jsonl:3", "kb:..:x", "..", ".", "a%2Fb", "a/b", "C:\\x"):
        folder = target_folder(name)
        assert folder and "/" not in folder and "\\" not in folder and ":" not in folder
        assert folder not in (".", "..") and not folder.startswith(".")
    assert len({target_folder(n) for n in ("a/b", "a%2Fb", "a:b", "a_b", "a%3Ab")}) == 5    # unambiguous
    assert [target_folder(n) for n in ("gdn_bwd", "hacks.patch_allclose")] == ["gdn_bwd", "hacks.patch_allclose"]
    assert len(target_folder("kb:" + "/x" * 400 + ":1")) <= 200
    target = get_target(f"kb:{CONTROLS}:drops_nan")
    r = run_gate(GATES["G05"], target, seed=0, out=tmp_path)
    assert r.status == "fail" and r.saved, r.reason
    crashes = tmp_path / "gates" / "G05" / "crashes"
    for path in r.saved:
        rel = path.relative_to(crashes).parts
        assert len(rel) == 3 and rel[0] == target_folder(target.name) and rel[2].endswith(SUFFIX), rel
        assert Corpus(tmp_path / "gates" / "G05").has_open_failure(load_signature(path))
        ok, verdict, message = replay_gate_case(path)
        assert ok and verdict.target == target.name, message


def load_signature(path):
    from kfuzz.corpus import load
    from kfuzz.verdict import Signature
    return Signature.from_json(load(path)[1]["signature"])


# the oracle's process and the kernel's --------------------------------------------------------

def test_the_oracle_process_never_runs_the_solution():
    """audit_kernel runs here, as in a kernel's oracle process: the verdicts come, and the
    solution's source was never executed here (the standard test, the weights contract and the
    gates' kernel programs ran in sandboxed workers); the oracle-side target refuses to call it."""
    from kfuzz.audit import audit_kernel
    from kfuzz.kernelbench import source
    entry = control("skips_tail")
    got = {}
    audit_kernel(entry, "cpu", ["G01"], 0, lambda kind, d: got.setdefault(kind, []).append(d), timeout=120)
    assert got["standard"][0]["passed"] and got["weights"][0]["status"] == "exact"
    assert got["gate"][0]["status"] == "fail" and got["gate"][0]["kind"] == "bound"
    assert set(got["gate"][0]["failing_kinds"]) == {"bound"}
    assert sum(got["gate"][0]["failing_kinds"].values()) == got["gate"][0]["failures"]
    assert (entry.pair.sha, "new") not in source._MODULES
    target = as_target(entry.pair, weights="seed", solution=False)
    with pytest.raises(KernelBenchError, match="runs only in a sandboxed worker"):
        target.kernel(x=torch.ones(2, 3))
    assert (entry.pair.sha, "new") not in source._MODULES


SEGFAULT_ON_NAN = """# reference: reference_relu.py
# planted: segfaults when its input holds a NaN
import ctypes
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        if torch.isnan(x).any():
            ctypes.string_at(0)
        return torch.relu(x)
"""


def test_a_kernel_that_dies_in_a_gate_gets_that_gates_crash_and_the_audit_goes_on(tmp_path):
    folder = tmp_path / "controls"
    folder.mkdir()
    (folder / "reference_relu.py").write_text((CONTROLS / "reference_relu.py").read_text())
    (folder / "segfault_on_nan.py").write_text(SEGFAULT_ON_NAN)
    (rec,) = run_audit(read_corpus(folder), tmp_path / "out", ["G05", "G01"], timeout=120)
    assert "ended" not in rec and rec["standard"]["passed"]
    assert rec["gates"]["G05"]["status"] == "fail" and rec["gates"]["G05"]["kind"] == "crash"
    assert rec["gates"]["G01"]["status"] == "pass"      # a fresh worker for the next gate
    assert judge_record(rec)["broken"]


# G07 where exactness is by construction --------------------------------------------------------

WIDE_SUM = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x.sum(dim=-1)


batch_size = 8
width = 64 * 64      # not a size constant: the sum always runs over 4096 columns


def get_inputs():
    return [torch.rand(batch_size, width)]


def get_init_inputs():
    return []
"""

FP16_RUNNING_TOTAL = """import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        acc = torch.zeros(x.shape[0], dtype=torch.float16)
        for k in range(x.shape[1]):      # the running total in float16: stalls at 2048
            acc = acc + x[:, k].half()
        return acc.float()
"""


def test_g07_does_not_apply_where_outputs_depend_on_float_weights():
    """correct_linear_blocked (a Linear as a tiled matmul, correct) loses answers that one fused
    sum gets exact only by chance, as the weights are floats the case does not set: G07 would
    fail it, so on a model with float weights G07 is n/a, and the control is clean."""
    from dataclasses import replace
    from kfuzz.gates import GATES, run_gate
    from kfuzz.kernelbench import FLOAT_WEIGHTS, float_weights
    pair = control("correct_linear_blocked").pair
    assert float_weights(pair) == ("linear.weight", "linear.bias")
    target = as_target(pair)
    r = run_gate(GATES["G07"], target, seed=0)
    assert (r.status, r.reason, r.cases) == ("n/a", FLOAT_WEIGHTS, 0)
    # the false positive the rule removes: the same target with G07 applied
    applied = replace(target, options={**target.options, "no_exact_answers": None})
    r = run_gate(GATES["G07"], applied, seed=0)
    assert r.status == "fail" and "exact answers lost" in r.reason, r.reason


def test_g07_still_catches_a_float16_running_total_on_a_parameter_free_reference():
    from kfuzz.gates import GATES, run_gate
    from kfuzz.kernelbench import float_weights
    wrong = load_pair(WIDE_SUM, FP16_RUNNING_TOTAL, "fp16_running_total")
    assert float_weights(wrong) == ()
    r = run_gate(GATES["G07"], as_target(wrong), seed=0)
    assert r.status == "fail" and r.first_failure[1].kind == "bound", r.reason
    assert "kernel 2048.0, exact 4096.0" in r.reason, r.reason       # the sum of 4096 ones
    # ... and the reference's own float32 sum passes with exact answers checked
    right = load_pair(WIDE_SUM, WIDE_SUM.replace("class Model(", "class ModelNew("), "fp32_sum")
    assert run_gate(GATES["G07"], as_target(right), seed=0).status == "pass"


def test_old_records_get_the_float_weights_fact_from_the_corpus_row():
    """A record made before G07 was n/a on float weights says nothing of them: its G07 failure
    counts until the report tool fills ``params`` from the corpus row (the record's sha must
    match); a record whose row is not found stays as recorded, and is counted as unknown."""
    report = audit_report()
    g07 = {"G07": {"status": "fail", "kind": "bound", "worst_ratio": "inf"}}
    recs = [{"key": f"kernelbench_controls:{stem}", "sha": control(stem).pair.sha, "gates": dict(g07),
             "weights": {"status": "exact"}, "standard": {"passed": True},
             "target": f"kb:{CONTROLS}:{stem}"} for stem in ("correct_linear_blocked", "correct_sum")]
    recs.append({**recs[0], "key": "kernelbench_controls:gone", "target": "kb:/nowhere:gone"})
    assert all(judge_record(r)["violations"] == ["G07"] for r in recs)
    counts = report.fill_params(recs, report.CorpusWeights([CONTROLS.parent]))
    assert counts == {"filled_from_corpus": 2, "unknown": 1}
    assert [r["weights"].get("params") for r in recs] == [True, False, None]
    assert [judge_record(r)["violations"] for r in recs] == [[], ["G07"], ["G07"]]
    assert judge_record(recs[0])["g07_not_applicable"] and not judge_record(recs[0])["broken"]
    assert report.summarize(recs)["g07_params_unknown"] == 1


def test_a_bound_failure_whose_gate_also_met_a_non_finite_output_is_not_a_precision_class():
    """The report's arguable classes "only bound failures, <band>" hold kernels whose every
    violation is a rounding difference. A gate's kind is its first failing case's; a later case
    that went non-finite where the oracle is finite (an fp16 cast overflowing) leaves the gate's
    worst ratio infinite, and the kernel is then in no precision class."""
    report = audit_report()

    def rec(worst):
        return {"key": "c:k", "gates": {"G02": {"status": "fail", "kind": "bound", "worst_ratio": worst,
                                                 "verdict": {"metrics": {"out.rel_err": 3e-4}}}}}
    assert report.precision_class(rec(12.5), ["G02"]) == "tf32/fp16-level"
    assert report.precision_class(rec("inf"), ["G02"]) is None
    kept = rec(12.5)                                       # records that keep every failing case's kind
    kept["gates"]["G02"]["failing_kinds"] = {"bound": 3, "nonfinite": 1}
    assert report.precision_class(kept, ["G02"]) is None
    kept["gates"]["G02"]["failing_kinds"] = {"bound": 4}
    assert report.precision_class(kept, ["G02"]) == "tf32/fp16-level"


def test_the_leaderboard_counts_problems_from_zero(tmp_path):
    """KernelBench leaderboard problem_id 0 is CUDA-L1's (and KernelBench's) problem 1: the
    first leaderboard rows of the shipped corpus failed ModelNew(*get_init_inputs()) against
    the reference of the same number (an L2 norm for a LayerNorm solution)."""
    def ref(doc):
        return (f"import torch\nclass Model(torch.nn.Module):\n    # {doc}\n"
                "    def forward(self, x):\n        return x + 1\n"
                "def get_inputs():\n    return [torch.rand(4)]\ndef get_init_inputs():\n    return []\n")
    new = "import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x + 1\n"
    with open(tmp_path / "cuda-l1-x.jsonl", "w") as f:
        for task, doc in ((1, "first"), (2, "second")):
            f.write(json.dumps({"level_id": 1, "task_id": task, "ref_code": ref(doc), "custom_code": None}) + "\n")
    (tmp_path / "board.json").write_text(json.dumps(
        [{"level": 1, "problem_id": 0, "code": new, "model": "m"},
         {"level": 1, "problem_id": 2, "code": new, "model": "m"}]))
    first, beyond = read_corpus(tmp_path / "board.json")
    assert "first" in first.pair.ref_code and first.pair.problem == 1
    assert beyond.pair is None and "no reference" in beyond.skip     # problem 3 has none here


# the results file: signed, forged lines refused -------------------------------------------------

def test_forged_altered_and_unsigned_results_are_refused(tmp_path, audit_key):
    from kfuzz.audit import RESULTS, read_results, results_key
    record = {"key": "c:k", "standard": {"passed": False, "reason": "mismatch"}, "gates": {}}
    append_record(tmp_path, record)
    assert oct(audit_key.stat().st_mode & 0o777) == "0o600"
    path = tmp_path / RESULTS
    real = json.loads(path.read_text())
    forged = {**real, "standard": {"passed": True, "reason": "pass"}}          # the old HMAC kept
    with open(path, "a") as f:
        f.write(json.dumps(forged) + "\n")
        f.write(json.dumps({**forged, "hmac": "0" * 64}) + "\n")
        f.write(json.dumps({k: v for k, v in forged.items() if k != "hmac"}) + "\n")
    got = read_results(path)
    assert got["c:k"]["standard"]["passed"] is False                          # the real verdict stands
    assert [n for n, _ in got.refused] == [2, 3, 4]
    assert "HMAC does not match" in got.refused[0][1] and "no HMAC" in got.refused[2][1]
    # lines made before results were signed are taken only when asked, and counted
    trusted = read_results(path, trust_unsigned=True)
    assert trusted["c:k"]["standard"]["passed"] is False          # never over a signed record
    assert trusted.unsigned_keys == set() and "after a signed record" in trusted.refused[-1][1]
    assert trusted.unsigned == 0                                  # refused, so not taken unsigned
    unsigned = tmp_path / "unsigned.jsonl"
    unsigned.write_text(json.dumps({k: v for k, v in forged.items() if k != "hmac"}) + "\n")
    trusted = read_results(unsigned, trust_unsigned=True)
    assert trusted["c:k"]["standard"]["passed"] is True and trusted.unsigned == 1
    assert trusted.unsigned_keys == {"c:k"}          # the record taken is the unsigned line
    with open(unsigned, "a") as f:                   # a signed line after it: the key's record is signed
        f.write(path.read_text().splitlines()[0] + "\n")
    assert read_results(unsigned, trust_unsigned=True).unsigned_keys == set()
    # under another key nothing verifies
    assert read_results(path, key=b"x" * 64).refused[0][0] == 1
    assert results_key(audit_key) == results_key()
    audit_key.write_text("short\n")
    with pytest.raises(KfuzzError, match="not an audit key"):
        results_key(audit_key)


def test_an_audit_without_the_key_that_signed_its_results_stops_before_making_a_new_one(tmp_path):
    """Where the key that signed a results folder is missing (given wrong, or lost), a new key
    would verify none of its records and the audit would run every kernel again: it stops,
    naming the key, and makes no key and no record."""
    from kfuzz.audit import RESULTS
    out = tmp_path / "out"
    append_record(out, {"key": "c:k", "standard": {"passed": True, "reason": "pass"}, "gates": {}})
    before = (out / RESULTS).read_text()
    lost = tmp_path / "elsewhere" / "audit.key"
    with pytest.raises(KfuzzError, match="no audit key, and .* holds records signed under one"):
        list(run_audit([control("correct_sum")], out, ["G01"], key=lost))
    assert not lost.exists() and (out / RESULTS).read_text() == before


def test_the_key_and_the_extension_cache_stay_outside_the_results_folder(tmp_path):
    with pytest.raises(KfuzzError, match="outside the results folder"):
        list(run_audit([control("correct_sum")], tmp_path, ["G01"], key=tmp_path / "k"))
    with pytest.raises(KfuzzError, match="must not contain one another"):
        list(run_audit([control("correct_sum")], tmp_path, ["G01"], cache=tmp_path / "ext"))


def test_a_detached_grandchild_cannot_forge_the_verdict(tmp_path):
    """forge_results forks a detached grandchild that waits for the kernel's real record and
    appends a forged all-pass one. Where processes are allowed and writes are not blocked (as on
    a machine without OS layers, simulated by the policy), the grandchild outlives the call:
    that is the finding (on the standard test, or on the gate whose worker forked next where
    the standard test's worker did not see its grandchild, as happens on a loaded machine; a
    grandchild a call waits for is always seen: ``tests/test_sandbox.py``), it dies with its
    worker, and the results file holds the real record only; where processes are blocked, the
    fork itself is the finding. A line a process does append anyway is refused
    (``test_forged_altered_and_unsigned_results_are_refused``)."""

    def outlived(record):     # where the grandchild was found (processes are allowed: by outliving its call)
        return [where for where, found in [("standard", record["standard"]), *record["gates"].items()]
                if found.get("exc_type") == "sandbox-fork"]
    from kfuzz.audit import RESULTS, first_failure, read_results
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "reference_relu.py").write_text((CONTROLS / "reference_relu.py").read_text())
    (corpus / "forge_results.py").write_text(
        (ESCAPES / "forge_results.py").read_text().replace("../../kernelbench_controls/", ""))
    (rec,) = run_audit(read_corpus(corpus), tmp_path / "out", ["G01"], timeout=120, allow_unconfined=True,
                       policy={"processes": True, "confine_writes": False})
    assert outlived(rec) and judge_record(rec)["broken"], (rec.get("standard"), rec.get("gates"))
    time.sleep(2)       # the grandchild polls every 0.1 s: had it survived, it would have written by now
    path = tmp_path / "out" / RESULTS
    got = read_results(path)
    assert len(path.read_text().splitlines()) == 1 and not got.refused
    assert outlived(got["corpus:forge_results"]) == outlived(rec)
    # confined (this machine's OS layers): the fork itself is the finding
    (rec,) = run_audit(read_corpus(corpus), tmp_path / "confined", ["G01"], timeout=120)
    assert judge_record(rec)["violations"] == ["sandbox-fork"] and judge_record(rec)["broken"]
    assert first_failure(rec).startswith("standard sandbox-fork: os.fork()")


def _descendants(pid: int) -> set[int]:
    """The processes below ``pid`` now (from /proc's parent links)."""
    parents = {}
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
            parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_stopped_audit_ends_its_kernels_and_keeps_its_records(tmp_path, stop):
    """SIGTERM (a job scheduler, a machine's end) stops `kfuzz audit` as Ctrl-C does: the kernel
    in flight (its process group, its workers) ends with it, the record already written stays
    and verifies, and the exit code is 130; a rerun goes on with the kernel left. Killed outright
    (SIGKILL), the audit cannot end them: each kernel's process sees the audit gone within a
    second and ends its group itself."""
    import subprocess
    import sys
    from kfuzz.audit import RESULTS, read_results
    def row(code, task):
        return {"level_id": 1, "task_id": task, "ref_code": (CONTROLS / "reference_relu.py").read_text(),
                "custom_code": code, "name": f"relu_{task}"}
    relu = ("import time\nimport torch\nimport torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n"
            "    def forward(self, x):\n        return torch.relu(x)\n")
    sleeps = relu.replace("        return", "        time.sleep(600)\n        return")
    jsonl = tmp_path / "cuda-l1-x.jsonl"
    jsonl.write_text(json.dumps(row(relu, 1)) + "\n"
                     + json.dumps(row(sleeps, 2)) + "\n")
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-c", "from kfuzz.cli import main; main()", "audit", str(jsonl), "--out",
                          str(out), "--gates", "G01", "--device", "cpu", "--timeout", "600"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / RESULTS).exists() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.5)     # the first kernel is recorded; the second sleeps in its standard test
        time.sleep(2.0)
        below = _descendants(p.pid)
        assert below, "no kernel process is running"
        p.send_signal(stop)
        output, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    if stop == signal.SIGTERM:
        assert p.returncode == 130, output
        assert "interrupted (SIGTERM)" in output and "1 kernel(s) recorded now" in output, output
        # the kernel left unrecorded is named, with the phase it had reached
        assert re.search(r"stopped unrecorded: cuda-l1-x.jsonl:1 \(standard, \d+ s, gates done: none\)", output), output
    else:
        assert p.returncode == -signal.SIGKILL, output
    deadline = time.monotonic() + 5.0       # a kernel's process looks for the audit every second
    while [pid for pid in below if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in below if _alive(pid)], output
    results = read_results(out / RESULTS)
    assert list(results) == ["cuda-l1-x.jsonl:0"] and not results.refused


def test_a_kernel_out_of_memory_on_a_shared_device_is_run_again_alone_at_the_end(tmp_path, monkeypatch):
    """Where the audit's kernels share the device's memory (a GPU), a run that ended for want of
    memory may have met the others' memory: it is not recorded, but run again once the others
    are done, alone, and that record (``alone``) is the kernel's."""
    # looked up by the run (who runs again alone) and by the judging of its records (incomplete)
    monkeypatch.setattr("kfuzz.audit.run.shares_memory", lambda device: True)
    monkeypatch.setattr("kfuzz.audit.verdicts.shares_memory", lambda device: True)
    # its gates ran on the CPU, where no second run confirms an out-of-memory case as a GPU's gate
    # does (test_a_kernel_out_of_a_gpus_memory_runs_once_more_and_only_a_second_failure_counts)
    monkeypatch.setattr("kfuzz.audit.verdicts.unconfirmed_memory_failures", lambda record: [])
    entries = [e for e in read_corpus(ESCAPES) if e.key.rsplit(":", 1)[1] in ("memory_hog", "fork_bomb")]
    records = list(run_audit(entries, tmp_path, ["G01"], jobs=2, timeout=120))
    assert [r["key"].rsplit(":", 1)[1] for r in records] == ["fork_bomb", "memory_hog"]
    assert records[1]["alone"] is True and "alone" not in records[0]
    assert records[1]["standard"]["finding"] == "resource-memory"     # alone too: the kernel's own
    assert done_keys(tmp_path, retry=True) == {r["key"] for r in records}     # made alone: final
    append_record(tmp_path, {k: v for k, v in records[1].items() if k not in ("alone", "hmac")})
    assert done_keys(tmp_path, retry=True) == {records[0]["key"]}     # beside others: --retry redoes it
    beside = {k: v for k, v in records[1].items() if k != "alone"}
    assert judge_record(beside)["incomplete"] and "resource-memory" not in judge_record(beside)["violations"]
    assert judge_record(beside)["standard"] is None and judge_record(records[1])["standard"] is False
    # the report leaves its standard test out (as corpus records: these controls expect a finding)
    summary = audit_report().summarize([{**beside, "expect": None}, {**records[0], "expect": None}])
    assert summary["incomplete"] == 1 and summary["confusion"] == {"standard_fail__gates_violation": 1}
    assert summary["time_limits"] == [120]
    # where the gates ran the trusted implementation: where the kernel ran (here the CPU)
    assert records[0]["trusted_on"] == "cpu" and summary["trusted_on"] == {"cpu": 2}
    assert "ran where the kernel ran for 2 (on the CPU)." in audit_report().markdown(summary)
    unsaid = audit_report().summarize([{**{k: v for k, v in records[0].items() if k != "trusted_on"}, "expect": None}])
    assert unsaid["trusted_on"] == {"unrecorded": 1}
    assert "for none; 1 record does not say where" in audit_report().markdown(unsaid)
    # one kernel at a time: every run is alone, the first record is final
    hog = [e for e in entries if e.key.endswith("memory_hog")]
    (alone,) = run_audit(hog, tmp_path / "one", ["G01"], jobs=1, timeout=120)
    assert alone["alone"] is True and not judge_record(alone)["incomplete"] and alone["timeout"] == 120
    assert judge_record(records[1])["violations"][0] == "resource-memory"


def test_a_kernel_that_met_a_shared_gpu_busy_is_run_again_alone_at_the_end(tmp_path, monkeypatch):
    """CUDA's "busy or unavailable" (many processes creating their contexts on one GPU at once)
    is a state of a shared GPU, like its memory taken: a run that ended with it, in the kernel's
    standard test or in the oracle's own process, is not recorded but run again alone at the end,
    and that record is the kernel's."""
    from kfuzz import sandbox
    from kfuzz.audit import ended_by_gpu_state, needs_retry
    from kfuzz.audit.kernel import error_kind
    monkeypatch.setattr("kfuzz.audit.run.shares_memory", lambda device: True)
    monkeypatch.setattr("kfuzz.audit.verdicts.shares_memory", lambda device: True)
    said = ("CUDA error: CUDA-capable device(s) is/are busy or unavailable\n"
            "Search for `cudaErrorDevicesUnavailable' in https://docs.nvidia.com/cuda/")

    def row(code, task):
        return {"level_id": 1, "task_id": task, "ref_code": (CONTROLS / "reference_relu.py").read_text(),
                "custom_code": code, "name": f"relu_{task}"}
    relu = ("import torch\nimport torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n"
            "    def forward(self, x):\n        return torch.relu(x)\n")
    busy = relu.replace("        return torch.relu(x)", f"        raise RuntimeError({said!r})")
    jsonl = tmp_path / "cuda-l1-x.jsonl"
    jsonl.write_text(json.dumps(row(busy, 1)) + "\n" + json.dumps(row(relu, 2)) + "\n")
    records = list(run_audit(read_corpus(jsonl), tmp_path / "out", ["G01"], jobs=2, timeout=120))
    assert [r["key"] for r in records] == ["cuda-l1-x.jsonl:1", "cuda-l1-x.jsonl:0"], records
    assert records[1]["alone"] is True and "alone" not in records[0]
    assert records[1]["standard"]["finding"] == sandbox.BUSY     # alone too: the kernel's own
    assert judge_record(records[1])["violations"][0] == sandbox.BUSY
    beside = {k: v for k, v in records[1].items() if k != "alone"}
    assert judge_record(beside)["incomplete"] and not judge_record(beside)["violations"] and needs_retry(beside)
    # the oracle's own process met it (its run's error): the same, and never the kernel's finding
    ended = {"key": "c:1", "device": "cuda", "gates": {}, "standard": {"passed": True, "reason": ""},
             "error": {"error": f"AcceleratorError: {said}", "exc_type": error_kind(RuntimeError(said))}}
    assert ended["error"]["exc_type"] == sandbox.BUSY and ended_by_gpu_state(ended) and needs_retry(ended)
    assert not ended_by_gpu_state({**ended, "error": {"error": "RuntimeError: x", "exc_type": "RuntimeError"}})


# findings: attempts against the sandbox are verdicts ------------------------------------------------

def test_attempts_against_the_sandbox_in_the_standard_test_are_findings(tmp_path):
    """fork_bomb forks 100 processes and shell_out runs sh -c, each catching the refusal and
    answering right; memory_hog reserves 20 GiB: each is a finding named by the attempt, never a
    pass or a skip."""
    from kfuzz.audit import outcome
    entries = [e for e in read_corpus(ESCAPES) if e.key.rsplit(":", 1)[1] in ("fork_bomb", "shell_out", "memory_hog")]
    records = list(run_audit(entries, tmp_path, ["G01"], jobs=2, timeout=120))
    assert len(records) == 3
    hog = next(r for r in records if r["key"].endswith("memory_hog"))
    records.remove(hog)
    # 20 GiB of address space is past the workers' limit: a finding, however the kernel goes on
    assert judge_record(hog)["violations"][0] == "resource-memory" and hog["standard"]["finding"] == "resource-memory"
    for rec in records:
        j = judge_record(rec)
        assert j["audited"] and j["violations"] == ["sandbox-fork"] and j["broken"], rec
        assert rec["standard"]["finding"] == "sandbox-fork" and not rec["standard"]["passed"]
        assert outcome(rec) == "expected"
    assert "subprocess.Popen('sh'" in next(r for r in records if r["key"].endswith("shell_out"))["standard"]["detail"]


def test_a_standard_test_that_ends_in_a_crash_or_a_timeout_is_a_finding():
    base = {"key": "c:k", "gates": {}, "expect": None}
    crashed = {**base, "standard": {"passed": False, "reason": "crash: ...", "finding": "crash", "kind": "crash",
                                    "exc_type": "SIGSEGV"}}
    killed = {**base, "phase": "standard", "ended": "timeout"}
    old = {**base, "ended": "timeout (no answer within 60 s) in the standard test"}
    slow_gates = {**base, "phase": "gates", "ended": "timeout", "standard": {"passed": True, "reason": "pass"}}
    for rec, want in ((crashed, "crash"), (killed, "timeout"), (old, "timeout")):
        j = judge_record(rec)
        assert j["audited"] and j["violations"] == [want] and j["broken"] and not j["incomplete"], (rec, j)
    j = judge_record(slow_gates)
    assert j["incomplete"] and not j["violation"] and j["audited"]


def test_the_build_step_may_start_processes_and_the_kernels_workers_may_not():
    """The build step's policy lets the compiler run (processes), with no network and writes
    confined; a kernel's workers start no process."""
    from kfuzz.audit import build_policy, kernel_policy
    assert build_policy("cpu", "/x").processes and not kernel_policy("cpu").processes
    assert not build_policy("cuda", "/x").network and build_policy("cuda", "/x").confine_writes


def test_a_solution_builds_in_its_own_step_and_loads_where_no_process_may_start(tmp_path, probe_marker):
    """compiled_relu builds a C++ extension with load_inline: in the build step (processes
    allowed, writes beneath its cache folder only), then loaded by workers that may not start a
    process (they would need ninja to build it). compiled_fork, built alike, forks in forward:
    a finding, although its extension needed the compiler. With build_jobs, the second kernel's
    build runs ahead, beside the first kernel's judging."""
    entries = [e for e in read_corpus(ESCAPES) if e.key.rsplit(":", 1)[1].startswith("compiled")]
    assert all(e.compiles for e in entries) and len(entries) == 2
    # one kernel judged at a time; the other's build runs ahead of its judging (no precompiled
    # header: making one takes minutes; its use is test_builds_find_the_precompiled_header_...)
    records = {r["key"].rsplit(":", 1)[1]: r for r in run_audit(
        entries, tmp_path / "out", ["G01"], jobs=1, build_jobs=1, timeout=300,
        cache=probed(tmp_path / "ext", probe_marker), pch=False)}
    for rec in records.values():
        assert rec["build"]["status"] == "built" and rec["build"]["extensions"] == ["kfuzz_escapes_relu"], rec
    # compiled_fork (first) built its own; compiled_relu was built ahead, and its record keeps
    # that build's facts in place of a build step of its own
    assert not records["compiled_fork"]["build"].get("ahead") and records["compiled_relu"]["build"]["ahead"], records
    clean = records["compiled_relu"]
    assert clean["standard"]["passed"] and clean["gates"]["G01"]["status"] == "pass", clean
    # its workers: the standard test's, the weights contract's and the gates' (no build step's)
    assert clean["starts"]["workers"] >= 2 and 0 < clean["starts"]["seconds"] < clean["seconds"], clean["starts"]
    # those seconds by step: each worker's launch, then its steps to ready, no more than the whole
    phases = clean["starts"]["phases"]
    assert {"launch", "isolation", "preload", "target", "confinement"} <= set(phases), phases
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= clean["starts"]["seconds"] + 0.01, phases
    assert judge_record(clean)["violations"] == []
    assert judge_record(records["compiled_fork"])["violations"] == ["sandbox-fork"]


def test_a_kernel_whose_build_ahead_still_runs_waits_for_it_and_keeps_its_facts(tmp_path, monkeypatch):
    """A kernel whose turn comes while its build ahead (--build-jobs) still runs starts when that
    build ends, with its facts and no build step of its own: two builds of one folder at once
    race on torch's lock, and the second imports what the first may have failed to build."""
    folder = _controls_folder(tmp_path, ["correct_sum"])
    slow = (CONTROLS / "correct_sum.py").read_text() + textwrap.dedent("""
        # says load_inline, so the audit builds it; its build sleeps, in the first process that
        # may write the extension folder (the build ahead: the kernel's own workers may not)
        import os, time
        marker = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "slept")
        if not os.path.exists(marker):
            open(marker, "x").close()
            time.sleep(10)
    """)
    (folder / "slow_build.py").write_text(slow)
    # the toolchain probe compiles a real extension: not what this test is about
    monkeypatch.setattr("kfuzz.audit.run.check_build_step", lambda *a, **k: None)
    entries = read_corpus(folder)
    assert [e.key.rsplit(":", 1)[1] for e in entries] == ["correct_sum", "slow_build"]
    start = time.monotonic()
    records = {r["key"].rsplit(":", 1)[1]: r for r in run_audit(
        entries, tmp_path / "out", ["G05"], jobs=1, build_jobs=1, timeout=120, cache=tmp_path / "ext",
        pch=False, allow_unconfined=True)}
    assert time.monotonic() - start >= 10     # correct_sum ended well before the build ahead did
    built = records["slow_build"]["build"]
    assert built["status"] == "built" and built["ahead"] and built["seconds"] >= 10, built
    assert records["slow_build"]["standard"]["passed"], records["slow_build"]["standard"]


def test_the_audit_runs_as_many_kernels_as_a_gpu_host_has_cores_by_default(tmp_path, monkeypatch):
    """kfuzz.audit.default_jobs: on a GPU, a kernel a core (at most 16) and half as many builds
    ahead; on the CPU, one kernel; what is given is kept. The CLI passes them to run_audit."""
    from kfuzz.audit import GPU_JOBS, default_jobs
    monkeypatch.setattr("os.cpu_count", lambda: 12)
    assert default_jobs("cuda") == (12, 6) and default_jobs("cuda:1", 3) == (3, 1)
    monkeypatch.setattr("os.cpu_count", lambda: 128)
    assert default_jobs("cuda") == (GPU_JOBS, GPU_JOBS // 2)
    assert default_jobs("cpu") == (1, 0) and default_jobs("cpu", 4) == (4, 0)
    asked = {}

    def run_audit(entries, out, gates, **kw):
        asked.update(kw)
        return (record for record in ())
    monkeypatch.setattr("kfuzz.audit.run_audit", run_audit)
    r = CliRunner().invoke(cli, ["audit", str(CONTROLS), "--out", str(tmp_path / "o"), "--device", "cpu"])
    assert (asked["jobs"], asked["build_jobs"]) == (1, 0), (r.output, asked)
    CliRunner().invoke(cli, ["audit", str(CONTROLS), "--out", str(tmp_path / "o"), "--device", "cpu",
                             "--jobs", "2", "--build-jobs", "1"])
    assert (asked["jobs"], asked["build_jobs"]) == (2, 1), asked


def test_a_build_has_its_own_time_limit_apart_from_the_kernels(tmp_path):
    """A solution that compiles gets ``build_timeout`` for its build (a build ahead of judging
    too), then ``timeout`` for its standard test and gates; one that does not, ``timeout``."""
    from kfuzz.audit.policy import forkserver_context
    from kfuzz.audit.process import KernelProcess
    compiled = next(e for e in read_corpus(ESCAPES) if e.key.endswith("compiled_relu"))
    plain = control("correct_sum")
    args = ("cpu", ["G01"], 0, str(tmp_path / "ext"), 1, 2, 5.0, {}, None, str(tmp_path / "cases"), 600.0)
    limits = {}
    for name, entry, build_only in (("compiled", compiled, False), ("ahead", compiled, True), ("plain", plain, False)):
        r = KernelProcess(forkserver_context(), entry, args, 5.0, build_only=build_only, build_timeout=600.0)
        limits[name] = round(r.deadline - r.start)
        r.kill()
        r.proc.join(10)
        r.conn.close()
    assert limits == {"compiled": 600, "ahead": 600, "plain": 5}
    r = KernelProcess(forkserver_context(), compiled, args, 5.0, build_timeout=600.0)
    r.take("phase", {"phase": "build"})
    r.take("phase", {"phase": "standard"})     # the build is done: the kernel's own limit from here
    assert round(r.deadline - time.monotonic()) == 5
    r.kill()
    r.proc.join(10)
    r.conn.close()


def test_a_kernel_that_builds_nothing_in_the_build_step_is_not_built_by_its_worker(tmp_path, monkeypatch):
    """A worker of a kernel loads extensions only (kfuzz.kernelbench.build.prebuilt_only): an
    extension missing from the build folder is an error naming it, not a compiler run."""
    import torch.utils.cpp_extension as ext
    from kfuzz.kernelbench.build import builds_lazily, prebuilt_only
    monkeypatch.setattr(ext, "_write_ninja_file_and_build_library", ext._write_ninja_file_and_build_library)
    monkeypatch.setattr(ext, "FileBaton", ext.FileBaton)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    prebuilt_only()
    with pytest.raises(RuntimeError, match="'kfuzz_never_built' was not built by the build step"):
        ext.load_inline("kfuzz_never_built", cpp_sources="int f() { return 1; }", no_implicit_headers=True)
    folder = tmp_path / "kfuzz_never_built"
    assert not list(folder.glob("*.so")) and not (folder / "lock").exists()
    assert builds_lazily("def forward(self, x):\n    m = load_inline('a', '')\n")
    assert not builds_lazily("m = load_inline('a', '')\nclass M:\n    def __init__(self):\n        load('b', [])\n")


# a machine without OS layers ---------------------------------------------------------------------

def test_the_audit_refuses_a_machine_whose_sandbox_would_not_block_the_kernels(tmp_path, monkeypatch):
    from kfuzz.audit import confinement, unconfined_layers
    here = confinement("cpu")
    if unconfined_layers(here):
        pytest.skip(f"this machine's sandbox lacks OS layers ({here}): the refusal is all one can see")
    # processes allowed: what a machine without seccomp gives (the probe confines a real child)
    allowing = {"processes": True}
    assert unconfined_layers(confinement("cpu", allowing)) == ["processes"]
    with pytest.raises(KfuzzError, match="would not block the kernels' processes"):
        list(run_audit([control("correct_sum")], tmp_path, ["G05"], policy=allowing))
    assert not (tmp_path / "results.jsonl").exists()
    # the GPU machine's report (gVisor: no Landlock, no seccomp), through the CLI
    gpu = {"network": "allowed", "writes": "allowed", "processes": "allowed",
           "signals": "named, not blocked (no OS layer here)"}
    monkeypatch.setattr("kfuzz.audit.run.confinement", lambda device, policy=None: gpu)
    r = CliRunner().invoke(cli, ["audit", str(CONTROLS), "--out", str(tmp_path / "o"), "--gates", "G05"])
    assert r.exit_code == 2 and "--allow-unconfined" in r.output and "network (allowed)" in r.output, r.output


# exit codes and the whole results file -------------------------------------------------------------

def _controls_folder(tmp_path, stems):
    folder = tmp_path / "controls"
    folder.mkdir()
    for f in CONTROLS.glob("reference_*.py"):
        (folder / f.name).write_text(f.read_text())
    for stem in stems:
        (folder / f"{stem}.py").write_text((CONTROLS / f"{stem}.py").read_text())
    return folder


def test_audit_exit_codes_follow_expectations_over_the_whole_results_file(tmp_path):
    """Controls as planted: exit 0; a planted bug the chosen gates miss: exit 1; a corpus without
    expectations: exit 1 on a violation. A rerun reports every selected kernel in the results
    file (none audited now) with the same exit code; each line names the kernel and its first
    failure, and the output explains its labels."""
    folder = _controls_folder(tmp_path, ["correct_sum", "drops_nan"])
    def run(*args):
        return CliRunner().invoke(cli, ["audit", *map(str, args)])
    r = run(folder, "--out", tmp_path / "a", "--gates", "G05", "--timeout", "120")
    assert r.exit_code == 0, r.output
    assert "VIOLATE" in r.output or "BROKEN" in r.output
    assert "first: G05 nonfinite" in r.output and "labels: BROKEN = " in r.output and "VIOLATE = " in r.output
    r = run(folder, "--out", tmp_path / "a", "--gates", "G05")
    assert r.exit_code == 0 and "2 kernel(s) recorded by an earlier run" in r.output and "(0 now)" in r.output, r.output
    # G01 alone does not see drops_nan's planted bug: a control ends otherwise than planted
    r = run(folder, "--out", tmp_path / "b", "--gates", "G01", "--timeout", "120")
    assert r.exit_code == 1 and "1 ended otherwise than expected" in r.output, r.output
    # a corpus without expectations: a violation is unexpected, and stays so on a rerun
    def row(code):
        return {"level_id": 1, "task_id": 1, "ref_code": (CONTROLS / "reference_relu.py").read_text(),
                "custom_code": code, "name": "relu_rows"}
    jsonl = tmp_path / "cuda-l1-x.jsonl"
    jsonl.write_text(json.dumps(row((CONTROLS / "drops_nan.py").read_text())) + "\n")
    r = run(jsonl, "--out", tmp_path / "c", "--gates", "G05", "--timeout", "120")
    assert r.exit_code == 1 and "cuda-l1-x.jsonl:0 (relu_rows)" in r.output, r.output
    r = run(jsonl, "--out", tmp_path / "c", "--gates", "G05")
    assert r.exit_code == 1 and "(0 now)" in r.output and "first: G05" in r.output, r.output


# the oracle, the sizes and the precision flags of a KernelBench target ------------------------------

EXPLICIT_FLOAT32 = """import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        pos = torch.arange(x.shape[-1], dtype=torch.float32)      # float32 whatever the default dtype
        mix = torch.ones(8, 8).float() / 8
        return self.lin(x + pos) @ mix


batch = 4


def get_inputs():
    return [torch.randn(batch, 8)]


def get_init_inputs():
    return []
"""


CLOSURE = """import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.ModuleDict(dict(fc=nn.Linear(8, 8)))
        m = self.mlp
        self.mlpf = lambda x: m.fc(x)      # minGPT's block keeps its MLP's forward so

    def forward(self, x):
        return self.mlpf(x)


batch = 4


def get_inputs():
    return [torch.randn(batch, 8)]


def get_init_inputs():
    return []
"""


def test_the_oracles_model_calls_its_own_modules_where_the_reference_keeps_them_in_a_closure():
    """A forward that calls a submodule through a lambda made in ``__init__``: the float64 oracle's
    model (and the float32 trusted one) is a Model made anew with the checkpoint's values, so its
    lambda calls its own modules (a copy's called the checkpoint's, on the CPU in float32: on a
    GPU, "mat1 is on cuda:0, different from other tensors on cpu"). Its own weights changed,
    its output follows; its values are the checkpoint's."""
    pair = load_pair(CLOSURE, CLOSURE.replace("class Model(", "class ModelNew("), "closure", eval_mode=True)
    target = as_target(pair, weights="seed", solution=False)
    bench = target.options["bench"]
    x = torch.randn(4, 8, dtype=torch.float64)
    (name,) = target.args
    (out,) = target.reference(**{name: x})
    for dtype in (torch.float64, torch.float32):
        model = bench.reference_model({"batch": 4}, dtype, "cpu")
        assert all(p.dtype == dtype for p in model.parameters())
        want = x.to(dtype) @ model.mlp.fc.weight.T + model.mlp.fc.bias
        assert torch.allclose(model(x.to(dtype)), want)
        with torch.no_grad():
            model.mlp.fc.weight.zero_()
            model.mlp.fc.bias.fill_(1.0)
        assert torch.equal(model(x.to(dtype)), torch.ones(4, 8, dtype=dtype))
    first = bench.reference_model({"batch": 4}, torch.float64, "cpu")     # the same (cached) one
    assert torch.equal(first.mlp.fc.bias, torch.ones(8, dtype=torch.float64))
    bench.models.clear()     # made again: the checkpoint's values, as the oracle computed them
    again = bench.reference_model({"batch": 4}, torch.float64, "cpu")
    assert torch.equal(again(x), out)


def test_the_float64_oracle_lifts_tensors_a_reference_makes_in_float32():
    """A reference that makes float32 tensors inside forward (an explicit dtype, .float()) meets
    its float64 weights in one op: the oracle lifts them to float64 instead of raising."""
    from kfuzz.gates import GATES, run_gate
    pair = load_pair(EXPLICIT_FLOAT32, EXPLICIT_FLOAT32.replace("class Model(", "class ModelNew("), "explicit_f32")
    target = as_target(pair)
    out = target.reference(x=torch.randn(4, 8, dtype=torch.float64))[0]
    assert out.dtype == torch.float64
    assert run_gate(GATES["G01"], target, seed=0).status == "pass"


def test_size_constants_from_tuple_and_chained_assignments():
    code = "a = 3\nheight, width = 16, 32\nx = y = 4\nc: int = 5\np, q = f()\nr = 2.0\na = -1\n[m, n] = [7, 8]\n"
    assert size_constants(code) == {"height": 16, "width": 32, "x": 4, "y": 4, "c": 5, "m": 7, "n": 8}


DEPTHWISE = """import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, groups):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_channels, 1, kernel_size))

    def forward(self, x):
        return F.conv1d(x, self.weight, groups=self.weight.shape[0])   # depthwise, whatever groups says


batch_size = 4
in_channels = 3
out_channels = in_channels
kernel_size = 3
length = 32
groups = in_channels


def get_inputs():
    return [torch.randn(batch_size, in_channels, length)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, groups]
"""

DEPTHWISE_NEW = DEPTHWISE.replace("class Model(", "class ModelNew(").replace(
    "groups=self.weight.shape[0]", "groups=self.groups").replace(
    "super().__init__()", "super().__init__()\n        self.groups = groups")


def test_sizes_derived_from_a_size_constant_follow_it():
    """``groups = in_channels`` and ``out_channels = in_channels`` are evaluated again where G03
    changes in_channels, as the module would have: a solution that honours ``groups`` passes
    (left at 3 over 1 channel, the init would be one the module never gives, and the solution
    would raise); one that hard-codes the groups still fails."""
    from kfuzz.gates import GATES, run_gate
    assert [n for n, _, _ in derived_sizes(DEPTHWISE)] == ["out_channels", "groups"]
    r = run_gate(GATES["G03"], as_target(load_pair(DEPTHWISE, DEPTHWISE_NEW, "depthwise")), seed=0)
    assert r.status == "pass", r.reason
    fixed = DEPTHWISE_NEW.replace("groups=self.groups", "groups=3")
    r = run_gate(GATES["G03"], as_target(load_pair(DEPTHWISE, fixed, "depthwise_fixed")), seed=0)
    assert r.status == "fail", r.reason


STATE_FROM_A_CONSTANT = """import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.h0 = torch.ones(batch_size, 8)     # sized by the module's constant, as an LSTM's h0

    def forward(self, x):
        return x * self.h0


batch_size = 4


def get_inputs():
    return [torch.randn(batch_size, 8)]


def get_init_inputs():
    return []
"""


def test_models_are_built_under_the_cases_size_constants_and_precision_flags_are_put_back():
    """A verbatim copy of a reference whose __init__ reads a size constant passes G03 (both
    models are built under the case's constants); TF32 and cuDNN flags that the solution sets are
    put back after the standard test and after each kernel call, and named."""
    from kfuzz.gates import GATES, run_gate
    new = STATE_FROM_A_CONSTANT.replace("class Model(", "class ModelNew(").replace(
        "super().__init__()", "super().__init__()\n        torch.backends.cuda.matmul.allow_tf32 = True\n"
                              "        torch.backends.cudnn.benchmark = True")
    pair = load_pair(STATE_FROM_A_CONSTANT, new, "state_from_constant")
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark)
    v = standard_test(pair)
    assert v.passed and "torch.backends.cuda.matmul.allow_tf32=True" in v.undone, v
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark) == before
    target = as_target(pair)
    assert run_gate(GATES["G03"], target, seed=0).status == "pass"
    assert {"torch.backends.cuda.matmul.allow_tf32=True", "torch.backends.cudnn.benchmark=True"} \
        <= target.options["bench"].flags_changed
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark) == before


SQUARES = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return {body}


batch_size = 8
dim = 64


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
"""


def test_g06_excuses_what_the_reference_in_float32_cannot_do_either():
    """A solution bitwise the reference overflows exactly where the float32 reference does (the
    float64 oracle stays finite): reference-limited, G06 passes. A kernel that overflows where the
    float32 reference does not still fails."""
    from kfuzz.gates import GATES, run_gate
    ref = SQUARES.format(body="torch.sqrt((x * x).sum(dim=1))")
    same = load_pair(ref, ref.replace("class Model(", "class ModelNew("), "squares")
    assert run_gate(GATES["G06"], as_target(same), seed=0).status == "pass"
    ref = SQUARES.format(body="x.abs().amax(dim=1)")
    worse = load_pair(ref, SQUARES.format(body="torch.sqrt((x * x).amax(dim=1))").replace(
        "class Model(", "class ModelNew("), "squares_worse")
    r = run_gate(GATES["G06"], as_target(worse), seed=0)
    assert r.status == "fail" and r.first_failure[1].kind == "nonfinite", r.reason


SHIFTED = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        if x.dtype == torch.float64:
            return torch.tanh(x)
        # the float32 path transforms its inputs first, as a library's float32 convolution may:
        # exact for finite x, while an Inf at i leaves inf - inf at i + {shift}
        s = x.roll({shift}, dims=1)
        return torch.tanh(x + s - s)


batch_size = 4
dim = 32


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
"""


def test_g05_excuses_the_class_that_the_reference_in_float32_takes_too():
    """A reference whose float32 path turns one Inf into NaN beside it where its float64 path
    (the oracle) stays finite: a solution bitwise the reference is reference-limited, G05 passes
    and says so. A kernel with NaN where the float32 reference is finite still fails."""
    from kfuzz.audit import excused_class
    from kfuzz.gates import GATES, run_gate
    ref = SHIFTED.format(shift=1)
    same = as_target(load_pair(ref, ref.replace("class Model(", "class ModelNew("), "shifted"))
    seen = []
    r = run_gate(GATES["G05"], same, seed=0, on_case=lambda *a: seen.append(excused_class(a[-1])))
    assert r.status == "pass", r.reason
    assert "reference-limited" in seen
    worse = as_target(load_pair(ref, SHIFTED.format(shift=2).replace("class Model(", "class ModelNew("),
                                "shifted_worse"))
    r = run_gate(GATES["G05"], worse, seed=0)
    assert r.status == "fail" and r.first_failure[1].kind == "nonfinite", r.reason


FACTOR = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, a):
        return {body}


n = 8


def get_inputs():
    x = torch.randn(n, n)
    return [x @ x.T + n * torch.eye(n)]


def get_init_inputs():
    return []
"""


def test_an_exception_the_reference_raises_too_is_outside_the_contract():
    """Cholesky of inputs that are not positive definite (kfuzz's draws): the reference raises,
    so a verbatim solution raising the same error is not a failure; a solution raising another
    error type there still fails."""
    from kfuzz.gates import GATES, run_gate
    ref = FACTOR.format(body="torch.linalg.cholesky(a)")
    same = as_target(load_pair(ref, ref.replace("class Model(", "class ModelNew("), "cholesky"))
    r = run_gate(GATES["G02"], same, seed=0)
    assert r.status == "pass", r.reason
    other = FACTOR.format(body="torch.linalg.cholesky(a) if bool((torch.linalg.eigvalsh(a) > 0).all()) "
                               "else (_ for _ in ()).throw(ValueError('not positive definite'))")
    wrong = as_target(load_pair(ref, other.replace("class Model(", "class ModelNew("), "cholesky_other"))
    r = run_gate(GATES["G02"], wrong, seed=0)
    assert r.status == "fail" and r.first_failure[1].kind == "exception", r.reason


def test_a_case_the_reference_refuses_while_the_kernel_returns_is_outside_its_domain():
    """Cholesky of kfuzz's draws, which are not positive definite: the reference raises and a
    solution built on ``cholesky_ex`` returns a partial factor without raising. The reference
    defines the contract, so every value gate passes those cases as outside its domain, not as a
    gate that could not run. Where only kfuzz's float64 oracle raises (the float32 reference
    takes the inputs), the gate still cannot run, and the error is raised."""
    from kfuzz.audit import excused_class
    from kfuzz.gates import GATES, run_gate
    ref = FACTOR.format(body="torch.linalg.cholesky(a)")
    partial = FACTOR.format(body="torch.linalg.cholesky_ex(a).L")
    target = as_target(load_pair(ref, partial.replace("class Model(", "class ModelNew("), "cholesky_ex"))
    for gid in ("G01", "G02", "G03", "G05", "G06"):
        seen = []
        r = run_gate(GATES[gid], target, seed=0, on_case=lambda *a: seen.append(excused_class(a[-1])))
        assert r.status == "pass", (gid, r.reason)
        assert "outside-domain" in seen, gid
    # the float64 path raises on every size (64 elements in rows of 7), the float32 path never
    oracle_only = FACTOR.format(body="a.view(-1, 7) if a.dtype == torch.float64 else a")
    target = as_target(load_pair(oracle_only, FACTOR.format(body="a").replace("class Model(", "class ModelNew("),
                                 "oracle_only"))
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        run_gate(GATES["G01"], target, seed=0)


def test_kfuzzs_own_refusal_of_a_case_is_never_the_references():
    """``refused_by_reference`` reads only the reference's own exception: a case kfuzz itself
    refuses (dims outside the contract: ``materialize`` raises CaseError) is not passed as
    outside the reference's domain, while a non-positive-definite draw that the reference's
    Cholesky refuses is."""
    from kfuzz.case import Case
    from kfuzz.gates.base import refused_by_reference
    ref = FACTOR.format(body="torch.linalg.cholesky(a)")
    target = as_target(load_pair(ref, ref.replace("class Model(", "class ModelNew("), "cholesky_refusals"))
    assert target.dims["n"].hi == 8
    assert refused_by_reference(target, Case.make(target.name, "float32", 0, {"n": 9})) is None
    v = refused_by_reference(target, Case.make(target.name, "float32", 0, {"n": 8}))
    assert v is not None and v.passed and v.detail.startswith("outside the reference's domain"), v


DIAG = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, A, B):
        return {body}


N = 16
M = 16


def get_inputs():
    return [torch.randn(N), torch.randn(N, M)]


def get_init_inputs():
    return []
"""


def test_a_nan_the_reference_spreads_through_exact_zeros_is_not_the_kernels_to_match():
    """diag(A) @ B spreads a NaN of B down its whole column through 0 x NaN; B * A[:, None] keeps
    it at its own position. The oracle's NaNs there do not depend on the injected value: G05
    passes the elementwise kernel. A kernel that drops a NaN the oracle's value does depend on
    still fails."""
    from kfuzz.gates import GATES, run_gate
    ref = DIAG.format(body="torch.diag(A) @ B")
    honest = load_pair(ref, DIAG.format(body="B * A[:, None]").replace("class Model(", "class ModelNew("), "diag")
    r = run_gate(GATES["G05"], as_target(honest), seed=0)
    assert r.status == "pass", r.reason
    dropped = load_pair(ref, DIAG.format(body="torch.nan_to_num(B * A[:, None], nan=0.0)").replace(
        "class Model(", "class ModelNew("), "diag_drops_nan")
    r = run_gate(GATES["G05"], as_target(dropped), seed=0)
    assert r.status == "fail" and r.first_failure[1].kind == "nonfinite", r.reason


def test_the_value_without_injection_is_the_same_where_needed_and_runs_the_oracle_for_those_positions_only(
        monkeypatch):
    """G05 needs the oracle's value without the injections it ignores only where the oracle is NaN
    and the kernel not: asked for those positions, ``value_without_injection`` gives there what it
    gives over the whole output, the same dependence mask, and runs the oracle once for each
    dependence pattern among them (a 3-D transposed convolution's output of 134 million elements
    has many patterns, each a float64 run)."""
    import kfuzz.gates.nonfinite as nonfinite
    from kfuzz.gates import GATES
    from kfuzz.tensors import materialize
    target = as_target(load_pair(DIAG.format(body="torch.diag(A) @ B"),
                                 DIAG.format(body="B * A[:, None]").replace("class Model(", "class ModelNew("), "diag"))
    case = list(GATES["G05"].cases(target, 0))[-1]      # every special in every argument at once
    assert sum(len(a.inject) for _, a in case.args) == 6
    inputs = materialize(case, target)
    runs, real = [], nonfinite.oracle_outputs
    monkeypatch.setattr(nonfinite, "oracle_outputs", lambda *a, **k: runs.append(1) or real(*a, **k))
    (name,) = target.outputs
    oracle = real(target, inputs)[name]
    values, mask = nonfinite.value_without_injection(target, case, inputs, name)
    whole = len(runs)
    needed = torch.isnan(oracle) & (torch.arange(oracle.numel()).reshape(oracle.shape) % 2 == 0)
    runs.clear()
    some, some_mask = nonfinite.value_without_injection(target, case, inputs, name, needed=needed)
    assert torch.equal(mask, some_mask) and needed.any()
    torch.testing.assert_close(values[needed], some[needed], rtol=0, atol=0, equal_nan=True)
    assert len(runs) < whole, (len(runs), whole)
    runs.clear()
    nonfinite.value_without_injection(target, case, inputs, name, needed=torch.zeros_like(needed))
    assert len(runs) == 1 + 6        # the dependence tests alone


TRIANGULAR = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, A, B):
        return torch.triu(A) @ B


N = 16


def get_inputs():
    return [torch.triu(torch.randn(N, N)), torch.randn(N, N)]


def get_init_inputs():
    return []
"""


def test_layouts_that_break_a_triangular_input_are_outside_the_domain():
    """A kernel that relies on its input being upper triangular (as the reference's inputs
    always are) passes G04 and G05: an expanded layout repeating row 0, or a NaN where the matrix
    is always zero, is outside the domain and says so (without the rule, both fail it). A kernel
    wrong on honest layouts fails."""
    from kfuzz.gates import GATES, run_gate
    trusting = load_pair(TRIANGULAR, TRIANGULAR.replace("class Model(", "class ModelNew(").replace(
        "torch.triu(A) @ B", "A @ B"), "triu_trusting")
    target = as_target(trusting)
    r = run_gate(GATES["G04"], target, seed=0)
    assert r.status == "pass", r.reason
    assert run_gate(GATES["G05"], target, seed=0).status == "pass"
    target.options["outside_domain"] = None         # without the rule
    assert run_gate(GATES["G04"], target, seed=0).status == "fail"
    assert run_gate(GATES["G05"], target, seed=0).status == "fail"
    contiguous_only = load_pair(TRIANGULAR, TRIANGULAR.replace("class Model(", "class ModelNew(").replace(
        "torch.triu(A) @ B", "torch.triu(A) @ (B if B.is_contiguous() else B.flip(0))"), "triu_layouts")
    r = run_gate(GATES["G04"], as_target(contiguous_only), seed=0)
    assert r.status == "fail", r.reason


def test_long_totals_that_break_a_triangular_input_are_outside_the_domain():
    """G07's long totals raise each row's first element to 2; below the diagonal of an upper
    triangular input that is a position the reference's inputs always hold at zero. A kernel
    relying on the triangle passes, the case outside the domain (without the rule it fails:
    6 of 9 exact answers lost); a kernel that sums a row wrongly still fails."""
    from kfuzz.gates import GATES, run_gate
    wide = TRIANGULAR.replace("N = 16", "M = 4\nN = 2100").replace(
        "torch.triu(torch.randn(N, N)), torch.randn(N, N)", "torch.triu(torch.randn(M, N)), torch.randn(N, M)")
    trusting = as_target(load_pair(wide, wide.replace("class Model(", "class ModelNew(").replace(
        "torch.triu(A) @ B", "A @ B"), "triu_wide_trusting"))
    r = run_gate(GATES["G07"], trusting, seed=0)
    assert r.status == "pass", r.reason
    trusting.options["outside_domain"] = None       # without the rule
    assert run_gate(GATES["G07"], trusting, seed=0).status == "fail"
    fp16_rows = as_target(load_pair(wide, wide.replace("class Model(", "class ModelNew(").replace(
        "torch.triu(A) @ B", "(torch.triu(A).half() @ B.half()).float()"), "triu_wide_fp16"))
    r = run_gate(GATES["G07"], fp16_rows, seed=0)
    assert r.status == "fail", r.reason


CACHED = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x * 2


batch_size = 128
dim = 8


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("gate", ["G09", "G11"])
def test_g09_and_g11_also_run_at_the_references_own_sizes(gate):
    """A kernel that keeps one output buffer for the batch size the reference's own test uses
    (128) and is right elsewhere fails G09 (the output of the call before is overwritten) and
    G11 (with a result cached by shape); a correct kernel passes."""
    from kfuzz.gates import GATES, run_gate
    body = {"G09": "self.buf = getattr(self, 'buf', None)\n        if x.shape[0] == 128:\n"
                   "            self.buf = torch.empty_like(x) if self.buf is None else self.buf\n"
                   "            return torch.mul(x, 2, out=self.buf)\n        return x * 2",
            "G11": "if x.shape[0] == 128:\n            if not hasattr(self, 'kept'):\n"
                   "                self.kept = x * 2\n            return self.kept.clone()\n        return x * 2"}[gate]
    cached = CACHED.replace("class Model(", "class ModelNew(").replace("return x * 2", body)
    target = as_target(load_pair(CACHED, cached, f"cached_{gate}"))
    r = run_gate(GATES[gate], target, seed=0)
    assert r.status == "fail", r.reason
    target.options["own_dims"] = None               # kfuzz's own sizes only: not caught
    assert run_gate(GATES[gate], target, seed=0).status == "pass"
    correct = CACHED.replace("class Model(", "class ModelNew(")
    assert run_gate(GATES[gate], as_target(load_pair(CACHED, correct, "not_cached")), seed=0).status == "pass"


LINEAR = """import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x) - 0.5)


batch = 4


def get_inputs():
    return [torch.randn(batch, 8)]


def get_init_inputs():
    return []
"""
# a bias minus the constant, folded in __init__ and registered in the bias's place (loaded by position)
DERIVED = LINEAR.replace("class Model(", "class ModelNew(").replace(
    "        self.lin = nn.Linear(8, 8)\n",
    "        lin = nn.Linear(8, 8)\n        self.w = nn.Parameter(lin.weight.detach().clone())\n"
    "        self.b = nn.Parameter(lin.bias.detach() - 0.5)\n").replace(
    "torch.relu(self.lin(x) - 0.5)", "torch.relu(x @ self.w.t() + self.b)")
# the weight copied, transposed, into a plain attribute in __init__: a checkpoint loaded later never reaches it
STALE = LINEAR.replace("class Model(", "class ModelNew(").replace(
    "        self.lin = nn.Linear(8, 8)\n",
    "        self.lin = nn.Linear(8, 8)\n        self.wt = None\n").replace(
    "        return torch.relu(self.lin(x) - 0.5)",
    "        if self.wt is None:\n            self.wt = self.lin.weight.detach().t().contiguous()\n"
    "        return torch.relu(x @ self.wt + self.lin.bias - 0.5)")


NORM = """import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(x)


batch = 4


def get_inputs():
    return [torch.randn(batch, 8)]


def get_init_inputs():
    return []
"""
# BatchNorm folded into a scale and a shift on the first forward, plain attributes: the names
# load exactly, and a checkpoint loaded later never reaches the fold
FOLDED = NORM.replace("class Model(", "class ModelNew(").replace(
    "        return self.bn(x)",
    "        if not hasattr(self, 'scale'):\n"
    "            self.scale = self.bn.weight / torch.sqrt(self.bn.running_var + self.bn.eps)\n"
    "            self.shift = self.bn.bias - self.bn.running_mean * self.scale\n"
    "        return x * self.scale + self.shift")


def _weights_checks(solution: str, name: str, ref: str = LINEAR):
    """``weights_checks`` on in-process executors; every executor but the one the gates judge
    with is closed by then."""
    from kfuzz.audit import weights_checks
    from kfuzz.executor import InProcess
    pair = load_pair(ref, solution, name, eval_mode=True)
    target = as_target(pair, weights="seed", solution=False)
    opened = []

    class Recorded(InProcess):
        closed = False

        def close(self):
            self.closed = True
            super().close()

    def executor(weights, on=target):
        opened.append(Recorded(as_target(pair, weights=weights)))
        return opened[-1]
    checks, gate_ex = weights_checks(pair, target, "cpu", 0, executor("seed"), executor)
    assert len(opened) == 2 and [ex for ex in opened if not ex.closed] == [gate_ex], checks
    return checks, gate_ex


def test_a_derived_parameter_lands_on_the_weights_contract_not_on_the_gates():
    """A bias minus a constant folded in __init__ is wrong once Model's bias is loaded by position
    and right with its own same-seed weights: the finding is W's (``derived``) and the gates then
    judge the same-seed solution. A verbatim copy passes both checks."""
    from kfuzz.gates import GATES, run_gate
    checks, gate_ex = _weights_checks(DERIVED, "derived")
    assert checks["derived"]["status"] == "fail", checks
    assert gate_ex.target.options["bench"].weights == "none"
    assert run_gate(GATES["G01"], as_target(load_pair(LINEAR, DERIVED, "derived")), seed=0,
                    executor=gate_ex).status == "pass"
    checks, _ = _weights_checks(LINEAR.replace("class Model(", "class ModelNew("), "verbatim")
    assert checks["derived"]["status"] == "pass" and checks["reload"]["status"] == "pass", checks


def test_the_reload_checkpoint_is_models_of_its_own_seed_moved_as_by_training():
    """``weights="reload"`` judges against ``Model`` made after ``set_seed(RELOAD_SEED)``, its
    values then moved (``trained``), in the oracle's model and in the checkpoint alike."""
    from kfuzz.kernelbench.source import pair_module, set_seed
    from kfuzz.kernelbench.weights import RELOAD_SEED, trained
    pair = load_pair(LINEAR, LINEAR.replace("class Model(", "class ModelNew("), "verbatim", eval_mode=True)
    bench = as_target(pair, weights="reload", solution=False).options["bench"]
    set_seed(RELOAD_SEED)
    want = pair_module(pair, "ref").Model(*pair_module(pair, "ref").get_init_inputs())
    trained(want, RELOAD_SEED)
    got = bench.reference_model(dict(bench.contract.dims), torch.float32, "cpu")
    for (name, w), (_, g) in zip(want.state_dict().items(), got.state_dict().items()):
        assert torch.equal(w, g), name


def test_a_weight_copied_before_a_checkpoint_is_loaded_is_stale():
    """A transposed copy of the weight made on the first forward passes every gate on the
    same-seed weights, and answers with the old weights after Model's checkpoint of another seed
    is loaded: ``reload`` fails (W)."""
    checks, _ = _weights_checks(STALE, "stale")
    assert checks["derived"]["status"] == "pass", checks
    assert checks["reload"]["status"] == "fail" and "stale" in checks["reload"]["detail"], checks


def test_a_norm_layer_folded_before_a_checkpoint_is_loaded_is_stale():
    """BatchNorm's initial weight, bias and statistics are the same for every seed; the
    checkpoint the reload check loads has them moved, as a trained model's are
    (``kfuzz.kernelbench.weights.trained``), so a fold made on the first forward answers with the
    old ones: ``reload`` fails. BatchNorm as Model has it passes."""
    checks, _ = _weights_checks(FOLDED, "folded", NORM)
    assert checks["derived"]["status"] == "pass", checks
    assert checks["reload"]["status"] == "fail", checks
    checks, _ = _weights_checks(NORM.replace("class Model(", "class ModelNew("), "norm", NORM)
    assert checks["reload"]["status"] == "pass", checks


HIDDEN = """import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.linear = nn.Linear(features, features)
        self.h0 = torch.randn(batch_size, features)

    def forward(self, x):
        self.h0 = self.h0.to(x.device)
        return self.linear(x) + self.h0


batch_size = 4
features = 16


def get_inputs():
    return [torch.randn(batch_size, features)]


def get_init_inputs():
    return [features]
"""


def test_what_a_checkpoint_does_not_hold_stays_the_models_own_on_reload():
    """A random initial state kept as a plain attribute (an LSTM's ``h0``) is in no state_dict:
    loading Model's checkpoint of another seed moves it in neither Model nor a verbatim
    solution, so ``reload`` passes the copy. A weight copied on the first forward still fails."""
    checks, _ = _weights_checks(HIDDEN.replace("class Model(", "class ModelNew("), "hidden", HIDDEN)
    assert checks["derived"]["status"] == "pass" and checks["reload"]["status"] == "pass", checks
    stale = HIDDEN.replace("class Model(", "class ModelNew(").replace(
        "        return self.linear(x) + self.h0",
        "        if not hasattr(self, 'w'):\n"
        "            self.w = self.linear.weight.detach().clone()\n"
        "        return x @ self.w.t() + self.linear.bias + self.h0")
    checks, _ = _weights_checks(stale, "hidden_stale", HIDDEN)
    assert checks["reload"]["status"] == "fail" and "stale" in checks["reload"]["detail"], checks


def test_every_failing_gate_leaves_a_case_that_replays_alone(tmp_path):
    """The audit keeps each failing gate's case beneath OUT/cases, one file a kernel and gate,
    minimized with that gate's own verdict at each step (G01's bound, G05's non-finite rules),
    and ``kfuzz verify --replay`` runs it alone to the same failure; ``kfuzz minimize`` on such a
    case judges it by its gate too and keeps the gate in the new record."""
    import kfuzz.cli.minimize  # noqa: F401  (registers the verb)
    import kfuzz.cli.verify  # noqa: F401  (registers the verb)
    from kfuzz.audit import case_path
    from kfuzz.corpus import load
    entries = [control("zeros_under_tolerance"), control("drops_nan")]
    records = {r["key"]: r for r in run_audit(entries, tmp_path / "out", ["G01", "G05"], timeout=180)}
    files = []
    for e in entries:
        for gid, g in records[e.key]["gates"].items():
            if g["status"] != "fail":
                continue
            path = case_path(tmp_path / "out" / "cases", e.pair.target_name, gid)
            assert g["case_file"] == str(path) and path.is_file(), g
            files.append(path)
    g01 = records[entries[0].key]["gates"]["G01"]
    assert g01["status"] == "fail" and g01["minimized"] is True, g01
    assert load(case_path(tmp_path / "out" / "cases", entries[0].pair.target_name, "G01"))[1]["gate"] == "G01"
    g05 = records[entries[1].key]["gates"]["G05"]
    assert g05["status"] == "fail" and g05["minimized"] is True, g05
    shrunk = load(g05["case_file"])[1]["minimize"]
    assert shrunk["steps"] and shrunk["minimized"]["dims"] != shrunk["found"]["dims"], shrunk
    assert len(files) >= 2
    r = CliRunner().invoke(cli, ["verify", *[a for f in files for a in ("--replay", str(f))], "--in-process"])
    assert r.exit_code == 0 and r.output.count("ok ") == len(files), r.output
    again = tmp_path / "again.case.zst"
    r = CliRunner().invoke(cli, ["minimize", g05["case_file"], "--out", str(again), "--in-process"])
    assert r.exit_code == 0, r.output
    assert load(again)[1]["gate"] == "G05" and "resolve" in load(again)[1], load(again)[1]
    r = CliRunner().invoke(cli, ["verify", "--replay", str(again), "--in-process"])
    assert r.exit_code == 0 and "G05: still fails" in r.output, r.output


EXTRA_PARAMETER = """# reference: reference_linear.py
# planted: maps NaN to zero, and holds a parameter the reference has not (its weights load by seed only)
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x):
        y = self.linear(x) * self.gain
        return torch.where(torch.isnan(y), torch.zeros_like(y), y)
"""


def _extra_parameter_g05_case(folder, out):
    """Audit EXTRA_PARAMETER (a controls folder ``folder``) through G05 into ``out``: its entry and
    the path of its failing G05 case."""
    import shutil
    from kfuzz.audit import case_path
    folder.mkdir(parents=True)
    shutil.copy(CONTROLS / "reference_linear.py", folder)
    (folder / "extra_parameter.py").write_text(EXTRA_PARAMETER)
    entry, = read_corpus(folder)
    record, = run_audit([entry], out, ["G05"], timeout=180)
    assert record["gates"]["G05"]["status"] == "fail", record["gates"]
    return entry, case_path(out / "cases", entry.pair.target_name, "G05")


@pytest.mark.parametrize("sandboxed", [False, True])
def test_a_gate_case_replays_with_the_weights_the_gates_judged_with(tmp_path, sandboxed):
    """A solution whose weights do not load as Model's (W) is judged by the gates on the
    weights the audit gave it; its failing case records them (``resolve``), and ``kfuzz verify
    --replay`` builds that solution again, in this process or in a sandboxed worker, to the
    same failure (not to the strict loader's WeightsContractError)."""
    import kfuzz.cli.verify  # noqa: F401  (registers the verb)
    from kfuzz.corpus import load
    entry, path = _extra_parameter_g05_case(tmp_path / "ctl", tmp_path / "out")
    assert load(path)[1]["resolve"] == {"weights": "seed", "sha": entry.pair.sha}
    r = CliRunner().invoke(cli, ["verify", "--replay", str(path), "--device", "cpu",
                                 *([] if sandboxed else ["--in-process"])])
    assert r.exit_code == 0 and "still fails" in r.output and "nonfinite" in r.output, r.output
    if not sandboxed:   # a record naming weights the adapter does not know: bad input, named
        from kfuzz.case import encode
        case, rec = load(path)
        bad = tmp_path / "bad.case.zst"
        bad.write_bytes(encode(case, {**rec, "resolve": {"weights": "borrowed"}}))
        r = CliRunner().invoke(cli, ["verify", "--replay", str(bad), "--in-process"])
        assert r.exit_code == 2 and "bad.case.zst" in r.output and "'borrowed'" in r.output, r.output


def test_a_gate_case_replays_on_another_machine_from_a_corpus_folder_named_there(tmp_path, monkeypatch):
    """A gate case names its target by the corpus path the audit was given. Where that path is
    not here, ``kfuzz verify --replay`` says so and how to name the folder that holds the corpus
    (``--corpora``); with it, the case replays to the same failure, in this process and in a
    sandboxed worker (a fresh kfuzz); a corpus of that name whose row is another pair is refused."""
    import shutil
    import subprocess
    import sys
    import kfuzz.cli.verify  # noqa: F401  (registers the verb)
    from kfuzz.kernelbench.corpus import CORPORA_ENV
    monkeypatch.setenv(CORPORA_ENV, "")      # what the command sets is undone after the test
    folder = tmp_path / "audited" / "ctl"
    _, path = _extra_parameter_g05_case(folder, tmp_path / "out")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(str(folder), str(elsewhere / "ctl"))
    r = CliRunner().invoke(cli, ["verify", "--replay", str(path), "--in-process"])
    assert r.exit_code == 2 and "no such corpus file or folder" in r.output and "--corpora" in r.output, r.output
    r = CliRunner().invoke(cli, ["verify", "--replay", str(path), "--in-process", "--corpora", str(elsewhere)])
    assert r.exit_code == 0 and "still fails" in r.output and str(folder) in r.output, r.output
    p = subprocess.run([sys.executable, "-c", "from kfuzz.cli import main; main()", "verify", "--replay", str(path),
                        "--device", "cpu",
                        "--corpora", str(elsewhere)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, CORPORA_ENV: ""})
    assert p.returncode == 0 and "still fails" in p.stdout, p.stdout + p.stderr
    with open(elsewhere / "ctl" / "extra_parameter.py", "a") as f:
        f.write("# another solution of the same name\n")
    r = CliRunner().invoke(cli, ["verify", "--replay", str(path), "--in-process", "--corpora", str(elsewhere)])
    assert r.exit_code == 2 and "not the pair the case was judged on" in r.output, r.output


FLAT = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return {body}


batch_size = 16
dim = 64


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
"""


def test_a_layout_the_reference_itself_refuses_is_outside_the_contract_not_a_gate_error():
    """A reference that calls .view() on its input raises on a permuted layout: G04 passes that
    case saying so (instead of the gate erroring), and a kernel wrong on another layout still fails."""
    from kfuzz.gates import GATES, run_gate
    ref = FLAT.format(body="x.view(-1).sum().reshape(1)")
    ok = load_pair(ref, FLAT.format(body="x.reshape(-1).sum().reshape(1)").replace("class Model(", "class ModelNew("),
                   "view_ok")
    r = run_gate(GATES["G04"], as_target(ok), seed=0)
    assert r.status == "pass", r.reason
    wrong = load_pair(ref, FLAT.format(body="(x.reshape(-1).sum() if x.is_contiguous() else x[0].sum()).reshape(1)")
                      .replace("class Model(", "class ModelNew("), "view_wrong")
    r = run_gate(GATES["G04"], as_target(wrong), seed=0)
    assert r.status == "fail" and r.first_failure[1].kind == "bound", r.reason


def test_builds_find_the_precompiled_header_of_their_flags_first_on_the_include_path(tmp_path, monkeypatch):
    """The build step's host file gets the folder of the precompiled torch header made for its
    extra_cflags first on its include path, and nothing where none was made for those flags;
    the flags are read from the solution statically."""
    import torch.utils.cpp_extension as ext
    from kfuzz.kernelbench import pch
    code = ("from torch.utils.cpp_extension import load_inline\n"
            "a = load_inline(name='a', cpp_sources='', extra_cflags=['-O3', ''])\n"
            "b = load_inline(name='b', cpp_sources='')\nc = load_inline(name='c', cpp_sources='', extra_cflags=F)\n")
    assert pch.cflag_sets(code) == [("-O3",), ()]
    seen = []
    monkeypatch.setattr(ext, "_write_ninja_file_and_build_library",
                        lambda name, sources, extra_cflags, **kw: seen.append((name, kw["extra_include_paths"])))
    monkeypatch.setattr(pch, "PCH_USED", [])
    folder = tmp_path / pch.pch_key(["-O3"]) / "torch"
    folder.mkdir(parents=True)
    (folder / "extension.h.gch").write_bytes(b"")
    pch.use_pch(tmp_path)
    for name, flags in (("fast", ["-O3", " "]), ("plain", [])):
        ext._write_ninja_file_and_build_library(name=name, sources=[], extra_cflags=flags, extra_cuda_cflags=[],
                                                extra_ldflags=[], extra_include_paths=["inc"], build_directory="d",
                                                verbose=False, with_cuda=False)
    assert seen == [("fast", [str(folder.parent), "inc"]), ("plain", ["inc"])]
    assert pch.PCH_USED == ["fast"]


def test_a_build_waits_for_a_precompiled_header_marked_pending_and_the_maker_clears_every_mark(tmp_path, monkeypatch):
    """A header that kfuzz's process is about to make is marked pending: a build of its flags
    waits for it and then finds it; the maker removes each mark, also where making one fails."""
    import threading
    import torch.utils.cpp_extension as ext
    from kfuzz import audit
    from kfuzz.kernelbench import pch
    seen = []
    monkeypatch.setattr(ext, "_write_ninja_file_and_build_library",
                        lambda name, sources, extra_cflags, **kw: seen.append((name, kw["extra_include_paths"])))
    monkeypatch.setattr(pch, "PCH_USED", [])
    marker = pch.mark_pending(tmp_path, ["-O3"])
    folder = tmp_path / pch.pch_key(["-O3"]) / "torch"
    folder.mkdir(parents=True)

    def make():
        time.sleep(1.0)
        (folder / "extension.h.gch").write_bytes(b"")
        os.remove(marker)
    maker = threading.Thread(target=make)
    maker.start()
    pch.use_pch(tmp_path)
    ext._write_ninja_file_and_build_library(name="fast", sources=[], extra_cflags=["-O3"], extra_cuda_cflags=[],
                                            extra_ldflags=[], extra_include_paths=[], build_directory="d",
                                            verbose=False, with_cuda=False)
    maker.join()
    assert seen == [("fast", [str(folder.parent)])]

    made = []

    def ensure(root, flags):
        made.append(sorted(p.name for p in Path(root).glob("*/" + pch.PENDING)))
        if flags:
            raise OSError("the compiler failed")
        return None
    monkeypatch.setattr(pch, "ensure_pch", ensure)
    code = "from torch.utils.cpp_extension import load_inline\nm = load_inline(name='m', cpp_sources='', extra_cflags={})\n"
    base = control("correct_sum")
    entries = [dataclasses.replace(base, pair=dataclasses.replace(base.pair, custom_code=code.format(flags)))
               for flags in ("[]", "[]", "['-O2']")]
    with pytest.raises(OSError):
        audit.precompile_headers(entries, tmp_path / "pch")
    assert made == [[pch.PENDING, pch.PENDING], [pch.PENDING]]     # both marked first, in use order
    assert not list((tmp_path / "pch").glob("*/" + pch.PENDING))


def test_a_cuda_file_is_slimmed_to_torch_types_only_where_it_names_nothing_the_frontend_alone_declares():
    from kfuzz.kernelbench.cuda_compile import slim_cuda_source
    kernel = "\n__global__ void k(float* x) { x[0] = 1.0f; }\ntorch::Tensor f(torch::Tensor x) { return x; }\n"
    for include in ("#include <torch/extension.h>", '#include "torch/extension.h"', "  #  include <torch/torch.h>",
                    "#include <torch/all.h> // everything"):
        got = slim_cuda_source("#include <cuda.h>\n" + include + kernel)
        assert got == "#include <cuda.h>\n#include <torch/types.h>" + kernel, include
    assert slim_cuda_source("#include <torch/types.h>" + kernel) is None           # nothing to slim
    assert slim_cuda_source("// #include <torch/extension.h> in a comment" + kernel) is None
    assert slim_cuda_source("#include <torch/extension.h>\n// a PyTorch fallback" + kernel) is not None
    for use in ("PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"f\", &f); }", "py::object o;",
                "PyObject* p;", "Py_INCREF(p);", "namespace F = torch::nn::functional;", "torch::optim::SGD s;",
                "#include <pybind11/pybind11.h>", "TORCH_LIBRARY(ops, m) {}", "auto n = torch::cuda::device_count();"):
        assert slim_cuda_source("#include <torch/extension.h>" + kernel + use) is None, use


def test_a_slimmed_copy_is_written_again_only_where_it_changed(tmp_path, monkeypatch):
    """A second build of the same extension (the kernel's build step after its build ahead)
    leaves the slimmed copy as it was, so ninja does not compile it again; a changed CUDA file
    gets a new copy."""
    import torch.utils.cpp_extension as ext
    from kfuzz.kernelbench import cuda_compile
    monkeypatch.setattr(ext, "_write_ninja_file_and_build_library", lambda name, sources, *a, **kw: None)
    monkeypatch.setattr(cuda_compile, "SLIM_USED", [])
    cuda_compile.use_slim_cuda()
    (tmp_path / "cuda.cu").write_text("#include <torch/extension.h>\n__global__ void k() {}\n")
    copy = tmp_path / "cuda.slim.cu"

    def call():
        ext._write_ninja_file_and_build_library(name="e", sources=[str(tmp_path / "cuda.cu")], extra_cflags=[],
                                                build_directory=str(tmp_path), verbose=False, with_cuda=True)
    call()
    os.utime(copy, (1_000_000, 1_000_000))        # older than anything a build writes
    call()
    assert copy.stat().st_mtime == 1_000_000 and cuda_compile.SLIM_USED == ["e", "e"]
    (tmp_path / "cuda.cu").write_text("#include <torch/extension.h>\n__global__ void k2() {}\n")
    call()
    assert copy.stat().st_mtime > 1_000_000 and "k2" in copy.read_text()


def test_a_slimmed_cuda_file_that_does_not_compile_builds_as_written_and_the_written_files_stay(tmp_path, monkeypatch):
    """The build step compiles load_inline's CUDA file from a slimmed copy beside it; where the
    copy fails, the same call builds the files as written (the original's result decides), and
    sources elsewhere or of another kind are passed as they are."""
    import torch.utils.cpp_extension as ext
    from kfuzz.kernelbench import cuda_compile
    calls = []

    def compiler(name, sources, extra_cflags, **kw):
        """compiles a CUDA file (to <stem>.cuda.o, as ninja does) only where everything it uses
        is declared, then the host file"""
        calls.append((name, [os.path.basename(s) for s in sources]))
        errors = []
        for src in sources:             # every file compiles (ninja's jobs side by side), then errors
            text = open(src).read()
            if "at::frontend_only" in text and "torch/extension.h" not in text:
                errors.append(f"Error building extension '{name}': at::frontend_only undeclared")
            elif "undeclared_in_host" in text:
                errors.append(f"Error building extension '{name}': main.cpp: 'forward' was not declared")
            elif src.endswith(".cu") and os.path.dirname(src) == kw["build_directory"]:
                open(src[:-len(".cu")] + ".cuda.o", "w").close()
        if errors:
            raise RuntimeError(errors[0])
    monkeypatch.setattr(ext, "_write_ninja_file_and_build_library", compiler)
    monkeypatch.setattr(cuda_compile, "SLIM_USED", [])
    monkeypatch.setattr(cuda_compile, "SLIM_REFUSED", [])
    cuda_compile.use_slim_cuda()
    cuda_compile.use_slim_cuda()                  # once a process
    elsewhere = tmp_path / "user.cu"
    elsewhere.write_text("#include <torch/extension.h>\n")
    for name, body in (("lean", ""), ("needs", "at::frontend_only();")):
        folder = tmp_path / name
        folder.mkdir()
        written = "#include <torch/types.h>\n#include <torch/extension.h>\n" + body
        (folder / "cuda.cu").write_text(written)
        (folder / "main.cpp").write_text("#include <torch/extension.h>\n")
        ext._write_ninja_file_and_build_library(
            name=name, sources=[str(folder / "main.cpp"), str(folder / "cuda.cu"), str(elsewhere)], extra_cflags=[],
            extra_cuda_cflags=[], extra_ldflags=[], extra_include_paths=[], build_directory=str(folder),
            verbose=False, with_cuda=True)
        assert (folder / "cuda.cu").read_text() == written
        assert (folder / "cuda.slim.cu").read_text() == written.replace("<torch/extension.h>", "<torch/types.h>")
        assert (folder / "main.cpp").read_text() == "#include <torch/extension.h>\n"
    assert calls == [("lean", ["main.cpp", "cuda.slim.cu", "user.cu"]),
                     ("needs", ["main.cpp", "cuda.slim.cu", "user.cu"]), ("needs", ["main.cpp", "cuda.cu", "user.cu"])]
    assert cuda_compile.SLIM_USED == ["lean"] and cuda_compile.SLIM_REFUSED == ["needs"]
    # the copy compiled and the host file failed: the files as written would fail there too
    folder = tmp_path / "host"
    folder.mkdir()
    (folder / "cuda.cu").write_text("#include <torch/extension.h>\n")
    (folder / "main.cpp").write_text("undeclared_in_host\n")
    del calls[:]
    with pytest.raises(RuntimeError, match="'forward' was not declared"):
        ext._write_ninja_file_and_build_library(
            name="host", sources=[str(folder / "main.cpp"), str(folder / "cuda.cu")], extra_cflags=[],
            extra_cuda_cflags=[], extra_ldflags=[], extra_include_paths=[], build_directory=str(folder),
            verbose=False, with_cuda=True)
    assert calls == [("host", ["main.cpp", "cuda.slim.cu"])] and cuda_compile.SLIM_USED == ["lean", "host"]
    with pytest.raises(RuntimeError, match="frontend_only"):       # the original's own failure is the build's
        folder = tmp_path / "broken"
        folder.mkdir()
        (folder / "cuda.cu").write_text("#include <torch/types.h>\nat::frontend_only();")
        ext._write_ninja_file_and_build_library(
            name="broken", sources=[str(folder / "cuda.cu")], extra_cflags=[], extra_cuda_cflags=[], extra_ldflags=[],
            extra_include_paths=[], build_directory=str(folder), verbose=False, with_cuda=True)


@pytest.mark.parametrize("host", ["fails", "compiles"])
def test_a_build_compiles_its_cuda_files_only_where_its_host_files_compiled(tmp_path, monkeypatch, host):
    """kfuzz.kernelbench.cuda_compile.host_first: torch's ninja file, with a host compile that fails or
    not, and a CUDA compile that leaves a mark (no compiler: ninja runs the rules as written)."""
    import shutil
    import torch.utils.cpp_extension as ext
    from kfuzz.kernelbench.cuda_compile import HostBuildError, host_first
    if not shutil.which("ninja"):
        pytest.skip("no ninja here")
    monkeypatch.setattr(ext, "_run_ninja_build", ext._run_ninja_build)
    (tmp_path / "main dir").mkdir()
    for name in ("main dir/main.cpp", "cuda.cu"):
        (tmp_path / name).write_text("")
    (tmp_path / "build.ninja").write_text(textwrap.dedent(f"""\
        rule compile
          command = {"echo 'main.cpp:4: error: f was not declared' && false" if host == "fails" else "touch $out"}
        rule cuda_compile
          command = touch $out
        rule link
          command = touch $out
        build main$ dir.o: compile main$ dir/main.cpp
        build cuda.cuda.o: cuda_compile cuda.cu
        build x.so: link main$ dir.o cuda.cuda.o
        default x.so
    """))
    host_first()
    if host == "fails":
        with pytest.raises(HostBuildError, match="^Error building extension 'x': .*f was not declared"):
            ext._run_ninja_build(str(tmp_path), False, "Error building extension 'x'")
        assert not (tmp_path / "cuda.cuda.o").exists()
    else:
        ext._run_ninja_build(str(tmp_path), False, "Error building extension 'x'")
        assert (tmp_path / "x.so").exists() and (tmp_path / "main dir.o").exists()


def test_a_build_step_runs_a_compiler_installed_as_a_script_under_a_prefix_of_its_own(tmp_path, monkeypatch):
    """torch's cpp_extension runs ``$CXX``; where that is a script under a prefix of its own (the
    H200 machine's /opt/gcc/bin/g++), its shell reads it: the build step's confinement lets it
    (reads of the toolchain), else every build there ends in 'Permission denied' (exit 126)."""
    import shutil
    import subprocess
    from kfuzz import sandbox
    from kfuzz.audit import build_policy
    from test_sandbox import _in_confined_child
    if not sandbox.landlock_abi():
        pytest.skip("no Landlock here: reads are not confined")
    real = shutil.which("c++") or shutil.which("g++")
    if real is None:
        pytest.skip("no C++ compiler here")
    wrapper = tmp_path / "gcc" / "bin" / "g++"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f'#!/bin/sh\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    (tmp_path / "ext").mkdir()
    (tmp_path / "work").mkdir()
    policy = build_policy("cpu", str(tmp_path / "ext"))
    assert str(tmp_path / "gcc") in policy.readable
    # a CUDA kernel worker given the extension cache to read keeps the toolchain's reads too
    from kfuzz.audit import kernel_policy
    assert {str(tmp_path / "gcc"), "/cache"} <= set(kernel_policy("cuda", readable=("/cache",)).readable)
    got = _in_confined_child(lambda _: subprocess.run([str(wrapper), "--version"], capture_output=True).returncode,
                             tmp_path / "work", policy)
    assert got == "0", got
    # the same without the toolchain's reads: the shell cannot read the script
    bare = dataclasses.replace(policy, readable=())
    refused = _in_confined_child(lambda _: subprocess.run([str(wrapper), "--version"], capture_output=True).returncode,
                                 tmp_path / "work", bare)
    assert refused == "126" or refused.startswith("PermissionError"), refused


RELU_REF = ("import torch\nimport torch.nn as nn\nclass Model(nn.Module):\n    def forward(self, x):\n"
            "        return torch.relu(x)\ndef get_inputs():\n    return [torch.rand(4)]\n"
            "def get_init_inputs():\n    return []\n")


def build_here(monkeypatch, cache, solution: str, name: str) -> dict:
    """The build step's facts for ``solution`` (beside RELU_REF), built in this process into
    ``cache``; torch's builders are restored afterwards. Skips where nothing can build."""
    import shutil
    import torch.utils.cpp_extension as ext
    from kfuzz.kernelbench.build import build_solution
    from kfuzz.kernelbench.source import KernelBenchPair
    if not (shutil.which("ninja") and shutil.which("c++")):
        pytest.skip("no ninja or C++ compiler here: load_inline cannot build")
    for attr in ("load_inline", "load", "_write_ninja_file_and_build_library", "FileBaton"):
        monkeypatch.setattr(ext, attr, getattr(ext, attr))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(cache))
    return build_solution(KernelBenchPair(name=name, ref_code=RELU_REF, custom_code=solution))


def test_a_build_error_the_solution_catches_is_named_in_the_build_step_facts(tmp_path, monkeypatch):
    """A solution that falls back to PyTorch when its extension does not build imports fine: the
    build step still says which load_inline call failed (``caught``), so that a record shows
    the gates judged its fallback, not its extension."""
    new = ("import torch\nimport torch.nn as nn\nfrom torch.utils.cpp_extension import load_inline\n"
           "try:\n    ext = load_inline('kfuzz_never_builds', cpp_sources='int f( { return 1; }',\n"
           "                      functions=['f'], no_implicit_headers=True)\nexcept Exception:\n    ext = None\n"
           "class ModelNew(nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n")
    facts = build_here(monkeypatch, tmp_path, new, "fallback")
    assert facts["status"] == "built" and facts["caught"], facts
    assert "kfuzz_never_builds" in facts["caught"][0], facts
    assert facts["loaded"] == [] and fell_back(facts), facts


def test_a_solution_whose_second_build_loads_did_not_fall_back(tmp_path, monkeypatch):
    """A solution that catches its first build's error and loads a second extension runs an
    extension, not a fallback: the build step's facts name both, and ``fell_back`` is false."""
    new = ("import torch\nimport torch.nn as nn\nfrom torch.utils.cpp_extension import load_inline\n"
           "try:\n    ext = load_inline('kfuzz_first_try', cpp_sources='int f( {', no_implicit_headers=True)\n"
           "except RuntimeError:\n"
           f"    ext = load_inline('kfuzz_second_try', cpp_sources={PER_PROCESS_MODULE!r}, no_implicit_headers=True)\n"
           "class ModelNew(nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n")
    facts = build_here(monkeypatch, tmp_path, new, "second")
    assert "kfuzz_first_try" in facts["caught"][0] and facts["loaded"] == ["kfuzz_second_try"], facts
    assert facts["cpu_seconds"] > 0, facts     # the compilers it ran, twice
    assert not fell_back(facts) and fell_back({"caught": ["an error"]}) and not fell_back(None)


def test_a_failed_build_keeps_what_the_compiler_said(tmp_path, monkeypatch):
    """A solution whose extension does not compile fails its build, and the build step's facts
    end with the compiler's message, also where the solution asked load_inline for verbose
    output (which prints the message instead of putting it in torch's error)."""
    new = ("import torch.nn as nn\nfrom torch.utils.cpp_extension import load_inline\n"
           "ext = load_inline('kfuzz_bad_syntax', cpp_sources='int f( { return 1; }' + ' ' * 2000,\n"
           "                  no_implicit_headers=True, verbose=True)\n"
           "class ModelNew(nn.Module):\n    pass\n")
    facts = build_here(monkeypatch, tmp_path, new, "bad")
    assert facts["status"] == "failed", facts
    assert "error:" in facts["error"] and "kfuzz_bad_syntax" in facts["error"], facts["error"]


def test_a_record_that_kfuzz_could_not_finish_is_printed_as_an_error_never_ok():
    """An audit line for a record whose gates erred, or whose run ended in kfuzz's error (a
    worker that did not start), says ERROR and names the error, and the record counts as
    incomplete; without a violation it would otherwise read as ok and exit 0."""
    from kfuzz.cli.audit import LABELS, _line
    base = {"key": "x.jsonl:1", "standard": {"passed": True}, "seconds": 1.0}
    gate = _line({**base, "gates": {"G01": {"status": "pass"}, "G02": {"status": "error", "reason": "ValueError: x"}}})
    run = _line({**base, "gates": {}, "error": {"error": "RuntimeError: worker for 'k' could not start"}})
    assert gate.startswith("ERROR    x.jsonl:1") and "error: G02: ValueError: x" in gate
    assert run.startswith("ERROR ") and "error: RuntimeError: worker for 'k' could not start" in run
    assert _line({**base, "gates": {"G01": {"status": "pass"}}}).startswith("ok       x.jsonl:1")
    assert "ERROR" in LABELS
    # and the audit's exit: incomplete (1), not as expected (0)
    from kfuzz.audit import outcome
    gates_erred = {**base, "gates": {"G02": {"status": "error", "reason": "ValueError: x"}}}
    assert [outcome(r) for r in (gates_erred, {**base, "gates": {}, "error": {"error": "RuntimeError: x"}},
                                 {**base, "gates": {"G01": {"status": "pass"}}})] == [
        "incomplete", "incomplete", "expected"]


def test_a_clipped_build_message_keeps_the_compilers_error_lines():
    """ninja prints the failed command, the compiler's message, then the status lines of
    commands still running: a clipped message keeps the error though long lines follow it."""
    from kfuzz.kernelbench.build import clip
    text = ("[1/3] c++ " + "-I/x " * 100 + "main.cpp\nFAILED: cuda.o\nnvcc " + "-I/y " * 100 + "\n"
            "cuda.cu(62): error: no suitable conversion function exists\n1 error detected\n"
            "[2/3] c++ " + "-I/z " * 200 + "\nninja: build stopped: subcommand failed.\n")
    out = clip(text, 1000)
    assert len(out) <= 1020 and "cuda.cu(62): error: no suitable conversion" in out, out
    assert out.startswith("[1/3] c++") and out.endswith("ninja: build stopped: subcommand failed.\n"), out
    assert clip("short", 1000) == "short"


def test_a_solutions_own_build_directory_is_moved_beneath_the_cache(tmp_path, monkeypatch):
    """A solution that builds in a folder of its choosing (``build_directory``) builds beneath
    the extension cache instead, where the build step may write, and the kernel's worker
    (``prebuilt_only``) loads it from there; nothing is written where the solution asked."""
    import torch.utils.cpp_extension as ext
    from kfuzz.kernelbench.build import prebuilt_only
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    module = ('#include <Python.h>\nstatic struct PyModuleDef m = {PyModuleDef_HEAD_INIT, "kfuzz_elsewhere", '
              'NULL, -1, NULL};\nPyMODINIT_FUNC PyInit_kfuzz_elsewhere(void) { return PyModule_Create(&m); }\n')
    new = ("import torch.nn as nn\nfrom torch.utils.cpp_extension import load_inline\n"
           f"ext = load_inline('kfuzz_elsewhere', cpp_sources={module!r}, no_implicit_headers=True,\n"
           f"                  build_directory={str(elsewhere)!r})\n"
           "class ModelNew(nn.Module):\n    pass\n")
    facts = build_here(monkeypatch, cache, new, "elsewhere")
    assert facts["status"] == "built" and "caught" not in facts, facts
    (folder,) = facts["extensions"]
    assert folder.startswith("build_directory-") and not elsewhere.exists(), facts
    prebuilt_only()
    loaded = ext.load_inline("kfuzz_elsewhere", cpp_sources=module, no_implicit_headers=True,
                             build_directory=str(elsewhere))
    assert loaded.__name__ == "kfuzz_elsewhere" and not elsewhere.exists()


PER_PROCESS_MODULE = ('#include <Python.h>\n#define CAT2(a, b) a##b\n#define CAT(a, b) CAT2(a, b)\n#define STR2(a) #a\n'
           '#define STR(a) STR2(a)\nstatic struct PyModuleDef m = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), '
           'NULL, -1, NULL};\nPyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&m); }\n')


@pytest.mark.parametrize("broken", [False, True], ids=["builds", "fails-and-is-caught"])
def test_an_extension_named_anew_in_each_process_loads_what_the_build_step_built(tmp_path, monkeypatch, broken):
    """A solution whose extension's name and folder change from process to process (the time,
    the process id, a temporary folder in them) loads, in the kernel's worker, the extension that
    the build step built from the same sources, and writes nothing there; where that build
    failed and the solution caught it, the worker's call fails too and the solution falls back
    as it did in the build step."""
    import os
    import subprocess
    import sys
    cache = tmp_path / "cache"
    source = PER_PROCESS_MODULE + ("int broken( {\n" if broken else "")
    new = ("import tempfile, uuid\nimport torch.nn as nn\nfrom torch.utils.cpp_extension import load_inline\n"
           "try:\n"
           f"    ext = load_inline('kfuzz_renamed_' + uuid.uuid4().hex[:8], cpp_sources={source!r},\n"
           "                      no_implicit_headers=True, build_directory=tempfile.mkdtemp())\n"
           "except RuntimeError as e:\n    ext = e\n"
           "class ModelNew(nn.Module):\n    pass\n")
    facts = build_here(monkeypatch, cache, new, "renamed")
    assert facts["status"] == "built" and bool(facts.get("caught")) == broken, facts
    before = sorted(p for p in cache.rglob("*"))
    worker = ("import sys\nfrom kfuzz.kernelbench.build import prebuilt_only\nprebuilt_only()\nscope = {}\n"
              "exec(sys.stdin.read(), scope)\nprint(type(scope['ext']).__name__, getattr(scope['ext'], '__name__', ''),"
              " str(scope['ext'])[:200] if isinstance(scope['ext'], Exception) else '')\n")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(cache), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", worker], input=new, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p for p in cache.rglob("*")) == before
    if broken:
        assert r.stdout.startswith("RuntimeError") and "was not built by the build step" in r.stdout, r.stdout
    else:
        assert r.stdout.startswith("module kfuzz_renamed_"), r.stdout


def test_the_throughput_tool_audits_a_compiled_kernel_and_says_how_it_built(tmp_path):
    """tools/bench_audit_throughput.py on the compiled escape kernels (one, on the CPU): its
    summary counts the record and its build, with no failed build or fallback."""
    import shutil
    import subprocess
    import sys
    if not (shutil.which("ninja") and shutil.which("c++")):
        pytest.skip("no ninja or C++ compiler here: load_inline cannot build")
    tool = ROOT / "tools" / "bench_audit_throughput.py"
    r = subprocess.run([sys.executable, str(tool), str(ESCAPES), "--limit", "1", "--budget", "1", "--jobs", "1",
                        "--build-jobs", "0", "--device", "cpu", "--no-pch", "--out", str(tmp_path / "out"),
                        "--key", str(tmp_path / "key")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads((tmp_path / "out" / "throughput.json").read_text())
    assert got["recorded"] == 1 and got["build_failed"] == 0 and got["fell_back"] == 0, got
    assert got["settings"]["build_timeout"] == 600.0, got["settings"]     # kfuzz audit's, not --timeout
    (rec,) = [json.loads(line) for line in (tmp_path / "out" / "audit" / "results.jsonl").read_text().splitlines()]
    assert rec["build"]["status"] == "built" and rec["build"]["extensions"] and "caught" not in rec["build"], rec
    assert got["build_seconds_mean"] == round(rec["build"]["seconds"], 1), (got, rec["build"])
    assert rec["build"]["cpu_seconds"] > 0 and got["build_cpu_seconds_mean"] == round(rec["build"]["cpu_seconds"], 1)
    assert rec["cpu"]["oracle_process"] > 0 and rec["cpu"]["workers"] > 0, rec.get("cpu")
    assert set(got["core_seconds_per_kernel_by_process"]) >= {"compilers", "oracle_process", "workers"}, got
    assert "core-seconds a kernel by process: compilers" in r.stdout, r.stdout
    row = next(line for line in r.stdout.splitlines() if line.startswith("| kfuzz audit"))
    assert row.split(" | ")[1:4] == ["1", str(got["wall_s"]), str(got["kernels_per_hour"])], r.stdout


def test_the_throughput_sample_leaves_out_kernels_already_recorded(tmp_path):
    """--exclude RESULTS: the sample takes no kernel with a line in that results file (a torn
    line is skipped), so a measurement audits kernels not yet audited."""
    spec = importlib.util.spec_from_file_location("bench_audit_throughput", ROOT / "tools" / "bench_audit_throughput.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    every = tool.sample([str(ESCAPES)], 100)
    assert len(every) >= 2
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps({"key": every[0].key, "seconds": 1.0}) + "\n" + '{"key": "torn')
    assert tool.recorded_keys(results) == {every[0].key}
    left = tool.sample([str(ESCAPES)], 100, tool.recorded_keys(results))
    assert [e.key for e in left] == [e.key for e in every[1:]]
    with pytest.raises(SystemExit) as stop:      # a results file that is not there: bad usage
        tool.main([str(ESCAPES), "--exclude", str(tmp_path / "none.jsonl")])
    assert stop.value.code == 2


def test_the_throughput_table_gives_each_rate_over_the_baselines():
    spec = importlib.util.spec_from_file_location("bench_audit_throughput", ROOT / "tools" / "bench_audit_throughput.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    run = {"recorded": 4, "wall_s": 60.0, "kernels_per_hour": 240.0, "ends": {"complete": 4, "killed for time": 0}}
    lines = tool.table([("baseline", run), ("kfuzz audit", {**run, "kernels_per_hour": 720.0})]).splitlines()
    assert lines[0].endswith("| / baseline |") and lines[2].endswith("| 1.00 |") and lines[3].endswith("| 3.00 |")
    assert "baseline" not in tool.table([("kfuzz audit", run)]).splitlines()[0]


def test_the_throughput_summary_says_where_the_kernels_seconds_go():
    """The shares of the kernels' own seconds: their gates, minimizing the failing cases, the
    rest once the build, standard test and weights are counted, and the workers' starts (within
    those)."""
    spec = importlib.util.spec_from_file_location("bench_audit_throughput", ROOT / "tools" / "bench_audit_throughput.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    rec = {"key": "c:1", "seconds": 100.0, "build": {"status": "built", "seconds": 20.0},
           "standard": {"passed": True, "reason": "pass", "seconds": 10.0}, "weights": {"seconds": 5.0},
           "gates": {"G01": {"status": "fail", "seconds": 30.0, "minimize_seconds": 15.0},
                     "G02": {"status": "pass", "seconds": 10.0}},
           "starts": {"seconds": 12.0, "workers": 3, "phases": {"launch": 3.0, "cuda": 6.0, "target": 1.5}}}
    got = tool.summary([None], [(50.0, rec)], 100.0, {})
    assert (got["gates_share"], got["minimize_share"], got["rest_share"]) == (0.4, 0.15, 0.1), got
    assert got["worker_starts_share"] == 0.12 and got["worker_start_seconds_mean"] == 4.0
    assert got["worker_start_steps_mean"] == {"launch": 1.0, "cuda": 2.0, "target": 0.5}
    assert got["build_share"] == 0.2 and got["kernel_seconds_mean"] == 100.0
    assert got["cpu_busy_share"] is None and got["core_seconds_per_kernel"] is None   # not measured
    with_ahead = {**rec, "build": {"status": "built", "seconds": 9.0, "cpu_seconds": 40.0, "ahead": True}}
    got = tool.summary([None, None], [(50.0, with_ahead), (90.0, rec)], 100.0, {}, cpu=(800.0, 1600.0))
    assert (got["cpu_busy_share"], got["core_seconds_per_kernel"]) == (0.5, 400.0), got
    assert got["build_cpu_seconds_mean"] == 40.0, got     # over the kernels whose build said
    # the build ahead ran before the kernel's own seconds: it adds to the whole, not to its steps
    assert (got["built_ahead"], got["build_share"]) == (1, round(29.0 / 209.0, 3)), got
    # the machine's core-seconds a kernel by process: what the records account for, and the rest
    cpu = {"oracle_process": 30.0, "workers": 50.0}
    got = tool.summary([None, None], [(50.0, {**with_ahead, "cpu": cpu}), (90.0, {**rec, "cpu": cpu})], 100.0, {},
                       cpu=(800.0, 1600.0))
    assert got["core_seconds_per_kernel_by_process"] == {"compilers": 20.0, "oracle_process": 30.0, "workers": 50.0,
                                                         "rest": 300.0}, got
    busy, total = tool.machine_cpu()
    assert 0 < busy <= total


def audit_report():
    """tools/audit_report.py as a module."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("audit_report", ROOT / "tools" / "audit_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report


def g05_classes(fact: str) -> dict:
    """The audit report's arguable classes over two kernels whose only violation is G05, its
    failing case's ``fact`` set in one and unset in the other."""
    report = audit_report()
    recs = [{"key": f"c:{i}", "target": f"kb:c:{i}", "weights": {"status": "exact"}, "standard": {"passed": True},
             "gates": {"G05": {"status": "fail", "kind": "nonfinite",
                               "verdict": {"kind": "nonfinite", "metrics": {fact: flag}}}}}
            for i, flag in enumerate((1.0, 0.0))]
    assert [judge_record(r)["violations"] for r in recs] == [["G05"], ["G05"]]
    return report.summarize(recs)["arguable"]


def test_a_one_element_output_of_another_shape_alone_is_its_own_arguable_class():
    """A loss returned with shape [1] where the reference's is 0-d fails every gate's contract
    check, and nothing else: the report's class of its own. Another shape, or another failure
    beside it, is not in the class."""
    from kfuzz.case import Case
    from kfuzz.execute import contract_violation
    from kfuzz.target import Arg, Dim, Output, Target

    target = Target("c", lambda x: x.sum(), lambda x: x.sum(), {"x": Arg(("N",))}, {"loss": Output(())},
                    {"N": Dim(1, 8)})
    case = Case("c", "float32", 0, (("N", 4),))
    details = {shape: contract_violation({"loss": torch.zeros(shape)}, target, case, torch.device("cpu"))[1]
               for shape in ((1,), (2,))}

    def record(i, detail, kinds=None):
        gate = {"status": "fail", "kind": "contract", "verdict": {"kind": "contract", "detail": detail}}
        if kinds:
            gate["failing_kinds"] = kinds
        return {"key": f"c:{i}", "target": f"kb:c:{i}", "weights": {"status": "exact"},
                "standard": {"passed": False, "reason": "shape"}, "gates": {"G01": gate, "G02": dict(gate)}}
    recs = [record(0, details[(1,)]), record(1, details[(2,)]), record(2, details[(1,)], {"contract": 3, "bound": 1})]
    assert all(judge_record(r)["violations"] == ["G01", "G02"] for r in recs)
    label = next(k for k in audit_report().summarize([recs[0]])["arguable"] if k.startswith("only the shape"))
    assert [audit_report().summarize([r])["arguable"][label] for r in recs] == [1, 0, 0]


def test_a_kernel_that_only_raises_at_g03s_sizes_is_its_own_arguable_class():
    """G03's failing cases all exceptions, and no other violation: a loud refusal of the sizes
    varied, counted on its own; a wrong number among them, or another gate's failure, is not."""
    def record(i, kinds, also=()):
        gates = {"G03": {"status": "fail", "kind": "exception", "failing_kinds": kinds}}
        gates.update({g: {"status": "fail", "kind": "bound", "failing_kinds": {"bound": 1}} for g in also})
        return {"key": f"c:{i}", "target": f"kb:c:{i}", "weights": {"status": "exact"},
                "standard": {"passed": True}, "gates": gates}
    recs = [record(0, {"exception": 3}), record(1, {"exception": 2, "bound": 1}), record(2, {"exception": 1}, ["G04"])]
    label = next(k for k in audit_report().summarize([recs[0]])["arguable"] if k.startswith("only G03"))
    assert [audit_report().summarize([r])["arguable"][label] for r in recs] == [1, 0, 0]


def test_a_sandboxed_write_of_its_own_files_at_a_fixed_path_alone_is_its_own_arguable_class():
    """A solution whose only finding is a write the sandbox refused beneath /tmp or a hidden
    folder of a home (its sources written to /tmp/..., a library's cache) is counted on its own;
    a write elsewhere, or another violation beside it, is not."""
    def finding(path):
        return {"finding": "sandbox-write", "kind": "crash", "exc_type": "sandbox-write",
                "detail": f"os.mkdir {path!r}: a kernel may write only beneath its own directory"}

    def standard(path, gates=None):
        return {"weights": {"status": "exact"}, "gates": gates or {},
                "standard": {"passed": False, "reason": f"sandbox-write: {path}", "trials": 0, **finding(path)}}
    bound = {"G01": {"status": "fail", "kind": "bound", "failing_kinds": {"bound": 1}}}
    recs = [{"compiles": True, "build": {"status": "finding", **finding("/tmp/cuda_extensions")}},
            standard("/root/.cupy"), standard("/home/someone/.cache/lib"),
            standard("/etc/kfuzz-victim"), standard("/home/someone/notes"), standard("/tmp/scratch", bound)]
    for i, r in enumerate(recs):
        r.update({"key": f"c:{i}", "target": f"kb:c:{i}"})
    assert [judge_record(r)["violations"] for r in recs[:5]] == [["sandbox-write"]] * 5
    assert judge_record(recs[5])["violations"] == ["sandbox-write", "G01"]
    label = next(k for k in audit_report().summarize([recs[0]])["arguable"] if k.startswith("only a sandboxed write"))
    assert [audit_report().summarize([r])["arguable"][label] for r in recs] == [1, 1, 1, 0, 0, 0]


ROW_SUMS = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x, w):
        return (x @ w.T).sum(1, keepdim=True)


B = 8
N = 16
M = 12


def get_inputs():
    return [torch.randn(B, N), torch.randn(M, N)]


def get_init_inputs():
    return []
"""


UPPER_PRODUCT = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, A, B):
        return torch.triu(A @ B)


N = 16


def get_inputs():
    return [torch.triu(torch.randn(N, N)), torch.triu(torch.randn(N, N))]


def get_init_inputs():
    return []
"""


G05_CLASSES = [
    # sum(x W^T) rewritten as x sum(W): an Inf in x gives the reference inf - inf = NaN and the
    # rewrite an Inf; turning the NaN into a finite value is no such class
    (ROW_SUMS, "(x @ w.T).sum(1, keepdim=True)", "x @ w.sum(0, keepdim=True).T",
     "torch.nan_to_num((x @ w.T).sum(1, keepdim=True))", "kinds_only",
     "only G05, the kind of a non-finite value (NaN against an Inf)"),
    # triu(A @ B) of triangular inputs computed as A @ B (the product is upper triangular
    # anyway): a NaN on A's diagonal reaches its row's positions below the diagonal, which the
    # reference's triu sets to 0 whatever A holds; a NaN dropped where the reference's value
    # depends on it is no such class
    (UPPER_PRODUCT, "torch.triu(A @ B)", "A @ B", "torch.triu(torch.nan_to_num(A) @ B)", "where_ignored",
     "only G05, non-finite where the reference's value ignores the injected special"),
]


@pytest.mark.parametrize("ref,body,in_class,other,fact,label", G05_CLASSES, ids=[c[4] for c in G05_CLASSES])
def test_a_g05_failure_of_an_arguable_kind_is_its_own_class(ref, body, in_class, other, fact, label):
    """G05 fails both kernels (the reference defines the non-finite values); the first with the
    fact set in its failing case, which the report counts as an arguable class of its own, the
    second with it unset."""
    from kfuzz.gates import GATES, run_gate
    for name, new, flag in (("in_class", in_class, 1.0), ("other", other, 0.0)):
        pair = load_pair(ref, ref.replace("class Model(", "class ModelNew(").replace(body, new), f"{fact}_{name}")
        r = run_gate(GATES["G05"], as_target(pair), seed=0)
        assert r.status == "fail" and r.first_failure[1].metrics[fact] == flag, r.reason
    assert g05_classes(fact)[label] == 1


# a constant of the forward registered as a buffer: Model's checkpoint loads only with strict=False
OWN_CONSTANT = LINEAR.replace("class Model(", "class ModelNew(").replace(
    "        self.lin = nn.Linear(8, 8)\n",
    "        self.lin = nn.Linear(8, 8)\n        self.register_buffer('shift', torch.tensor(0.5))\n").replace(
    "torch.relu(self.lin(x) - 0.5)", "torch.relu(self.lin(x) - self.shift)")
# the weight's transpose registered as a buffer in __init__: a checkpoint loaded later leaves it stale
OWN_COPY = LINEAR.replace("class Model(", "class ModelNew(").replace(
    "        self.lin = nn.Linear(8, 8)\n",
    "        self.lin = nn.Linear(8, 8)\n        self.register_buffer('wt', self.lin.weight.detach().t().contiguous())\n").replace(
    "torch.relu(self.lin(x) - 0.5)", "torch.relu(x @ self.wt + self.lin.bias - 0.5)")


# the weights under other names, and a constant under its own: nothing of Model's loads by name
RENAMED = DERIVED.replace("        self.b = nn.Parameter(lin.bias.detach() - 0.5)\n",
                          "        self.b = nn.Parameter(lin.bias.detach() - 0.5)\n"
                          "        self.register_buffer('shift', torch.tensor(0.0))\n")


# a constant under its own name, and the weight's transpose cached on the first forward
OWN_CONSTANT_CACHED = STALE.replace("        self.wt = None\n",
                                    "        self.wt = None\n        self.register_buffer('shift', torch.tensor(0.5))\n")


@pytest.mark.parametrize("solution, status", [(OWN_CONSTANT, "pass"), (OWN_COPY, "fail"), (OWN_CONSTANT_CACHED, "fail"),
                                              (RENAMED, "n/a")],
                         ids=["own-constant", "own-copy", "own-constant-first-forward-copy", "renamed"])
def test_a_state_dict_with_names_of_its_own_is_loaded_leniently(solution, status):
    """A solution whose state_dict holds Model's names and its own besides fails the strict load
    (W's ``contract``); after a first forward, loaded with strict=False from Model's checkpoint of
    another seed, a constant under its own name gives the checkpoint's numbers (``lenient``
    passes: only the strict load fails), a transposed copy of the weight made in __init__ or on
    the first forward gives the old weights' (``lenient`` fails: stale). Renamed weights do not
    load by name at all: n/a."""
    from kfuzz.audit import lenient_check
    from kfuzz.executor import InProcess
    pair = load_pair(LINEAR, solution, f"lenient_{status}")
    bench = as_target(pair, weights="seed").options["bench"]
    bench.solution_model({"batch": 4}, "cpu")
    assert bench.weights_status.startswith("seed only"), bench.weights_status
    check = lenient_check(pair, "cpu", 0, lambda weights, on: InProcess(as_target(pair, weights=weights)))
    assert check["status"] == status, check
    rec = {"key": "c:0", "target": "kb:c:0", "standard": {"passed": True}, "gates": {},
           "weights": {"status": "fail", "detail": bench.weights_status, "checks": {"lenient": check}}}
    assert judge_record(rec)["violations"] == ["W"]
    label = "only W, a strict load (a strict=False load gives the checkpoint's numbers)"
    assert audit_report().summarize([rec])["arguable"][label] == (status == "pass")


def test_an_audit_whose_build_step_cannot_build_the_probe_stops_before_any_record(tmp_path):
    """Where the build step cannot build kfuzz's own probe extension (here: a compiler that is not
    there), `kfuzz audit` of compiling solutions exits 2 with the compiler's message before it
    records any of them: their build failures would be the machine's, not theirs."""
    import os
    import shutil
    import subprocess
    import sys
    if not shutil.which("ninja"):
        pytest.skip("no ninja here: load_inline cannot build")
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"))
    r = subprocess.run([sys.executable, "-c", "from kfuzz.cli import main; main()", "audit", str(ESCAPES),
                        "--select", "compile", "--gates", "G01", "--device", "cpu", "--no-pch", "--out",
                        str(tmp_path / "out"), "--cache", str(tmp_path / "ext"), "--key", str(tmp_path / "key"),
                        "--allow-unconfined"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "cannot build kfuzz's probe extension" in r.stderr and "no-such-compiler" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "out" / "results.jsonl").exists()
    assert not list((tmp_path / "ext").glob("probe-built-*"))


def test_the_build_step_reads_the_precompiled_header_it_is_given(tmp_path):
    """kfuzz's probe built in the confined build step with torch's header precompiled for its
    flags: the compiler finds the header's folder first on its include path, so the build step
    must be able to read it (where it could not, every build that used it failed at once with
    'Permission denied' on that header)."""
    import shutil
    from kfuzz.audit import check_build_step
    if not (shutil.which("ninja") and shutil.which("c++")):
        pytest.skip("no ninja or C++ compiler here: load_inline cannot build")
    check_build_step("cpu", tmp_path / "ext", pch_root=tmp_path / "ext" / "pch")
    (marker,) = (tmp_path / "ext").glob("probe-built-*")
    facts = json.loads(marker.read_text())
    assert facts["status"] == "built" and facts["pch"] == ["kfuzz_probe"], facts


def test_a_solution_that_names_its_extension_per_process_is_audited_as_built(tmp_path, probe_marker):
    """A solution whose extension's name carries the process id and whose build folder is a new
    temporary one builds in the build step and runs in the kernel's sandboxed worker, a
    process of another id that may not write the cache: its standard test and G01 pass."""
    import shutil
    if not (shutil.which("ninja") and shutil.which("c++")):
        pytest.skip("no ninja or C++ compiler here: load_inline cannot build")
    folder = tmp_path / "controls"
    folder.mkdir()
    (folder / "reference_relu.py").write_text((CONTROLS / "reference_relu.py").read_text())
    source = (ESCAPES / "compiled_relu.py").read_text()
    source = source.replace("../../kernelbench_controls/reference_relu.py", "reference_relu.py")
    built = 'load_inline("kfuzz_escapes_relu", cpp_sources=SOURCE,'
    assert built in source
    source = "import os\nimport tempfile\n" + source.replace(
        built, 'load_inline(f"kfuzz_relu_{os.getpid()}", cpp_sources=SOURCE, build_directory=tempfile.mkdtemp(),')
    (folder / "relu_per_process.py").write_text(source)
    (entry,) = [e for e in read_corpus(folder) if e.key.endswith(":relu_per_process")]
    (rec,) = run_audit([entry], tmp_path / "out", ["G01"], jobs=1, timeout=300,
                       cache=probed(tmp_path / "ext", probe_marker), pch=False)
    assert rec["build"]["status"] == "built" and "caught" not in rec["build"], rec["build"]
    assert rec["standard"]["passed"], rec["standard"]
    assert rec["gates"]["G01"]["status"] == "pass" and judge_record(rec)["violations"] == [], rec


def test_the_reports_denominator_names_accepted_rows_with_no_solution_to_audit(tmp_path):
    """A row with a speedup whose code is the string "None" or does not parse was accepted, but
    holds nothing to audit: the report counts it among the accepted kernels and says how many
    such rows there are; a null row is not accepted."""
    ref = (CONTROLS / "reference_relu.py").read_text()
    codes = [(CONTROLS / "drops_nan.py").read_text(), "None", "class ModelNew(:\n", None]
    (tmp_path / "cuda-l1-x.jsonl").write_text("".join(
        json.dumps({"level_id": 1, "task_id": 1, "ref_code": ref, "custom_code": c, "score_default": 1.0}) + "\n"
        for c in codes))
    report = audit_report()
    assert report.accepted_in_corpora([tmp_path]) == (3, 2)
    s = {**report.summarize([]), "corpus_accepted": 3, "corpus_without_solution": 2}
    assert "The corpora hold 3 accepted kernels; 0 of them are audited here (0.0%); 2 carry no solution that runs" \
        in report.markdown(s)


def test_runs_ended_before_the_standard_tests_verdict_are_counted_and_retried():
    """A kernel whose run an error of kfuzz's ended, or whose build was killed for time, has no
    verdict: the report counts each among kfuzz's own errors and timeouts, and ``--retry``
    redoes it."""
    from kfuzz.audit import needs_retry
    errored = {"key": "c:1", "gates": {}, "phase": "standard", "expect": None, "level": 1,
               "error": {"error": "RuntimeError: worker for 'kb:c:1' died while starting (exit-1)",
                         "exc_type": "RuntimeError"}}
    slow_build = {"key": "c:2", "gates": {}, "phase": "build", "ended": "timeout", "expect": None, "level": 1}
    fine = {"key": "c:3", "gates": {}, "phase": "gates", "expect": None, "level": 1,
            "standard": {"passed": True, "reason": "pass"}}
    assert [needs_retry(r) for r in (errored, slow_build, fine)] == [True, True, False]
    report = audit_report()
    s = report.summarize([errored, slow_build, fine])
    assert s["audited"] == 1 and s["kfuzz_errors"]["run_errors"] == 1 and s["kfuzz_errors"]["build_killed_for_time"] == 1
    text = report.markdown(s)
    assert "| kernels whose run a kfuzz error ended before the standard test's verdict (not audited) | 1 |" in text
    assert "| kernels killed for time in their build (not audited) | 1 |" in text


def test_the_report_says_how_many_records_each_time_limit_left_incomplete():
    """The goal of few incomplete records is stated at a per-kernel limit: the report gives,
    for each limit its records name, how many were made under it and how many of them were
    killed for time."""
    def rec(key, limit, killed):
        return {"key": key, "gates": {}, "phase": "gates", "expect": None, "level": 1, "timeout": limit,
                "standard": {"passed": True, "reason": "pass"}, **({"ended": "timeout"} if killed else {})}
    report = audit_report()
    s = report.summarize([rec("c:1", 150.0, True), rec("c:2", 300.0, False), rec("c:3", 300.0, True),
                          rec("c:4", 300.0, False)])
    assert s["incomplete_by_limit"] == {"150": [1, 1], "300": [3, 1]}
    assert "at 150 s, 1 of 1 incomplete (100.0%); at 300 s, 1 of 3 incomplete (33.3%)" in report.markdown(s)


def test_a_reference_refused_for_a_shared_gpus_memory_runs_again_and_a_refusal_of_its_own_does_not(monkeypatch):
    """The adapter refuses a reference that does not run at its own sizes; its record names the
    error's kind, so a reference that ran out of memory is out of a GPU's memory like any other
    end (``ended_by_gpu_state``): on a GPU other kernels shared, the audit runs it again alone
    and ``--retry`` redoes such a record; an exception of its own, or out of memory alone or on
    the CPU, stays."""
    import kfuzz.kernelbench
    from kfuzz.audit import audit_kernel, needs_retry, ended_by_gpu_state
    from kfuzz.kernelbench import KernelBenchError

    def refuses(pair, *args, **kwargs):       # as the reference's own run at its sizes ran out of memory
        raise KernelBenchError(f"{pair.name}: the reference does not run at its own sizes (AcceleratorError: "
                               f"CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation')")
    monkeypatch.setattr(kfuzz.kernelbench, "as_target", refuses)
    record = {"key": "c:1", "gates": {}, "device": "cuda", "level": 3, "mode": "eval"}
    audit_kernel(control("correct_linear"), "cpu", ["G01"], 0, lambda kind, d: record.update({kind: d}),
                 timeout=120)
    assert record["standard"]["passed"] and record["adapter"]["exc_type"] == "resource-memory", record
    assert ended_by_gpu_state(record) and needs_retry(record)
    assert not needs_retry({**record, "alone": True}) and not needs_retry({**record, "device": "cpu"})
    own = {**record, "adapter": {"error": "KernelBenchError: c:1: the reference does not run at its own sizes "
                                          "(RuntimeError: mat1 and mat2 shapes cannot be multiplied)",
                                 "exc_type": "KernelBenchError"}}
    assert not ended_by_gpu_state(own) and not needs_retry(own)


def test_a_run_that_kfuzzs_error_ended_after_the_standard_test_is_counted_never_clean():
    """A kernel whose standard test passed and whose gates an error of kfuzz's ended (its workers
    could not start, a device mismatch in kfuzz's own code) has no violation in what finished:
    the report counts it among kfuzz's own errors, with the headline's counts, never as clean
    without a word, and ``--retry`` redoes it."""
    from kfuzz.audit import needs_retry
    ended = {"key": "c:1", "gates": {}, "phase": "gates", "expect": None, "level": 1,
             "standard": {"passed": True, "reason": "pass"},
             "error": {"error": "RuntimeError: Expected all tensors to be on the same device"}}
    fine = {**{k: v for k, v in ended.items() if k != "error"}, "key": "c:2"}
    assert [needs_retry(r) for r in (ended, fine)] == [True, False]
    report = audit_report()
    s = report.summarize([ended, fine])
    assert s["audited"] == 2 and s["kfuzz_errors"]["ended_by_error"] == 1
    text = report.markdown(s)
    assert "| kernels whose run a kfuzz error ended after the standard test (judged on what finished) | 1 |" in text
    assert "1 whose run an error of kfuzz's ended after the standard test, judged on what finished" in text


SCALE_REF = """import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, s):
        return A * s

M = 64
N = 48

def get_inputs():
    return [torch.randn(M, N), 3.14]

def get_init_inputs():
    return []
"""


def test_a_float_input_is_fuzzed_as_a_0d_argument_and_passed_as_a_float():
    """A reference whose get_inputs gives a Python float (a matrix times a scalar) is a target:
    the float is a 0-d float argument of the cases, passed to both models as a Python float
    again. A solution right for every scale passes every gate; one that hard-codes the scale
    of get_inputs passes the standard test and fails G01 on its bound."""
    from kfuzz.gates import GATES, run_gate
    from kfuzz.tensors import materialize
    right = load_pair(SCALE_REF, SCALE_REF.replace("class Model(", "class ModelNew(").replace(
        "return A * s", "assert type(s) is float, type(s)\n        return A * s"), "scale_right")
    c = infer_contract(right)
    assert c.arg_shapes == (("M", "N"), ()) and c.arg_dtypes == ("case", "case") and c.scalars == ("s",)
    target = as_target(right)
    for gid, gate in GATES.items():
        r = run_gate(gate, target, seed=0)
        assert r.status in ("pass", "n/a"), (gid, r.reason)
    case = next(iter(GATES["G01"].cases(target, 0)))
    assert materialize(case, target)["s"].dim() == 0
    fixed = load_pair(SCALE_REF, SCALE_REF.replace("class Model(", "class ModelNew(").replace(
        "return A * s", "return A * 3.14"), "scale_fixed")
    assert standard_test(fixed).passed
    r = run_gate(GATES["G01"], as_target(fixed), seed=0)
    assert r.status == "fail" and r.first_failure[1].kind == "bound", r.reason


def _bench_builds():
    spec = importlib.util.spec_from_file_location("bench_builds", ROOT / "tools" / "bench_builds.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_the_build_benchmark_reads_a_solutions_cuda_file_without_running_it():
    """--cuda-phases: the CUDA file as torch's load_inline writes it, from literals and
    module-level constants; a source made at run time is not read."""
    tool = _bench_builds()
    code = textwrap.dedent('''
        from torch.utils.cpp_extension import load_inline
        SRC = "__global__ void k(float* x) { x[0] = 1.0f; }"
        ext = load_inline(name="k", cpp_sources="void f();", cuda_sources=SRC, functions=["f"],
                          extra_cuda_cflags=["-O3"])
    ''')
    got = tool.cuda_sources(code)
    assert got["source"].splitlines() == [*tool.TORCH_CUDA_PREFIX, "__global__ void k(float* x) { x[0] = 1.0f; }"]
    assert got["extra_cuda_cflags"] == ["-O3"]
    made = code.replace('cuda_sources=SRC', 'cuda_sources=SRC.replace("1.0f", "2.0f")')
    assert tool.cuda_sources(made) is None
    assert tool.cuda_sources("import torch\n") is None and tool.cuda_sources("def (") is None


def test_the_build_benchmark_reads_nvccs_phases_from_its_time_file():
    tool = _bench_builds()
    csv_text = (
        "source file name , phase name , phase input files , phase output file , arch , tool, metric , unit\n"
        "k.cu , gcc (preprocessing 4) , k.cu , a.ii ,  , nvcc , 2501.8860 , ms\n"
        "k.cu , cudafe++ , a.ii , b.cpp , compute_90 , nvcc , 27978.2012 , ms\n"
        "k.cu , gcc (preprocessing 1) , k.cu , c.ii , compute_90 , nvcc , 1607.5540 , ms\n"
        "k.cu , cicc , c.ii , d.ptx , compute_90 , nvcc , 37300.8906 , ms\n"
        "k.cu , ptxas , d.ptx , e.cubin , sm_90 , nvcc , 58.0720 , ms\n"
        "k.cu , fatbinary , e.cubin , f.fatbin ,  , nvcc , 4.5950 , ms\n"
        "k.cu , gcc (compiling) ,   , k.o , compute_90 , nvcc , 18065.6816 , ms\n"
        " , nvcc (driver) ,  , k.o ,  , nvcc , 0.8125 , ms\n")
    got = tool.nvcc_phases(csv_text)
    assert got == pytest.approx({"preprocess": 4.1094, "cudafe++": 27.9782, "cicc": 37.3009, "ptxas": 0.0581,
                                 "host compile": 18.0657, "other": 0.0046}, abs=1e-4)
    row = tool.cuda_table([{"key": "c:1", "source": "slimmed", "status": "compiled", "phases": got, "wall_s": 87.6,
                            "cpu_s": 86.8}])
    assert row.splitlines()[2] == "| c:1 | slimmed | compiled | 4.1 | 28.0 | 37.3 | 0.1 | 18.1 | 0.0 | 87.6 | 86.8 |"
    with pytest.raises(SystemExit) as stop:      # no toolkit there: bad usage
        tool.main([str(ESCAPES), "--cuda-phases", "--cuda-home", "/nonexistent"])
    assert stop.value.code == 2
