"""Cases and reported inputs from outside: every bad file is refused by name with exit 2
before anything is allocated, replay finishes and summarizes, two processes saving one
signature keep one case, and files get the user's umask."""
import json
import multiprocessing
import os
import zipfile

import numpy as np
import pytest
import torch
import zstandard
from click.testing import CliRunner

from kfuzz.case import ArgCase, Case, Dist
from kfuzz.cli import cli
from kfuzz.corpus import Corpus, load
from kfuzz.errors import CaseError
from kfuzz.execute import execute
from kfuzz.verdict import Verdict

import kfuzz.cli.import_, kfuzz.cli.minimize, kfuzz.cli.replay, kfuzz.cli.show  # noqa: F401,E401


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def write_case(path, **changes):
    doc = {"kfuzz": 1, "target": "softmax", "dtype": "float32", "seed": 1, "dims": {"N": 4, "D": 33}, **changes}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(zstandard.ZstdCompressor().compress(json.dumps(doc).encode()))
    return path


@pytest.fixture
def corpus(tmp_path):
    """A folder holding, in replay order, three bad files and a good failure after them."""
    folder = tmp_path / "crashes"
    write_case(folder / "a_offset.case.zst", args={"x": {"layout": {"kind": "offset", "offset": 1e9}}})
    write_case(folder / "b_strided.case.zst", args={"x": {"layout": {"kind": "strided", "step": [100000, 100000]}}})
    write_case(folder / "c_dims.case.zst", dims={"N": 10**12, "D": 33})
    case = Case.make("softmax.nomax", "float32", 3, {"N": 4, "D": 33},
                     {"x": ArgCase(dist=Dist("scaled", (("factor", 100.0),)))})
    good = Corpus(tmp_path).save_failure(case, execute(case))
    return folder, good


def test_replay_reports_each_bad_file_and_still_replays_the_rest(corpus):
    folder, good = corpus
    r = invoke("replay", str(folder))
    assert r.exit_code == 2, r.output
    assert "a_offset.case.zst: layout 'offset': offset must be an integer, got 1000000000.0" in r.output
    assert "b_strided.case.zst: case for target 'softmax': argument 'x' with layout" in r.output
    assert "spans 1320000000000 storage elements; its contract admits at most 528384" in r.output
    assert "c_dims.case.zst: case for target 'softmax': dim N=1000000000000 outside the contract" in r.output
    assert f"ok       {good}: still fails" in r.output
    assert "1 as expected, 0 changed, 3 unreadable" in r.output


def test_replay_exits_1_when_a_case_changed_and_a_file_is_bad(corpus):
    folder, good = corpus
    case, record = load(good)
    good.write_bytes(__import__("kfuzz.case", fromlist=["encode"]).encode(case.with_(target="softmax"), record))
    r = invoke("replay", str(folder))
    assert r.exit_code == 1 and "0 as expected, 1 changed, 3 unreadable" in r.output


@pytest.mark.parametrize("changes, message", [
    ({"target": "no_such_target"}, "unknown target 'no_such_target'"),
    ({"dims": {"N": 4, "D": 100000}}, "dim D=100000 outside the contract"),
    ({"args": {"x": {"layout": {"kind": "offset", "offset": 10**9}}}}, "its contract admits at most"),
    ({"record": {"expect": "fail"}}, "record expects a failure but names no 'signature'"),
    ({"record": {"expect": "fail", "signature": {"kind": "nonfinite"}}}, "record field 'signature' is malformed"),
    ({"record": {"expect": "maybe"}}, "record field 'expect' is 'maybe'"),
])
def test_show_and_minimize_check_the_target_the_contract_and_the_record(tmp_path, changes, message):
    f = write_case(tmp_path / "pr" / "x.case.zst", **changes)
    for verb in ("show", "minimize"):
        r = invoke(verb, str(f))
        assert r.exit_code == 2 and f"kfuzz: error: {f}: " in r.output and message in r.output, (verb, r.output)


