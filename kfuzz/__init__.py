"""kfuzz: finds the inputs on which a numerical kernel disagrees with its float64 oracle.

The public API (``__all__``), each name imported from its module on first use, so that
``import kfuzz`` stays light (no torch until a name is asked for):

- writing a target: ``Arg``, ``Dim``, ``Output``, ``Target``, ``variant`` (the decorator is
  ``kfuzz.target.target``); finding one: ``get_target``, ``load_targets``, ``broken_modules``;
- cases: ``Case``, ``ArgCase``, ``Dist``, ``Layout``, ``materialize`` (a case's tensors),
  ``case_from_tensors`` (tensors as a case), ``load`` (a case file), ``Corpus`` (where
  failures and seeds are saved);
- running one: ``Verdict``, ``Signature``; the executors ``InProcess``, ``Pool``,
  ``Sandboxed`` (one case, judged: ``kfuzz.execute.execute``);
- searching: ``run_campaign``, ``ENGINES`` (``RandomEngine``, ``AtherisEngine``),
  ``minimize_failure``, ``replay_file`` (the minimizer and replay themselves:
  ``kfuzz.minimize.minimize``, ``kfuzz.replay.replay``);
- the gates: ``GATES``, ``run_gate``, ``run_gates``;
- errors: ``KfuzzError``, ``CaseError``, ``TargetError``.

A function named like its module (``target``, ``execute``, ``minimize``, ``replay``) is not
exported: Python binds a submodule to its package's name once imported, so ``kfuzz.target``
is the module. The CLI (``kfuzz.cli``) is a thin layer over these; docs/architecture.md shows the modules'
layers.
"""
from __future__ import annotations

import importlib

from kfuzz.version import __version__

# module -> the public names it gives kfuzz's top level
_EXPORTS = {
    "kfuzz.target": ("Arg", "Dim", "Output", "Target", "variant", "get_target", "load_targets",
                     "broken_modules"),
    "kfuzz.case": ("Case", "ArgCase", "Dist", "Layout"),
    "kfuzz.tensors": ("materialize", "case_from_tensors"),
    "kfuzz.corpus": ("Corpus", "load"),
    "kfuzz.verdict": ("Verdict", "Signature"),
    "kfuzz.executor": ("InProcess", "Pool", "Sandboxed"),
    "kfuzz.campaign": ("run_campaign",),
    "kfuzz.engines": ("ENGINES", "RandomEngine", "AtherisEngine"),
    "kfuzz.minimize": ("minimize_failure",),
    "kfuzz.replay": ("replay_file",),
    "kfuzz.gates": ("GATES", "run_gate", "run_gates"),
    "kfuzz.errors": ("KfuzzError", "CaseError", "TargetError"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["__version__", *_WHERE]


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kfuzz' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
