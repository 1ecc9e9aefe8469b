"""The minimizer keeps the failure signature and reaches small cases; flaky candidates are
never adopted; imported payloads shrink to a few elements; the CLI verbs and the pytest
plugin that replays crashes/ work end to end."""
import itertools

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import kfuzz.cli.import_, kfuzz.cli.minimize, kfuzz.cli.run  # noqa: F401,E401  (register the verbs)
from kfuzz.case import ArgCase, Case, Dist, Layout
from kfuzz.cli import cli
from kfuzz.corpus import Corpus, load
from kfuzz.errors import CaseError
from kfuzz.execute import execute
from kfuzz.importer import import_failure
from kfuzz.tensors import case_from_tensors
from kfuzz.minimize import NotReproducible, SameFailure, minimize, window
from kfuzz.target import Arg, Dim, Output, Target, add_target, get_target
from kfuzz.verdict import Verdict

pytest_plugins = ["pytester"]


# targets of this test, registered as a user's package would ----------------------------------

def _rowmax_clean(x):
    """A row max that 'cleans' its input: NaN becomes 0 (the bug), as kernels that zero NaN do."""
    return torch.nan_to_num(x, nan=0.0).amax(dim=-1)


ROWMAX = add_target(Target(
    name="test_minimize.rowmax_nan2zero", kernel=_rowmax_clean, reference=lambda x: x.amax(dim=-1),
    args={"x": Arg(("N", "D"))}, outputs={"out": Output(("N",))},
    dims={"N": Dim(1, 4096), "D": Dim(1, 4096)}, dtypes=("float32", "float16"),
    planted_bug="NaN becomes 0"))

_calls = itertools.count()


def _flaky(x):
    # wrong on every other call: no case fails reproducibly
    return x.amax(dim=-1) + (1.0 if next(_calls) % 2 else 0.0)


FLAKY = add_target(Target(
    name="test_minimize.flaky", kernel=_flaky, reference=lambda x: x.amax(dim=-1),
    args={"x": Arg(("N", "D"))}, outputs={"out": Output(("N",))}, dims={"N": Dim(1, 64), "D": Dim(1, 64)}))


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def junk(target, dtype, seed, dims, **args):
    return Case.make(target, dtype, seed, dims, args)


# planted bugs: each case as a campaign might find it, and what minimizing must reach ------------

PLANTED = [
    # (case, the dims it must reach, how many injections may remain)
    (junk("layernorm.nan2zero", "bfloat16", 987654, {"N": 40, "D": 300},
          x=ArgCase(Layout("strided", step=(2, 3)), Dist("scaled", (("factor", 100.0),)),
                    ((5, "tiny"), (3 * 300 + 17, "nan"), (4000, -7.5))),
          bias=ArgCase(inject=((12, "max"),))),
     {"N": 1, "D": 1}, 1),
    (junk("cumsum.inplace", "float16", 31337, {"N": 33, "D": 257},
          x=ArgCase(Layout("offset", offset=9), Dist("heavytailed"), ((100, "inf"),))),
     {"N": 1, "D": 2}, 0),
    (junk("rmsnorm.lowsquare", "float16", 4242, {"N": 17, "D": 100},
          x=ArgCase(inject=((5 * 100 + 50, 300.0), (7, "-0")))),
     {"N": 1, "D": 1}, 1),
    (junk("softmax.nomax", "float16", 77, {"N": 3, "D": 20},
          x=ArgCase(Layout("permuted", perm=(1, 0)), Dist("scaled", (("factor", 100.0),)))),
     {"N": 1, "D": 1}, 1),
]


@pytest.mark.parametrize("case,dims,max_injections", PLANTED, ids=[c.target for c, _, _ in PLANTED])
def test_planted_bug_shrinks_keeping_its_signature(case, dims, max_injections):
    target = get_target(case.target)
    found = execute(case, target)
    assert not found.passed
    m = minimize(case, target, max_executions=300)
    assert not m.exhausted and m.steps
    assert m.case.dim == dims
    assert sum(len(ac.inject) for _, ac in m.case.args) <= max_injections
    assert all(ac.layout.kind == "contiguous" for _, ac in m.case.args)
    assert m.case.seed == 0
    again = execute(m.case, target)          # fresh execution, not the minimizer's cache
    assert again.signature == found.signature == m.verdict.signature
    assert m.executions <= 300


