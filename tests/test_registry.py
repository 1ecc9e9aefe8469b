"""Target registration through entry points, as an installed plugin package registers them
(``install_plugin`` in conftest.py writes a package and its ``.dist-info/entry_points.txt``,
what pip installs, into tmp_path and puts tmp_path on the path).

- the ``kfuzz.fixtures`` group loads only with ``KFUZZ_FIXTURES=1``;
- a target module that fails to import is that module's error: named once with its
  exception, its half-registered targets absent, every other target working.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import kfuzz.cli.run  # noqa: F401  (registers the verbs)
import kfuzz.cli.targets  # noqa: F401
import kfuzz.target as registry
from kfuzz.cli import cli
from kfuzz.engines.random import RandomEngine
from kfuzz.errors import TargetError
from kfuzz.execute import execute

ROOT = Path(__file__).resolve().parents[1]

GOOD = '''
import torch
from kfuzz.target import Arg, Dim, Output, target


@target("{name}", reference=lambda x: x * 2, args={{"x": Arg(("N",))}},
        outputs={{"out": Output(("N",))}}, dims={{"N": Dim(1, 16)}})
def doubled(x):
    return x * 2
'''

# registers one target, then fails: the module is broken, and its first target must not linger
BROKEN = GOOD + '''

1 / 0
'''


def test_fixture_group_loads_only_with_the_opt_in(install_plugin, monkeypatch):
    install_plugin("probe_fixtures", {"probe_fixture.py": GOOD.format(name="probe.fixture")},
            {"kfuzz.fixtures": {"probe": "probe_fixture"}})
    monkeypatch.delenv("KFUZZ_FIXTURES", raising=False)
    assert "probe.fixture" not in registry.load_targets()
    with pytest.raises(TargetError, match="KFUZZ_FIXTURES=1"):
        registry.get_target("probe.fixture")
    monkeypatch.setenv("KFUZZ_FIXTURES", "1")
    monkeypatch.setattr(registry, "_LOADED", False)
    assert "probe.fixture" in registry.load_targets()


def test_pyproject_ships_no_fixture_as_a_target():
    import tomllib
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    shipped, fixtures = set(eps["kfuzz.targets"].values()), set(eps["kfuzz.fixtures"].values())
    assert {"harnesses.escapes", "harnesses.hacks", "harnesses.controls_search",
            "harnesses.controls_gates"} <= fixtures
    assert not shipped & fixtures
    assert {"harnesses.softmax", "harnesses.gdn"} <= shipped


def test_a_broken_module_is_its_own_error(install_plugin):
    install_plugin("probe_plugin",
            {"probe_good.py": GOOD.format(name="probe.good"), "probe_bad.py": BROKEN.format(name="probe.half")},
            {"kfuzz.targets": {"good": "probe_good", "bad": "probe_bad"}})
    targets = registry.load_targets()
    assert "probe.good" in targets and "softmax" in targets
    assert "probe.half" not in targets          # registered before the module failed: dropped
    [broken] = registry.broken_modules()
    assert (broken.module, broken.entry_point) == ("probe_bad", "bad")
    assert broken.error == "ZeroDivisionError: division by zero"
    assert "'probe_bad'" in str(broken) and "ZeroDivisionError" in str(broken)
    # the good target runs
    t = registry.get_target("probe.good")
    engine = RandomEngine(t, seed=0)
    assert all(execute(engine.next_case(), t).passed for _ in range(3))
    # asking for a missing target names the broken module and its exception
    with pytest.raises(TargetError, match="probe_bad.*ZeroDivisionError"):
        registry.get_target("probe.half")
    # loading again neither retries nor reports twice
    registry.load_targets()
    assert len(registry.broken_modules()) == 1


def test_kfuzz_targets_lists_the_others_and_names_the_broken_one(install_plugin):
    install_plugin("probe_plugin",
            {"probe_good.py": GOOD.format(name="probe.good"), "probe_bad.py": BROKEN.format(name="probe.half")},
            {"kfuzz.targets": {"good": "probe_good", "bad": "probe_bad"}})
    r = CliRunner().invoke(cli, ["targets"])
    assert r.exit_code == 2, r.output
    listed = [line.split()[0] for line in r.stdout.splitlines()]
    assert "probe.good" in listed and "softmax" in listed and "probe.half" not in listed
    errors = r.stderr.strip().splitlines()
    assert errors == ["kfuzz: error: target module 'probe_bad' (entry point 'bad') failed to import: "
                      "ZeroDivisionError: division by zero"]


def test_kfuzz_run_on_a_good_target_beside_a_broken_module(install_plugin, tmp_path):
    install_plugin("probe_plugin",
            {"probe_good.py": GOOD.format(name="probe.good"), "probe_bad.py": BROKEN.format(name="probe.half")},
            {"kfuzz.targets": {"good": "probe_good", "bad": "probe_bad"}})
    r = CliRunner().invoke(cli, ["run", "--target", "probe.good", "--runs", "4", "--jobs", "0",
                                 "--root", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "4 executions" in r.stdout and "0 failure signature(s)" in r.stdout


# a plugin module that queries and initializes the GPU at import, as kernel libraries do
CUDA_AT_IMPORT = '''
import torch
from kfuzz.target import Arg, Dim, Output, target

_ON_IMPORT = torch.zeros(1, device="cuda") + torch.cuda.device_count()


@target("{name}", reference=lambda x: x * 2, args={{"x": Arg(("N",))}},
        outputs={{"out": Output(("N",))}}, dims={{"N": Dim(1, 16)}})
def doubled(x):
    return x * 2
'''


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_a_plugin_that_initializes_cuda_at_import_runs_in_cuda_workers(install_plugin, tmp_path):
    """The campaign's process imports the plugin (so CUDA is live in it) before its workers
    start: each worker must still run the kernel, no case may end as a crash."""
    install_plugin("probe_cuda", {"probe_cuda.py": CUDA_AT_IMPORT.format(name="probe.cudaimport")},
            {"kfuzz.targets": {"cudaimport": "probe_cuda"}})
    import probe_cuda  # noqa: F401  (CUDA is now initialized in this process)
    assert __import__("torch").cuda.is_initialized()
    r = CliRunner().invoke(cli, ["run", "--target", "probe.cudaimport", "--runs", "8", "--jobs", "2",
                                 "--device", "cuda", "--root", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert "8 executions" in r.stdout and "0 failure signature(s)" in r.stdout
