import os

import pytest

from kfuzz.target import prepare_triton

# Triton kernels run under the interpreter when there is no GPU; it must be chosen before
# any harness module is imported (triton.jit reads it when it decorates).
prepare_triton()

# a Triton kernel runs on CPU tensors only under the interpreter, chosen once a process: on a
# machine with a GPU this process compiles Triton for it, and the tests marked triton_on_cpu
# (a Triton kernel called on CPU tensors in this process) are skipped there
TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "triton_on_cpu: calls a Triton kernel on CPU tensors in the test's own "
                                       "process (Triton's interpreter)")


def pytest_collection_modifyitems(config, items):
    if TRITON_ON_CPU:
        return
    skip = pytest.mark.skip(reason="calls a Triton kernel on CPU tensors in this process, which compiles Triton "
                                   "for the GPU: run it with TRITON_INTERPRET=1")
    for item in items:
        if item.get_closest_marker("triton_on_cpu"):
            item.add_marker(skip)


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