def test_several_workers_ask_candidates_at_once_and_reach_the_same_case():
    from kfuzz.executor import Pool
    case = PLANTED[0][0]
    target = get_target(case.target)
    alone = minimize(case, target, max_executions=300)
    with Pool(target, 3, timeout=60.0) as pool:
        at_once = minimize(case, target, max_executions=600, executor=pool)
    assert at_once.case == alone.case and at_once.steps == alone.steps and not at_once.exhausted
    assert at_once.executions > alone.executions     # candidates asked past the first kept one, at once


def test_a_check_of_its_own_is_the_predicate_at_every_step():
    """A failure that only a gate's rules find is minimized with that gate's verdict on each
    candidate (``check``), not the oracle's on one call: here a rule that excuses the rows of
    ``N`` below 5, so the case reached has the smallest ``N`` the check still fails, where the
    oracle's judgement alone reaches 1."""
    case = junk(ROWMAX.name, "float32", 3, {"N": 40, "D": 30}, x=ArgCase(inject=((7 * 30 + 4, "nan"),)))
    checked = []

    def check(c):
        checked.append(c.hash)
        v = execute(c, ROWMAX)
        return Verdict(ROWMAX.name, "pass", detail="excused") if c.dim["N"] < 5 else v
    plain = minimize(case, ROWMAX, max_executions=300)
    own = minimize(case, ROWMAX, max_executions=300, check=check)
    assert plain.case.dim["N"] == 1
    assert own.case.dim["N"] == 5 and own.case.dim["D"] == plain.case.dim["D"] == 1 and not own.exhausted
    assert len(checked) == own.executions and check(own.case).signature == own.verdict.signature


def test_injections_keep_their_place_when_a_dim_is_cut():
    case = junk(ROWMAX.name, "float32", 0, {"N": 4, "D": 10}, x=ArgCase(inject=((2 * 10 + 7, "nan"), (35, 1.0))))
    cut = window(case, ROWMAX, "N", 2, 1)              # keep row 2 only
    assert cut.dim == {"N": 1, "D": 10} and cut.arg("x").inject == ((7, "nan"),)
    cut = window(case, ROWMAX, "D", 5, 3)              # keep columns 5..7 of all rows
    assert cut.arg("x").inject == ((2 * 3 + 2, "nan"), (3 * 3 + 0, 1.0))


def test_a_case_that_passes_is_refused():
    case = junk("softmax", "float32", 1, {"N": 2, "D": 8})
    with pytest.raises(NotReproducible, match="passes"):
        minimize(case)


def test_flaky_failures_are_never_adopted():
    case = junk(FLAKY.name, "float32", 1, {"N": 4, "D": 4})
    with pytest.raises(NotReproducible, match="on each of 2 runs"):
        minimize(case, FLAKY, signature=execute(case, FLAKY).signature)
    # the predicate itself: whatever the phase of the flake, one of the two runs passes
    sig = next(v for v in (execute(case, FLAKY), execute(case, FLAKY)) if not v.passed).signature
    assert not SameFailure(FLAKY, sig)(case.with_(seed=2))


def test_the_budget_stops_the_minimizer_with_a_case_that_still_fails():
    case, _, _ = PLANTED[0]
    m = minimize(case, max_executions=6)
    assert m.exhausted and m.executions == 6
    assert execute(m.case).signature == m.verdict.signature


# imported failures ------------------------------------------------------------------------------

def _reported(n=1024, d=1024, at=(700, 333)):
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(0))
    x[at] = float("nan")
    return x


