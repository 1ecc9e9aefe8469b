"""Search engines: where the next case comes from.

An engine proposes cases (``next_case``) and hears each verdict (``feedback``).
``random`` samples the case space of a target's contract; it is the baseline
and the fallback of every other engine.
"""
from kfuzz.engines.random import RandomEngine

ENGINES = {"random": RandomEngine}

__all__ = ["ENGINES", "RandomEngine"]
