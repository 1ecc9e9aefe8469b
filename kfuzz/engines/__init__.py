"""Search engines: where the next case comes from.

An engine proposes cases (``next_case``) and hears each verdict (``feedback``).
``random`` samples the case space of a target's contract; it is the baseline
and the fallback of every other engine. ``atheris`` is libFuzzer's
coverage-guided search with a structure-aware mutator (needs ``kfuzz[fuzz]``);
it also takes ``start``/``close`` and hears the harness coverage of each run.
"""
from kfuzz.engines.atheris import AtherisEngine
from kfuzz.engines.random import RandomEngine

ENGINES = {"random": RandomEngine, "atheris": AtherisEngine}

__all__ = ["ENGINES", "AtherisEngine", "RandomEngine"]
