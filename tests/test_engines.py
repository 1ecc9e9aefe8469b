"""Engines: every decoded, mutated and crossed-over case is valid for its target; the
hypothesis strategies draw valid cases; the random engine keeps a target's costly draws by
the chance it declares; the atheris engine finds a planted combination bug through real
libFuzzer, keeps its corpus as seeds and starts the next campaign from them."""
import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings

from kfuzz import strategies
from kfuzz.campaign import run_campaign
from kfuzz.case import ArgCase, Case, encode
from kfuzz.corpus import Corpus, iter_case_files
from kfuzz.engines import ENGINES, AtherisEngine
from kfuzz.engines.atheris import (COVERAGE_LEAVES, FEATURES, coverage_features, crossover, decode_fdp,
                                   decode_input, divergence_features, mutate_case)
from kfuzz.engines.random import sample_case
from kfuzz.target import get_target
from kfuzz.verdict import Verdict

TARGETS = ["searchsum", "softmax", "matmul", "layernorm"]


@pytest.mark.parametrize("name", TARGETS)
def test_any_bytes_decode_to_a_valid_case(name):
    target = get_target(name)
    rng = random.Random(name)
    for n in [0, 1, 3, 17, 64, 300] * 20:
        case = decode_fdp(rng.randbytes(n), target)
        target.validate(case)
    assert decode_fdp(b"", target) == decode_fdp(b"", target)   # deterministic


@pytest.mark.parametrize("name", TARGETS)
def test_case_bytes_decode_to_the_same_case(name):
    target = get_target(name)
    case = sample_case(target, random.Random(1))
    assert decode_input(encode(case), target) == case
    # a case of another target is not taken as is
    other = sample_case(get_target("cumsum"), random.Random(1))
    assert decode_input(encode(other), target).target == name


@pytest.mark.parametrize("name", TARGETS)
def test_mutation_and_crossover_give_valid_cases_and_touch_every_field(name):
    target = get_target(name)
    rng = random.Random(7)
    case = sample_case(target, rng)
    changed = set()
    for _ in range(300):
        new = mutate_case(case, target, rng)
        target.validate(new)
        assert new != case
        changed |= {f for f in ("dims", "dtype", "seed") if getattr(new, f) != getattr(case, f)}
        for arg in target.args:
            a, b = case.arg(arg), new.arg(arg)
            changed |= {f for f in ("layout", "dist", "inject") if getattr(a, f) != getattr(b, f)}
        case = new
    assert changed == {"dims", "dtype", "seed", "layout", "dist", "inject"}
    a, b = sample_case(target, rng), sample_case(target, rng)
    for _ in range(50):
        child = crossover(a, b, target, rng)
        target.validate(child)
        assert all(child.dim[k] in (a.dim[k], b.dim[k]) for k in target.dims)
        assert child.dtype in (a.dtype, b.dtype)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(strategies.cases(get_target("matmul")))
def test_strategies_draw_valid_cases(case):
    get_target("matmul").validate(case)


def _work(dims: dict) -> int:
    size = 1
    for n in dims.values():
        size *= n
    return size


def test_the_random_engine_keeps_a_draw_by_the_chance_its_target_gives_its_dims():
    """``options["keep"]``: a draw whose dims cost 4x the budget is kept a quarter of the time,
    so the costly draws are few and still there; a chance of 1 everywhere draws, value for
    value, what a target without it draws."""
    base = get_target("softmax")
    budget = 64
    kept = dataclasses.replace(base, options={**base.options, "keep": lambda d: min(1.0, budget / _work(d))})
    every = dataclasses.replace(base, options={**base.options, "keep": lambda d: 1.0})
    a, b = random.Random(3), random.Random(3)
    assert [sample_case(base, a).hash for _ in range(50)] == [sample_case(every, b).hash for _ in range(50)]
    a, b = random.Random(0), random.Random(0)
    plain = [_work(sample_case(base, a).dim) for _ in range(3000)]
    thinned = [_work(sample_case(kept, b).dim) for _ in range(3000)]
    assert sum(thinned) < sum(plain) / 5
    over = budget * 16                  # kept at most 1 in 16
    assert 0 < sum(w > over for w in thinned) < sum(w > over for w in plain) / 8


