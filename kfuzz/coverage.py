"""Harness coverage: the line-to-line edges a kernel call executes in the target's own
source files (the kernel, its launcher and, under the Triton interpreter, the Triton kernel
body), as integer ids stable across processes. Engines use it as feedback; torch itself is
not traced, and nothing outside the target's files counts.
"""
from __future__ import annotations

import inspect
import os
import sys
import zlib

from kfuzz.target import Target


def harness_files(target: Target) -> set[str]:
    """The source files whose lines count as the target's coverage."""
    files = set()
    for fn in (target.kernel, target.reference):
        try:
            files.add(inspect.getsourcefile(fn) or "")
        except TypeError:
            continue
    files.discard("")
    return {os.path.realpath(f) for f in files} | files


class HarnessCoverage:
    """Line-to-line edges executed in ``files``, as ids stable across processes."""

    def __init__(self, files: set[str]):
        self.ids = {f: zlib.crc32(os.path.basename(f).encode()) << 32 for f in files}
        self.edges: set[int] = set()

    def __enter__(self) -> "HarnessCoverage":
        self.edges = set()
        self._old = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(self._old)

    def _call(self, frame, event, arg):
        base = self.ids.get(frame.f_code.co_filename)
        if base is None:
            return None
        prev = [frame.f_lineno]

        def line(frame, event, arg):
            if event == "line":
                self.edges.add(base | (prev[0] << 16) | (frame.f_lineno & 0xFFFF))
                prev[0] = frame.f_lineno
            return line
        return line
