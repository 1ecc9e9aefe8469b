"""The caps on what kfuzz takes from a file: how large a case file may decompress to, and how
much memory the tensors of one case (or of one imported input) may take.

A case file, a corpus and a reported input may come from outside (a pull request, a bug
report), so what they ask for is bounded before anything is allocated. Each cap is read
from the environment when it is checked, as a number of bytes with an optional binary
suffix (``512M``, ``32G``):

- ``KFUZZ_MAX_CASE_FILE_BYTES`` (default 64 MiB): a case file's JSON after zstd
  decompression; such a file may also hold at most ``MAX_JSON_VALUES`` JSON values
  (a long list of tiny values costs far more memory than its text).
- ``KFUZZ_MAX_CASE_BYTES`` (default a quarter of the machine's physical memory, 4 GiB
  where it cannot be read): the memory that materializing one case read from a file
  takes (``kfuzz.target.check_storage``), and the tensors of an imported input.

Refuses (``KfuzzError``): a value that is not a size.
"""
from __future__ import annotations

import os
import re

from kfuzz.errors import KfuzzError

CASE_FILE_ENV = "KFUZZ_MAX_CASE_FILE_BYTES"
CASE_BYTES_ENV = "KFUZZ_MAX_CASE_BYTES"
DEFAULT_CASE_FILE_BYTES = 64 << 20
MAX_JSON_VALUES = 1_000_000

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str, name: str) -> int:
    """``text`` as a number of bytes (``4096``, ``512M``, ``32G``, ``1T``)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise KfuzzError(f"{name}={text!r} is not a size (a number of bytes, optionally with K, M, G or T)")
    return int(m.group(1)) * _SUFFIX[m.group(2).upper()]


def _from_env(name: str, default: int) -> int:
    text = os.environ.get(name)
    return default if text is None or not text.strip() else parse_size(text, name)


def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def max_case_file_bytes() -> int:
    """The most bytes a case file's JSON may take once decompressed."""
    return _from_env(CASE_FILE_ENV, DEFAULT_CASE_FILE_BYTES)


def max_case_bytes() -> int:
    """The most memory materializing one case may take."""
    memory = physical_memory()
    return _from_env(CASE_BYTES_ENV, memory // 4 if memory else 4 << 30)


def describe(n: int) -> str:
    """A byte count for a message: ``12.0 GiB (12884901888 bytes)``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"
