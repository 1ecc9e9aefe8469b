"""The command line end to end, in a scratch project root: run finds and saves, replay
reproduces, bad files and unknown targets exit 2 naming what is wrong, and the rest of the
corpus still replays."""
import shutil

import pytest
from click.testing import CliRunner

from kfuzz.case import ArgCase, Case, Dist
from kfuzz.cli import cli
from kfuzz.corpus import Corpus
from kfuzz.errors import WorkerStartError
from kfuzz.execute import execute
from kfuzz.executor import Pool

import kfuzz.cli.audit, kfuzz.cli.import_, kfuzz.cli.minimize  # noqa: F401,E401
import kfuzz.cli.replay, kfuzz.cli.run, kfuzz.cli.show, kfuzz.cli.targets, kfuzz.cli.verify  # noqa: F401,E401


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture
def root(tmp_path):
    case = Case.make("softmax.nomax", "float32", 3, {"N": 4, "D": 33},
                     {"x": ArgCase(dist=Dist("scaled", (("factor", 100.0),)))})
    Corpus(tmp_path).save_failure(case, execute(case))
    return tmp_path


def test_targets_lists_planted_bugs():
    r = invoke("targets")
    assert r.exit_code == 0 and "softmax.nomax" in r.output and "planted bug" in r.output


def test_run_finds_the_overflow_and_replay_reproduces_it(tmp_path):
    r = invoke("run", "--target", "softmax.nomax", "--runs", "60", "--root", str(tmp_path))
    assert r.exit_code == 1 and "softmax.nomax/nonfinite-out" in r.output
    saved = list((tmp_path / "crashes" / "softmax.nomax").rglob("*.case.zst"))
    assert saved
    r = invoke("replay", str(tmp_path / "crashes"))
    assert r.exit_code == 0 and "still fails" in r.output


def test_run_on_the_correct_kernel_finds_nothing(tmp_path):
    r = invoke("run", "--target", "softmax", "--runs", "40", "--root", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert not (tmp_path / "crashes").exists()


def test_corrupt_and_truncated_files_exit_2_and_the_rest_replays(root):
    good = next((root / "crashes").rglob("*.case.zst"))
    (root / "crashes" / "softmax.nomax" / "broken.case.zst").write_bytes(b"garbage")
    (root / "crashes" / "softmax.nomax" / "short.case.zst").write_bytes(good.read_bytes()[:10])
    r = invoke("replay", str(root / "crashes"))
    assert r.exit_code == 2
    assert "broken.case.zst: not a valid zstd stream" in r.output
    assert "short.case.zst" in r.output
    assert "1 as expected" in r.output and good.exists()


def test_unknown_target_in_a_case_file_exits_2_naming_the_file(root):
    good = next((root / "crashes").rglob("*.case.zst"))
    other = root / "elsewhere" / "x.case.zst"
    other.parent.mkdir()
    shutil.copy(good, other)
    case, record = __import__("kfuzz.corpus", fromlist=["load"]).load(other)
    from kfuzz.case import encode
    other.write_bytes(encode(case.with_(target="no_such_target"), record))
    r = invoke("replay", str(other), str(root / "crashes"))
    assert r.exit_code == 2 and "x.case.zst" in r.output and "unknown target 'no_such_target'" in r.output
    assert "1 as expected" in r.output


def test_a_worker_this_machine_cannot_start_is_a_clear_error_for_verify_and_minimize(tmp_path, monkeypatch):
    """A sandboxed worker that does not start (its GPU full past the waits, its target's import
    failing) ends `kfuzz verify` and `kfuzz minimize` with exit 2 and the error, no traceback."""
    said = "worker for 'softmax' did not start: CUDA out of memory on cuda (other processes hold the GPU's memory)"

    def refuse(self, i, wait=True):
        raise WorkerStartError(said + ", 5 tries")
    monkeypatch.setattr(Pool, "_spawn", refuse)
    overflow = Case.make("softmax.nomax", "float32", 3, {"N": 4, "D": 33},
                         {"x": ArgCase(dist=Dist("scaled", (("factor", 100.0),)))})
    case = Corpus(tmp_path).save_failure(overflow, execute(overflow))
    for args in (("verify", "--target", "softmax", "--device", "cpu", "--gates", "G05"),
                 ("minimize", str(case), "--device", "cpu", "--out", str(tmp_path / "min.case.zst"))):
        r = invoke(*args)
        assert r.exit_code == 2 and f"kfuzz: error: {said}" in r.output, r.output
    assert case.exists() and not (tmp_path / "min.case.zst").exists()


def test_unknown_target_for_run_exits_2():
    r = invoke("run", "--target", "nope", "--runs", "1")
    assert r.exit_code == 2 and "unknown target 'nope'" in r.output


@pytest.mark.parametrize("args, option", [
    (("run", "--target", "softmax", "--time", "-5"), "--time"),
    (("run", "--target", "softmax", "--runs", "0"), "--runs"),
    (("verify", "--target", "softmax", "--timeout", "0"), "--timeout"),
    (("minimize", "x.case.zst", "--budget", "0"), "--budget"),
    (("import", "x.json", "--target", "softmax", "--budget", "-1"), "--budget"),
    (("audit", "corpus", "--jobs", "0"), "--jobs"),
    (("audit", "corpus", "--timeout", "-1"), "--timeout"),
    (("audit", "corpus", "--build-timeout", "0"), "--build-timeout"),
    (("audit", "corpus", "--build-jobs", "-1"), "--build-jobs"),
    (("audit", "corpus", "--max-jobs", "0"), "--max-jobs"),
    (("audit", "corpus", "--threads", "0"), "--threads"),
    (("audit", "corpus", "--limit", "-1"), "--limit"),
])
def test_a_count_or_a_time_out_of_its_range_is_bad_usage_naming_the_option(tmp_path, monkeypatch, args, option):
    """A time or a timeout that is not positive, a count of runs, executions, processes or threads
    below what it can be: exit 2 naming the option, before anything runs or is written."""
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, list(args))
    assert r.exit_code == 2 and f"Invalid value for '{option}'" in r.output, r.output
    assert list(tmp_path.iterdir()) == []


def test_show_prints_case_and_record(root):
    good = next((root / "crashes").rglob("*.case.zst"))
    r = invoke("show", str(good))
    assert r.exit_code == 0 and '"expect": "fail"' in r.output and '"target": "softmax.nomax"' in r.output


def test_a_fixed_bug_changes_the_replay_and_mark_fixed_records_it(root):
    good = next((root / "crashes").rglob("*.case.zst"))
    case, record = __import__("kfuzz.corpus", fromlist=["load"]).load(good)
    from kfuzz.case import encode
    record = {**record, "minimize": {"executions": 7, "fixed_point": True}}
    good.write_bytes(encode(case.with_(target="softmax"), record))   # the "fixed" kernel
    r = invoke("replay", str(root / "crashes"))
    assert r.exit_code == 1 and "CHANGED" in r.output
    r = invoke("replay", "--mark-fixed", str(root / "crashes"))
    assert r.exit_code == 0 and "now passes" in r.output
    _, marked = __import__("kfuzz.corpus", fromlist=["load"]).load(good)
    assert marked["expect"] == "pass" and marked["minimize"] == record["minimize"]
    assert marked["fixed_from"] == record["signature"]
    r = invoke("replay", str(root / "crashes"))
    assert r.exit_code == 0 and "passes" in r.output