def test_gdn_draws_are_kept_by_the_recurrences_work_at_the_gpus_sizes_and_all_at_the_cpus(monkeypatch):
    """The GDN targets keep a draw with the chance JUDGE_WORK / (B*T*H*K*V): at the CPU's sizes
    (the interpreter's) every draw; at the GPU's, the draws' summed work falls by more than
    half and the draws over the budget hold less of it, some still drawn."""
    from harnesses.gdn import JUDGE_WORK, keep
    target = get_target("gdn_bwd")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert keep({n: d.search_hi for n, d in target.dims.items()}) == 1.0
    monkeypatch.setenv("TRITON_INTERPRET", "0")        # the sizes a GPU campaign draws
    assert keep({n: d.search_hi for n, d in target.dims.items()}) < 0.01
    plain = dataclasses.replace(target, options={k: v for k, v in target.options.items() if k != "keep"})
    a, b = random.Random(0), random.Random(0)
    before = [_work(sample_case(plain, a).dim) for _ in range(3000)]
    after = [_work(sample_case(target, b).dim) for _ in range(3000)]
    assert sum(after) < sum(before) / 2

    def share_over(work):
        return sum(w for w in work if w > JUDGE_WORK) / sum(work)
    assert share_over(after) < 0.75 < share_over(before) and any(w > JUDGE_WORK for w in after)


def test_the_draw_cost_tool_prints_each_threshold_with_and_without_the_targets_keep():
    """tools/draw_costs.py: a row of all draws and one of the draws kept, each giving the share
    of the draws and of their work over each threshold; the kept draws' mean work is lower."""
    import subprocess
    import sys
    from pathlib import Path
    tool = Path(__file__).resolve().parents[1] / "tools" / "draw_costs.py"
    r = subprocess.run([sys.executable, str(tool), "--target", "gdn_bwd", "--draws", "400", "--over", "1e7,1e8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in r.stdout.splitlines()
            if line.startswith("| all") or line.startswith("| by the target's keep")}
    assert set(rows) == {"all", "by the target's keep"} and all(len(v) == 7 for v in rows.values()), r.stdout
    assert float(rows["by the target's keep"][3]) < float(rows["all"][3])
    assert "| draws kept | draws | median work | mean work | largest | over 1e7: draws / work |" in r.stdout


def test_divergence_features_separate_how_close_a_case_came():
    import torch
    t = "searchsum"
    near = divergence_features(Verdict(t, "pass", ratio=0.9), {"out": torch.ones(3)})
    far = divergence_features(Verdict(t, "pass", ratio=0.01), {"out": torch.ones(3)})
    nan = divergence_features(Verdict(t, "pass", ratio=0.01), {"out": torch.tensor([1.0, float("nan")])})
    exc = divergence_features(Verdict(t, "exception", exc_type="ValueError", frame="k.py:f"), None)
    assert near != far and far != nan and len(exc) == 3
    for feats in (near, far, nan, exc):
        assert all(COVERAGE_LEAVES <= f < FEATURES for f in feats)
    assert all(0 <= f < COVERAGE_LEAVES for f in coverage_features({1, 2 << 40, 3 << 16}))


def test_engines_registry():
    assert ENGINES["atheris"] is AtherisEngine and "random" in ENGINES


def test_atheris_finds_a_combination_bug_and_keeps_its_corpus_as_seeds(tmp_path):
    target = get_target("searchsum.transbf16")
    corpus = Corpus(tmp_path)
    stats = run_campaign(target, AtherisEngine(target, seed=3), corpus, runs=1500, jobs=0, stop_on_failure=True)
    # the permuted read shows as a bound failure, or as a nonfinite one when an Inf moved
    assert len(stats.failures) == 1 and {s.kind for s in stats.failures} <= {"bound", "nonfinite"}
    saved = list(iter_case_files([tmp_path / "crashes"]))
    assert len(saved) == 1
    seeds = list(iter_case_files([tmp_path / "seeds" / target.name]))
    assert len(seeds) == stats.corpus_size > 0 and stats.coverage > 0
    # the next campaign's libFuzzer starts from those seeds
    engine = AtherisEngine(target, seed=4)
    engine.start(corpus)
    try:
        copied = {p.name for p in (engine.workdir / "corpus").iterdir()}
        assert {p.name for p in seeds} <= copied
        case = engine.next_case()
        target.validate(case)
    finally:
        engine.close()
    assert engine.workdir is None


def test_atheris_hypothesis_mode_runs_through_fuzz_one_input(tmp_path):
    target = get_target("searchsum")
    stats = run_campaign(target, AtherisEngine(target, seed=1, mode="hypothesis"), Corpus(tmp_path),
                         runs=60, jobs=0)
    assert stats.executions == 60 and not stats.failures


def test_atheris_through_sandboxed_workers(tmp_path):
    """Coverage of the harness comes back from the worker process; crash and hang handling
    itself is tested in test_workers.py."""
    target = get_target("searchsum.tailinf")
    engine = AtherisEngine(target, seed=2)
    stats = run_campaign(target, engine, Corpus(tmp_path), runs=40, jobs=1, timeout=30.0)
    assert stats.executions == 40 and stats.coverage > 0 and stats.corpus_size > 0
    assert engine.workdir is None and not engine.fuzzers   # libFuzzer's processes and folder are gone