def test_a_megabyte_pt_shrinks_to_one_element_with_the_same_signature(tmp_path):
    f = tmp_path / "report.pt"
    torch.save({"x": _reported()}, f)
    assert f.stat().st_size > 4_000_000
    imp = import_failure(f, ROWMAX)
    assert imp.found.dim == {"N": 1024, "D": 1024} and imp.verdict.kind == "nonfinite"
    m = imp.minimized
    assert m.case.dim == {"N": 1, "D": 1}
    assert len(m.case.canonical()) < 400 < len(imp.found.canonical()) // 10000
    again = execute(m.case, ROWMAX)
    assert again.signature == imp.verdict.signature


def test_npz_positional_and_by_name(tmp_path):
    x = _reported(8, 16, (3, 5)).numpy()
    np.savez(tmp_path / "pos.npz", x)
    np.savez(tmp_path / "named.npz", x=x)
    for name in ("pos.npz", "named.npz"):
        imp = import_failure(tmp_path / name, ROWMAX, minimize_it=False)
        assert imp.found.dim == {"N": 8, "D": 16} and imp.minimized is None


@pytest.mark.parametrize("tensors,message", [
    ({"x": torch.zeros(3)}, "has 1 dims"),
    ({"y": torch.zeros(2, 2)}, "missing"),
    ({"x": torch.zeros(2, 5000)}, "outside the contract"),
    ([torch.zeros(2, 2), torch.zeros(2, 2)], "2 tensors for 1 arguments"),
    ({"x": torch.zeros(2, 2, dtype=torch.float64)}, "not admitted"),
])
def test_bad_reported_inputs_are_refused_naming_the_file(tensors, message):
    with pytest.raises(CaseError, match=message) as e:
        case_from_tensors(ROWMAX, tensors, "report.pt")
    assert "report.pt" in str(e.value)


