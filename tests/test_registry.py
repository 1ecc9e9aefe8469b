"""Target registration through entry points, as an installed plugin package registers them:
each test writes a package and its ``.dist-info/entry_points.txt`` (what pip installs) into
tmp_path and puts tmp_path on the path.

- the ``kfuzz.fixtures`` group loads only with ``KFUZZ_FIXTURES=1``;
- a target module that fails to import is that module's error: named once with its
  exception, its half-registered targets absent, every other target working.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import kfuzz.cli.targets  # noqa: F401  (registers the verb)
import kfuzz.target as registry
from kfuzz.cli import cli
from kfuzz.errors import TargetError
from kfuzz.execute import execute
from kfuzz.engines.random import RandomEngine

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


def install(root: Path, dist: str, modules: dict[str, str], groups: dict[str, dict[str, str]]) -> None:
    """Write ``modules`` (module name -> source) and a distribution ``dist`` whose entry
    points are ``groups`` (group -> name -> module) under ``root``, as pip would install them."""
    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)
    info = root / f"{dist}-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {module}\n" for name, module in eps.items()) + "\n"
        for group, eps in groups.items()))


@pytest.fixture
def fresh_registry(monkeypatch, tmp_path):
    """Entry points read anew from a path with tmp_path first; the targets already
    registered stay (their modules are imported once per process)."""
    registry.load_targets()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_BROKEN", {})
    monkeypatch.setattr(registry, "_LOADED", False)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("probe_")]:
        del sys.modules[name]


def test_fixture_group_loads_only_with_the_opt_in(fresh_registry, monkeypatch):
    install(fresh_registry, "probe_fixtures", {"probe_fixture": GOOD.format(name="probe.fixture")},
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


def test_a_broken_module_is_its_own_error(fresh_registry):
    install(fresh_registry, "probe_plugin",
            {"probe_good": GOOD.format(name="probe.good"), "probe_bad": BROKEN.format(name="probe.half")},
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


def test_kfuzz_targets_lists_the_others_and_names_the_broken_one(fresh_registry):
    install(fresh_registry, "probe_plugin",
            {"probe_good": GOOD.format(name="probe.good"), "probe_bad": BROKEN.format(name="probe.half")},
            {"kfuzz.targets": {"good": "probe_good", "bad": "probe_bad"}})
    r = CliRunner().invoke(cli, ["targets"])
    assert r.exit_code == 2, r.output
    listed = [line.split()[0] for line in r.stdout.splitlines()]
    assert "probe.good" in listed and "softmax" in listed and "probe.half" not in listed
    errors = r.stderr.strip().splitlines()
    assert errors == ["kfuzz: error: target module 'probe_bad' (entry point 'bad') failed to import: "
                      "ZeroDivisionError: division by zero"]


def test_kfuzz_run_on_a_good_target_beside_a_broken_module(tmp_path):
    """The whole command in a fresh process, its kernel in a sandboxed worker."""
    install(tmp_path, "probe_plugin",
            {"probe_good": GOOD.format(name="probe.good"), "probe_bad": BROKEN.format(name="probe.half")},
            {"kfuzz.targets": {"good": "probe_good", "bad": "probe_bad"}})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    r = subprocess.run([sys.executable, "-c", "from kfuzz.cli import main; main()", "run",
                        "--target", "probe.good", "--runs", "4", "--root", str(tmp_path)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
