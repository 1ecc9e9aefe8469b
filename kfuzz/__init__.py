"""kfuzz: finds the inputs on which a numerical kernel disagrees with its float64 oracle.

Public API: ``Case`` (kfuzz.case), ``materialize`` (kfuzz.tensors), ``target`` and
``get_target`` (kfuzz.target), ``execute`` (kfuzz.execute), ``Verdict`` (kfuzz.verdict),
``Corpus`` (kfuzz.corpus). The CLI (kfuzz.cli) is a thin layer over these.
"""
__version__ = "0.1.0"
