import os

import pytest
import torch

# Triton kernels run under the interpreter when there is no GPU; it must be chosen before
# any harness module is imported (triton.jit reads it when it decorates).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")



def _share_the_launchs_language_patch():
    """Under the interpreter, a call of one @triton.jit function from another re-patches
    triton.language (an inspect.getmembers walk of the module, a third of the GDN kernels'
    interpreted time) although the launch around it already did and restores it at its end.
    Nested calls skip it where the launch patched every language module the callee sees;
    what runs is unchanged."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch, launch = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch is None or launch is None or not hasattr(interpreter, "_LangPatchScope"):
        return
    patched: list = []   # per launch in progress: the language modules patched in it (None: not yet)
    seen: dict = {}      # function -> ids of the language modules it sees

    def langs(fn):
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                 if inspect.ismodule(v) and v in (tl, tl.core))
        return seen[fn]

    def patch_once(fn):
        if patched and patched[-1] is not None and langs(fn) <= patched[-1]:
            return interpreter._LangPatchScope()
        if patched:
            patched[-1] = langs(fn) | (patched[-1] or frozenset())
        return patch(fn)

    run = launch.__call__

    def run_patched_once(self, *args, **kwargs):
        patched.append(None)
        try:
            return run(self, *args, **kwargs)
        finally:
            patched.pop()

    interpreter._patch_lang = patch_once
    launch.__call__ = run_patched_once


if os.environ.get("TRITON_INTERPRET") == "1":
    _share_the_launchs_language_patch()

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
