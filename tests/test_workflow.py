"""The GPU fuzzing workflow passes the workflow linters CI can install from the package
registry: GitHub's workflow schema (check-jsonschema) and zizmor's audits (offline)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

WORKFLOW = Path(__file__).resolve().parent.parent / ".github" / "workflows" / "gpu-fuzz.yml"
UNPINNED = """on: push
jobs:
  j:
    runs-on: ubuntu-latest
    steps:
      - uses: actions/checkout@v4
      - run: echo "${{ github.event.head_commit.message }}"
"""


def _lint(tool: str, *args: str) -> subprocess.CompletedProcess:
    if shutil.which(tool) is None:
        pytest.fail(f"{tool} is not installed: it is in the dev extra (pip install -e '.[dev]')")
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("tool, args", [("check-jsonschema", ("--builtin-schema", "vendor.github-workflows")),
                                        ("zizmor", ("--offline",))])
def test_the_gpu_workflow_passes_the_linter_and_a_flawed_one_does_not(tool, args, tmp_path):
    ok = _lint(tool, *args, str(WORKFLOW))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = tmp_path / "bad.yml"
    bad.write_text(UNPINNED if tool == "zizmor" else UNPINNED.replace("runs-on", "runs_on"))
    assert _lint(tool, *args, str(bad)).returncode != 0