def test_a_file_too_large_to_be_a_case_is_not_read(tmp_path, monkeypatch):
    monkeypatch.setenv("KFUZZ_MAX_CASE_FILE_BYTES", "1K")
    f = tmp_path / "big.case.zst"
    f.write_bytes(os.urandom(200_000))
    with pytest.raises(CaseError, match="big.case.zst: larger than 65.0 KiB"):
        load(f)
    with pytest.raises(CaseError, match="not a regular file"):
        load(tmp_path)


# imports: the contract and the budget from the headers, before the values -----------------

def npz_claiming(path, shape, dtype="<f4", data=b"\0" * 64):
    """An .npz whose one array's header claims ``shape`` and that holds only ``data``."""
    header = {"descr": dtype, "fortran_order": False, "shape": tuple(shape)}
    with zipfile.ZipFile(path, "w") as z, z.open("x.npy", "w") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.write(data)
    return path


def test_an_npz_claiming_a_billion_elements_is_refused_from_its_header(tmp_path):
    f = npz_claiming(tmp_path / "zeros.npz", (1000, 1_000_000))
    r = invoke("import", "--target", "softmax", "--no-minimize", "--root", str(tmp_path), str(f))
    assert r.exit_code == 2 and f"{f}: case for target 'softmax': dim D=1000000 outside the contract" in r.output


def test_an_npz_over_the_global_cap_is_refused_before_its_values_are_read(tmp_path, monkeypatch):
    monkeypatch.setenv("KFUZZ_MAX_CASE_BYTES", "64K")
    f = npz_claiming(tmp_path / "big.npz", (64, 512))
    r = invoke("import", "--target", "softmax", "--no-minimize", "--root", str(tmp_path), str(f))
    assert r.exit_code == 2 and "over the cap of 64.0 KiB" in r.output and "KFUZZ_MAX_CASE_BYTES" in r.output


@pytest.mark.parametrize("make, message", [
    (lambda p: npz_claiming(p, (4, 4), dtype="|O"), "holds Python objects"),
    (lambda p: npz_claiming(p, (4, 4), data=b"\0" * 10), "not a readable .npz file"),
    (lambda p: zipfile.ZipFile(p, "w").writestr("notes.txt", "hi"), "'notes.txt' is not a .npy array"),
])
def test_malformed_npz_files_are_refused(tmp_path, make, message):
    f = tmp_path / "r.npz"
    make(f)
    r = invoke("import", "--target", "softmax", "--no-minimize", "--root", str(tmp_path), str(f))
    assert r.exit_code == 2 and str(f) in r.output and message in r.output, r.output


def test_a_pt_with_a_compressed_member_is_refused(tmp_path):
    plain, packed = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"x": torch.zeros(4, 4)}, plain)
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as dst:
        for name in src.namelist():
            dst.writestr(name, src.read(name))
    r = invoke("import", "--target", "softmax", "--no-minimize", "--root", str(tmp_path), str(packed))
    assert r.exit_code == 2 and "is compressed; torch.save writes none" in r.output


# writing: one case a signature under concurrency, the user's umask ------------------------

def _save(root, seed, barrier, out):
    case = Case.make("softmax", "float32", seed, {"N": 2, "D": 2})
    barrier.wait()
    out.put(str(Corpus(root).save_failure(case, Verdict("softmax", "nonfinite", output="out"))))


def test_processes_saving_one_signature_at_once_keep_one_case(tmp_path):
    ctx = multiprocessing.get_context("fork")
    n = 6
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_save, args=(tmp_path, seed, barrier, out)) for seed in range(n)]
    for p in procs:
        p.start()
    saved = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    files = list((tmp_path / "crashes").rglob("*.case.zst"))
    assert len(files) == 1 and sorted(saved).count("None") == n - 1, (files, saved)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_saved_cases_get_the_users_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = Corpus(tmp_path).save_seed(Case.make("softmax", "float32", 0, {"N": 2, "D": 2}))
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == mode
