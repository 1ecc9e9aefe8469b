"""The starting corpus: seeds/<target>/ holds cases that read back, name the target of
their folder, keep its contract, and pass on it (replay's rule for a case without a
record); every shipped operator and GDN target has seeds."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kfuzz.corpus import SUFFIX, load, target_folder
from kfuzz.replay import replay_file
from kfuzz.target import load_targets

ROOT = Path(__file__).resolve().parents[1]
SEEDS = ROOT / "seeds"
SHIPPED = ("softmax", "rowsum", "layernorm", "rmsnorm", "matmul", "cumsum", "gdn_fwd", "gdn_bwd")
OPERATORS = SHIPPED[:6]

sys.path.insert(0, str(ROOT / "tools"))
from make_seeds import seeds_of  # noqa: E402


def seed_files():
    return sorted(SEEDS.glob(f"*/*{SUFFIX}"))


def test_every_shipped_target_has_seeds():
    targets = load_targets()
    for name in SHIPPED:
        assert name in targets
        assert len(list((SEEDS / target_folder(name)).glob(f"*{SUFFIX}"))) >= 3, name


@pytest.mark.parametrize("path", seed_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_seed_reads_back_and_keeps_its_contract(path):
    case, record = load(path)
    assert record is None                       # a seed is a plain case
    assert target_folder(case.target) == path.parent.name
    load_targets()[case.target].validate(case)


@pytest.mark.parametrize("name", OPERATORS)
def test_operator_seeds_pass(name):
    for path in sorted((SEEDS / name).glob(f"*{SUFFIX}")):
        result = replay_file(path)
        assert result.status == "ok", result.message


def test_make_seeds_builds_three_valid_seeds_for_every_target():
    for name, target in load_targets().items():
        kinds = seeds_of(target)                # validates each against the contract
        assert set(kinds) == {"smallest", "tails", "specials"}, name
        assert len({c.hash for c in kinds.values()}) == 3, name
