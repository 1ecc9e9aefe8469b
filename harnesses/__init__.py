"""kfuzz's own targets: operator kernels with float64 oracles, their planted-bug variants
(kfuzz's positive controls), and the GDN family. Each module registers through
``kfuzz.target.target`` and is listed in the ``kfuzz.targets`` entry-point group."""