def test_cli_import_saves_a_minimized_case_and_refuses_bad_files(tmp_path):
    torch.save([_reported(64, 64, (60, 1))], tmp_path / "r.pt")
    r = invoke("import", "--target", ROWMAX.name, str(tmp_path / "r.pt"), "--root", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert "dims {'D': 64, 'N': 64}" in r.output and "shrink_dims" in r.output
    saved = list((tmp_path / "crashes").rglob("*.case.zst"))
    assert len(saved) == 1 and load(saved[0])[0].dim == {"N": 1, "D": 1}
    torch.save({"x": torch.ones(2, 2)}, tmp_path / "ok.pt")
    (tmp_path / "bad.pt").write_bytes(b"not a torch file")
    for name, said in (("ok.pt", "passes on these inputs"), ("bad.pt", "not a readable torch file"),
                       ("missing.npz", "no such file")):
        r = invoke("import", "--target", ROWMAX.name, str(tmp_path / name), "--root", str(tmp_path))
        assert r.exit_code == 2 and said in r.output and name in r.output
    assert load(saved[0])[0].dim == {"N": 1, "D": 1}      # nothing saved was lost


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_cli_minimize_prints_what_it_removed_and_keeps_the_original(tmp_path, jobs):
    case, _, _ = PLANTED[1]
    path = Corpus(tmp_path).save_failure(case, execute(case))
    r = invoke("minimize", str(path), "--jobs", jobs)
    assert r.exit_code == 0, r.output
    assert "dropped 1 of 1 injections" in r.output and "layout" in r.output
    assert "found      dims {'D': 257, 'N': 33}" in r.output and "minimized  dims {'D': 2, 'N': 1}" in r.output
    assert path.exists() and len(list(path.parent.glob("*.case.zst"))) == 2
    small, record = load(next(p for p in path.parent.glob("*.case.zst") if p != path))
    assert small.dim == {"N": 1, "D": 2} and record["expect"] == "fail" and record["minimize"]["fixed_point"]
    passing = Corpus(tmp_path).save_seed(junk("softmax", "float32", 1, {"N": 2, "D": 8}))
    r = invoke("minimize", str(passing))
    assert r.exit_code == 2 and "passes" in r.output


def test_run_minimizes_every_new_failure_before_saving(tmp_path):
    r = invoke("run", "--target", "layernorm.nan2zero", "--runs", "25", "--root", str(tmp_path))
    assert r.exit_code == 1
    saved = list((tmp_path / "crashes").rglob("*.case.zst"))
    assert saved
    for p in saved:
        case, record = load(p)
        note = record["minimize"]
        assert note["minimized"]["hash"] == case.hash
        found, small = note["found"]["dims"], case.dim
        assert all(small[k] <= found[k] for k in small) and small["N"] == 1


def test_only_an_open_failure_hides_a_new_one_with_its_signature(tmp_path):
    """A signature whose kept cases are all fixed (expect: pass) is a regression folder: a
    failure with that signature now is a new bug and is saved (the device campaign of
    2026-12-01 found a gdn_bwd bound-dq failure and kept nothing, for a fixed case's folder)."""
    corpus = Corpus(tmp_path)
    first = junk("rmsnorm.lowsquare", "float16", 0, {"N": 1, "D": 1}, x=ArgCase(inject=((0, 300.0),)))
    second = junk("rmsnorm.lowsquare", "float16", 1, {"N": 1, "D": 2}, x=ArgCase(inject=((0, 300.0),)))
    v1, v2 = execute(first), execute(second)
    assert v1.signature == v2.signature and first.hash != second.hash
    fixed = corpus.save_failure(first, v1, expect="pass")
    assert fixed is not None and not corpus.has_open_failure(v1.signature)
    opened = corpus.save_failure(second, v2)
    assert opened is not None and opened != fixed and corpus.has_open_failure(v2.signature)
    third = junk("rmsnorm.lowsquare", "float16", 2, {"N": 2, "D": 1}, x=ArgCase(inject=((0, 300.0),)))
    assert corpus.save_failure(third, execute(third)) is None      # an open one is kept: deduplicated
    assert sorted(p.name for p in opened.parent.iterdir()) == sorted([fixed.name, opened.name])


# the pytest plugin -------------------------------------------------------------------------------

def test_the_crash_corpus_replays_where_this_process_runs_triton(monkeypatch):
    """As `kfuzz replay` by default (cuda where a GPU is visible), except under Triton's
    interpreter, which runs its kernels on the CPU; a machine without GPUs replays on the CPU."""
    from kfuzz.pytest_plugin import replay_device
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert replay_device(cuda_count=1) == "cuda" and replay_device(cuda_count=0) == "cpu"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert replay_device(cuda_count=1) == "cpu"


def test_pytest_collects_saved_cases_by_target_and_signature(pytester):
    root = pytester.path
    still = junk("cumsum.inplace", "float32", 0, {"N": 1, "D": 2})
    fixed = junk("rmsnorm.lowsquare", "float16", 0, {"N": 1, "D": 1}, x=ArgCase(inject=((0, 300.0),)))
    corpus = Corpus(root)
    corpus.save_failure(still, execute(still))
    corpus.save_failure(fixed, execute(fixed), expect="pass")     # "fixed", but the bug is still there
    (root / "crashes" / "cumsum.inplace" / "junk.case.zst").write_bytes(b"garbage")
    (root / "seeds").mkdir()
    corpus.save_seed(still)                                         # not under crashes/: not a test
    result = pytester.runpytest("-p", "no:cacheprovider", "--junitxml=report.xml", "-rA")
    result.assert_outcomes(passed=1, failed=2)
    out = result.stdout.str()
    assert "PASSED crashes/cumsum.inplace/mutation-x/" in out and "::cumsum.inplace/mutation-x" in out
    assert "rmsnorm.lowsquare/bound-out[fixed]" in out and "expected pass, got rmsnorm.lowsquare/bound-out" in out
    assert "junk.case.zst: cannot be replayed: not a valid zstd stream" in out
    xml = (root / "report.xml").read_text()
    assert xml.count("<testcase") == 3 and 'name="cumsum.inplace/mutation-x"' in xml
