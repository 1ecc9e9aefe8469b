"""CI holds the line: every case in the project's crashes/ ends as recorded."""
from pathlib import Path

import pytest

from kfuzz.corpus import iter_case_files
from kfuzz.replay import replay_file

CRASHES = Path(__file__).resolve().parent.parent / "crashes"
FILES = list(iter_case_files([CRASHES])) if CRASHES.is_dir() else []


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(CRASHES)) for p in FILES])
def test_saved_case_replays_as_recorded(path):
    r = replay_file(path)
    assert r.status == "ok", r.message
