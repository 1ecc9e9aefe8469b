"""pytest collects the crash corpus: every ``crashes/**/*.case.zst`` is one test item.

Registered through the ``pytest11`` entry point, so a plain ``pytest crashes/`` (or
``python -m pytest`` with ``crashes`` in ``testpaths``) replays every saved case, and
``--junitxml`` reports each one. An item is named by its target and failure
signature (``softmax.nomax/nonfinite-out``); it passes when the case ends as its
record says (``kfuzz.replay``: ``expect: fail`` must fail with the same signature,
``expect: pass`` must pass). A file that cannot be read is a failing item that
names the file and what is wrong; it never stops the other cases.

Files are collected only under a folder named ``crashes``: other ``.case.zst``
files (seeds, scratch copies) are not tests.

The cases replay where ``kfuzz replay`` replays them by default (``auto``: cuda where torch
sees a GPU, else cpu), except in a process whose Triton runs under its interpreter
(``TRITON_INTERPRET=1``), which replays on the cpu: Triton's mode is chosen once a process.
"""
from __future__ import annotations

import os

import pytest

from kfuzz.corpus import SUFFIX, load
from kfuzz.devices import resolve_device
from kfuzz.errors import KfuzzError
from kfuzz.replay import ReplayResult, replay_file
from kfuzz.verdict import Signature


def pytest_collect_file(file_path, parent):
    if (file_path.name.endswith(SUFFIX) and not file_path.name.startswith(".tmp-")
            and "crashes" in file_path.parts[:-1]):
        return CaseFile.from_parent(parent, path=file_path)
    return None


def item_name(path) -> str:
    """``target/signature`` from the record; the file name for a file that cannot be read."""
    try:
        case, record = load(path)
    except KfuzzError:
        return path.name
    if record and "signature" in record:
        sig = Signature.from_json(record["signature"])
        return f"{case.target}/{sig.slug}" + ("" if record.get("expect", "fail") == "fail" else "[fixed]")
    return f"{case.target}/pass"


def replay_device(cuda_count: int | None = None) -> str:
    """The device this process replays the crash corpus on (``cuda_count``: the GPUs visible,
    by default torch's count)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    return resolve_device("auto", cuda_count)


class CaseFile(pytest.File):
    def collect(self):
        yield CaseItem.from_parent(self, name=item_name(self.path))


class ReplayMismatch(Exception):
    def __init__(self, result: ReplayResult):
        super().__init__(result.message)
        self.result = result


class CaseItem(pytest.Item):
    def runtest(self):
        result = replay_file(self.path, replay_device())
        if result.status != "ok":
            raise ReplayMismatch(result)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ReplayMismatch):
            r = excinfo.value.result
            what = "cannot be replayed" if r.status == "error" else "no longer ends as recorded"
            detail = r.verdict.detail if r.verdict is not None else ""
            detail = f"\n{detail}" if detail and detail not in r.message else ""
            return f"{self.path}: {what}: {r.message}{detail}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"kfuzz case {self.name}"
