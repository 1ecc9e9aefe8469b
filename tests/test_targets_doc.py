"""The plugin package of docs/targets.md, written out from the page itself: its entry
point registers its targets, the correct kernel passes random cases of its contract, and
a campaign finds the planted bug and saves it minimized."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

from kfuzz.campaign import run_campaign
from kfuzz.case import ArgCase, Case
from kfuzz.corpus import Corpus, iter_case_files, load
from kfuzz.engines.random import RandomEngine
from kfuzz.execute import execute
from kfuzz.target import get_target, load_targets

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "targets.md"


def doc_files(page: Path = DOC) -> dict[str, str]:
    """The page's code blocks whose first line is ``# file: PATH``, by path."""
    blocks = re.findall(r"```(?:python|toml)\n# file: (\S+)\n(.*?)```", page.read_text(), re.S)
    return {path: body for path, body in blocks}


def test_the_page_has_the_whole_package():
    assert set(doc_files()) == {"mykernels/pyproject.toml", "mykernels/mykernels/__init__.py",
                                "mykernels/mykernels/targets.py"}


def test_the_readme_shows_the_same_package():
    readme = doc_files(ROOT / "README.md")
    assert set(readme) == {"mykernels/pyproject.toml", "mykernels/mykernels/targets.py"}
    assert all(body == doc_files()[path] for path, body in readme.items())


def test_the_example_plugin_registers_and_runs(install_plugin, tmp_path, monkeypatch):
    files = doc_files()
    eps = tomllib.loads(files["mykernels/pyproject.toml"])["project"]["entry-points"]
    install_plugin("mykernels", files, eps, where=tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "mykernels"))     # where pip -e puts the package
    targets = load_targets()
    assert {"mykernels.lse", "mykernels.lse.noshift"} <= set(targets)
    assert targets["mykernels.lse.noshift"].planted_bug

    t = get_target("mykernels.lse")
    engine = RandomEngine(t, seed=0)
    verdicts = [execute(engine.next_case(), t) for _ in range(12)]
    assert all(v.passed for v in verdicts), [v.detail for v in verdicts if not v.passed]

    # the page's own example case: x[0, 0] = 100 overflows exp in fp32 without the shift
    hot = Case.make("mykernels.lse.noshift", "float32", seed=0, dims={"N": 2, "D": 8},
                    args={"x": ArgCase(inject=((0, 100.0),))})
    assert execute(hot).passed is False
    assert execute(hot.with_(target="mykernels.lse")).passed

    corpus = Corpus(tmp_path / "project")
    bug = get_target("mykernels.lse.noshift")
    stats = run_campaign(bug, RandomEngine(bug, seed=0), corpus, runs=60, jobs=0, stop_on_failure=True)
    assert stats.failures, "60 random cases did not find the planted overflow"
    [saved] = list(iter_case_files([corpus.crashes]))
    case, record = load(saved)
    assert record["expect"] == "fail" and case.target == "mykernels.lse.noshift"
