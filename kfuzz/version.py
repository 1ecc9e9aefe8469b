"""kfuzz's version, as case records and ``kfuzz --version`` report it."""
__version__ = "0.1.0"
