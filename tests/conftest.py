import os

import pytest

from kfuzz.target import prepare_triton

# Triton kernels run under the interpreter when there is no GPU; it must be chosen before
# any harness module is imported (triton.jit reads it when it decorates).
prepare_triton()

# the test suite's own targets (escapes, hacks, positive controls: the kfuzz.fixtures
# entry points) register only when asked; sandboxed workers inherit the setting
os.environ["KFUZZ_FIXTURES"] = "1"


@pytest.fixture
def install_plugin(monkeypatch, tmp_path):
    """Install plugin packages as pip would, and read the target entry points anew.

    ``install_plugin(dist, files, groups, where=tmp_path)`` writes ``files`` (path relative
    to ``where`` -> source) and a distribution ``dist`` whose entry points are ``groups``
    (group -> name -> module) as ``where/<dist>-0.0.0.dist-info``, and puts ``where`` first
    on the path. The targets already registered stay registered (a module is imported
    once a process); what the test registers is dropped after it."""
    import importlib
    import sys

    import kfuzz.target as registry

    registry.load_targets()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_BROKEN", {})
    monkeypatch.setattr(registry, "_LOADED", False)
    before = set(sys.modules)

    def install(dist: str, files: dict, groups: dict, where=tmp_path):
        for rel, source in files.items():
            (where / rel).parent.mkdir(parents=True, exist_ok=True)
            (where / rel).write_text(source)
        info = where / f"{dist}-0.0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.0\n")
        (info / "entry_points.txt").write_text("".join(
            f"[{group}]\n" + "".join(f"{name} = {module}\n" for name, module in eps.items()) + "\n"
            for group, eps in groups.items()))
        monkeypatch.syspath_prepend(str(where))
        importlib.invalidate_caches()

    yield install
    for name in set(sys.modules) - before:
        if getattr(sys.modules[name], "__file__", None) and str(tmp_path) in sys.modules[name].__file__:
            del sys.modules[name]
