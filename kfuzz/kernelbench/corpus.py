"""KernelBench corpora: the pairs of a corpus file or folder, one ``CorpusEntry`` a row (``read_corpus``).

- a CUDA-L1 ``*.jsonl`` (one row a line: ``level_id``, ``task_id``, ``ref_code``,
  ``custom_code``; a null ``custom_code`` was not accepted and is skipped);
- a KernelBench leaderboard ``*.json`` (a list of ``level``, ``problem_id``,
  ``code``, ``model``), joined on (level, problem) with the ``ref_code`` of the
  CUDA-L1 ``*.jsonl`` files beside it. The leaderboard counts problems from 0 and
  CUDA-L1 (like KernelBench's file names) from 1: problem ``problem_id + 1``
  (``LEADERBOARD_FIRST_PROBLEM``; on the shipped corpus, 412 of 413 solutions take
  the ``__init__`` and ``forward`` arguments of the reference one further on, none
  only of the same number);
- a folder of controls: ``*.py`` solutions whose header names their reference
  (``# reference: <file>``) and the planted bug (``# planted: <bug>`` or ``none``).

``read_row`` reads one row by its index (a control by its file stem), parsing only that
row's sources where the format allows. A target ``kb:<corpus file>:<row>`` names the corpus by
the path it was audited with; where that path does not exist here (a gate case replayed on
another machine), ``read_row`` reads the file of the same name in the folders of
``KFUZZ_CORPORA`` (``os.pathsep``-separated; ``kfuzz verify --corpora DIR`` sets it), and the
row keeps the name it was saved under.

Refuses (``KfuzzError``): unknown corpus formats, unreadable files, rows that are not
JSON objects. A row whose pair does not load is an entry with its ``skip`` reason.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kfuzz.errors import KfuzzError
from kfuzz.kernelbench import build
from kfuzz.kernelbench.source import KernelBenchError, KernelBenchPair, load_pair

CORPORA_ENV = "KFUZZ_CORPORA"     # folders where a corpus named by a path that is not here is looked for
_MODE_SENSITIVE = re.compile(r"BatchNorm|InstanceNorm|Dropout|dropout|\.training|\.eval\(|\.train\(")
_GPU_ONLY = re.compile(r"load_inline|cpp_extension|\.cuda\(|device\s*=\s*['\"]cuda|torch\.cuda\.(Stream|Event|"
                       r"CUDAGraph|graph|stream)|import triton|from triton")


@dataclass(frozen=True)
class CorpusEntry:
    """One row of a corpus: the pair to audit, or why it is skipped."""

    key: str                     # "<corpus file name>:<row>", unique across corpora
    pair: KernelBenchPair | None
    skip: str | None = None
    expect: str | None = None    # controls: the planted bug, "none" for a correct one

    @property
    def cpu_runnable(self) -> bool:
        """A cheap static check: the solution neither compiles CUDA nor asks for the GPU."""
        return self.pair is not None and not _GPU_ONLY.search(self.pair.custom_code)

    @property
    def mode_sensitive(self) -> bool:
        """The reference behaves differently in train and eval mode (a static check)."""
        return self.pair is not None and bool(_MODE_SENSITIVE.search(self.pair.ref_code))

    @property
    def compiles(self) -> bool:
        """The solution builds an extension (a static check): it gets a build step."""
        return self.pair is not None and build.compiles(self.pair.custom_code)


def _load_json_lines(path: Path) -> list[dict]:
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise KfuzzError(f"{path}: line {i + 1} is not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise KfuzzError(f"{path}: line {i + 1} is not a JSON object")
        rows.append(row)
    return rows


def _entry(key: str, ref: str | None, custom: str | None, skip_null: str, **meta) -> CorpusEntry:
    if custom is None:
        return CorpusEntry(key, None, skip_null)
    if ref is None:
        return CorpusEntry(key, None, "no reference code to join with")
    expect = meta.pop("expect", None)
    name = meta.pop("name", None)
    try:
        return CorpusEntry(key, load_pair(ref, custom, name if isinstance(name, str) and name else key,
                                          source=meta.pop("source"), **meta), expect=expect)
    except KernelBenchError as e:
        return CorpusEntry(key, None, str(e), expect)


def _cuda_l1(path: Path, only: str | None = None) -> list[CorpusEntry]:
    gpu = path.stem.removeprefix("cuda-l1-")
    return [_entry(f"{path.name}:{i}", r.get("ref_code"), r.get("custom_code"),
                   "custom_code is null (not accepted)", name=r.get("name"), level=r.get("level_id"),
                   problem=r.get("task_id"),
                   model=f"cuda-l1/{gpu}", source=f"{path}:{i}", eval_mode=True)
            for i, r in enumerate(_load_json_lines(path)) if only is None or str(i) == only]


def _references(folder: Path) -> dict[tuple[int, int], str]:
    refs = {}
    for f in sorted(folder.glob("*.jsonl")):
        for r in _load_json_lines(f):
            if r.get("ref_code") and "level_id" in r:
                refs.setdefault((int(r["level_id"]), int(r["task_id"])), r["ref_code"])
    return refs


LEADERBOARD_FIRST_PROBLEM = 1   # the KernelBench problem number of the leaderboard's problem_id 0


def _leaderboard(path: Path) -> list[CorpusEntry]:
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise KfuzzError(f"{path}: not JSON ({e.msg})") from None
    if not isinstance(rows, list):
        raise KfuzzError(f"{path}: a leaderboard is a JSON list of entries")
    refs = _references(path.parent)

    def problem(r: dict) -> int:
        return int(r.get("problem_id", -1)) + LEADERBOARD_FIRST_PROBLEM
    return [_entry(f"{path.name}:{i}", refs.get((int(r.get("level", -1)), problem(r))),
                   r.get("code"), "code is null", name=r.get("name"), level=r.get("level"), problem=problem(r),
                   model=str(r.get("model", "")), source=f"{path}:{i}")
            for i, r in enumerate(rows)]


def _header(text: str, field: str) -> str | None:
    m = re.search(rf"^#\s*{field}:\s*(.+?)\s*$", text, re.M)
    return m.group(1) if m else None


def _controls(folder: Path, only: str | None = None) -> list[CorpusEntry]:
    entries = []
    for f in sorted(folder.glob("*.py" if only is None else f"{only}.py")):
        text = f.read_text()
        ref_name = _header(text, "reference")
        if ref_name is None:
            continue                 # a reference file itself
        ref = (folder / ref_name).read_text() if (folder / ref_name).is_file() else None
        entries.append(_entry(f"{folder.name}:{f.stem}", ref, text, "", model="control",
                              source=f"{folder}:{f.stem}", expect=_header(text, "planted") or "none"))
    return entries


def read_corpus(path: str | Path) -> list[CorpusEntry]:
    """Every row of a corpus file or controls folder (see the module docstring)."""
    p = Path(path)
    if p.is_dir():
        return _controls(p)
    if not p.is_file():
        raise KfuzzError(f"{p}: no such corpus file or folder")
    if p.suffix == ".jsonl":
        return _cuda_l1(p)
    if p.suffix == ".json":
        return _leaderboard(p)
    raise KfuzzError(f"{p}: unknown corpus format (want a CUDA-L1 .jsonl, a leaderboard .json or a folder)")


def locate(path: str | Path) -> Path:
    """``path`` where it exists, else the first file or folder of its name in ``CORPORA_ENV``'s
    folders; a corpus found nowhere is refused, naming where it was looked for."""
    p = Path(path)
    if p.exists():
        return p
    folders = [f for f in os.environ.get(CORPORA_ENV, "").split(os.pathsep) if f]
    for folder in folders:
        if (Path(folder) / p.name).exists():
            return Path(folder) / p.name
    where = f" nor in {CORPORA_ENV}'s folders ({', '.join(folders)})" if folders else (
        f" (a corpus audited elsewhere: name the folder that holds {p.name} with --corpora DIR or {CORPORA_ENV})")
    raise KfuzzError(f"{path}: no such corpus file or folder{where}")


def read_row(path: str | Path, row: str | int) -> CorpusEntry:
    """One row of a corpus by its index (a control by its file stem); only that row's sources are
    parsed where the format allows (a worker resolves its pair in a fraction of a second). A
    corpus found by ``locate`` elsewhere gives its row under the name ``path`` gave it."""
    p = locate(path)
    entries = (_controls(p, str(row)) if p.is_dir() else _cuda_l1(p, str(row)) if p.suffix == ".jsonl"
               and p.is_file() else read_corpus(p))
    for e in entries:
        if e.key.rsplit(":", 1)[1] == str(row):
            if p != Path(path) and e.pair is not None:
                e = dataclasses.replace(e, pair=dataclasses.replace(e.pair, source=f"{path}:{row}"))
            return e
    raise KfuzzError(f"{path}: no row {row}")
