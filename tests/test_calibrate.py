"""tools/calibrate.py's GDN family: the real-bug records are read from the crash files, and the
document renders readings against the GDN bound in force (C x BOUND_SCALE) through the real render.

Measuring a GDN target takes minutes on the CPU (its five tolerance gates: ~90 s for gdn_fwd), so
the table here comes from the real gates on a fast operator target (rowsum), rendered with the GDN
scale, plus the real records under crashes/gdn_*.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kfuzz.case import encode
from kfuzz.corpus import load

ROOT = Path(__file__).resolve().parents[1]
BOUND_HT = "5f0cbe02b827dd0e.case.zst"   # gdn_fwd bound-ht found by the gates at 2.29x


@pytest.fixture(scope="module")
def cal():
    spec = importlib.util.spec_from_file_location("calibrate", ROOT / "tools" / "calibrate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_real_bugs_read_from_the_gdn_records(cal, monkeypatch):
    monkeypatch.chdir(ROOT)
    found = cal.real_bugs(cal.GDN_CRASHES)
    kinds = {Path(b["path"]).parent.name for b in found}
    assert "nonfinite-o" not in kinds and "nonfinite-dk" not in kinds     # tolerance-free: not the bound's
    assert {"bound-ht", "bound-dg", "bound-dv", "bound-dq"} <= kinds
    for b in found:                                                      # each ratio is the record's own
        _, record = load(ROOT / b["path"])
        assert b["ratio"] == record["verdict"]["ratio"] and b["output"] == record["verdict"]["output"]
    (ht,) = [b for b in found if Path(b["path"]).name == BOUND_HT]
    assert ht["target"] == "gdn_fwd" and ht["output"] == "ht"
    assert 2.2 < ht["ratio"] < 2.4                                       # "2.29x" in its detail
    # found at C x 4 = 32: its normwise bound over the floor-dominated denominator
    assert ht["c_found"] == pytest.approx(cal.BOUND_C * 4, rel=1e-6)


def test_a_record_without_ratio_says_so(cal, tmp_path):
    src = ROOT / "crashes" / "gdn_fwd" / "bound-ht" / BOUND_HT
    case, record = load(src)
    record = dict(record, verdict={k: v for k, v in record["verdict"].items() if k != "ratio"})
    (tmp_path / "bound-ht").mkdir()
    (tmp_path / "bound-ht" / src.name).write_bytes(encode(case, record))
    bugs = cal.real_bugs([tmp_path])
    assert [b["ratio"] for b in bugs] == [None]
    text = cal.render({"gdn_fwd": {g: {"status": "pass", "ratio": 0.25, "kinds": []}
                                   for g in cal.TOLERANCE_GATES}}, [0], cal.BOUND_C, 0, scale=4.0, bugs=bugs)
    assert "| not in the record |" in text
    assert "a margin of 4x above the worst correct kernel" in text
    rows = {"gdn_bwd": {g: {"status": "pass", "ratio": 0.25, "kinds": []} for g in cal.TOLERANCE_GATES}}
    rows["gdn_bwd"]["G03"] = {"status": "fail", "ratio": 2.5, "kinds": ["bound"]}
    text = cal.render(rows, [0], cal.BOUND_C, 0, scale=4.0, bugs=bugs)
    assert "2.5x too tight for the worst correct kernel" in text and "| 4 (2.5) |" in text


def test_gdn_render_from_a_measured_gate(cal, monkeypatch):
    monkeypatch.chdir(ROOT)
    rows = cal.measure(["rowsum"], [0], lambda m: None)                  # real gates, a fast target
    worst = max(c["ratio"] for c in rows["rowsum"].values() if c["status"] != "n/a")
    assert 0 < worst <= 1
    bugs = cal.real_bugs(cal.GDN_CRASHES)
    text = cal.render(rows, [0], cal.BOUND_C, 0, scale=4.0, bugs=bugs)
    assert f"C x `BOUND_SCALE` = {cal.BOUND_C:g} x 4 = {cal.BOUND_C * 4:g}" in text
    assert f"need `BOUND_SCALE` >= {worst * 4:.3g}" in text
    assert "## Real bugs the bound caught" in text and "crashes/gdn_fwd/bound-ht/" in text
    weakest = min(b["ratio"] for b in bugs)
    assert f"the weakest real bug in the records reads {weakest:.3g}" in text
    row = next(line for line in text.splitlines() if line.startswith("| `rowsum` |"))
    assert row.count("|") == len(cal.TOLERANCE_GATES) + 2
    # the operators' document is the other form: no GDN section, its own constants
    plain = cal.render(rows, [0], cal.BOUND_C, 0)
    assert "## The constants" in plain and "Real bugs" not in plain and "BOUND_SCALE" not in plain
