"""Reported failures: a file of a kernel's arguments becomes a case with an explicit payload.

A user who hits a failure outside kfuzz saves the kernel's arguments, as a
``.pt`` (``torch.save`` of a dict name -> tensor, or of a list/tuple in the
target's argument order) or an ``.npz`` (``numpy.savez`` by name, or
positionally as ``arr_0, arr_1, ...``). The tensors' shapes give the sizes of
the target's symbolic dims; the dtype of the arguments that follow the case's
dtype gives the case's dtype. The values travel as the case's ``payload``
(logical values, row-major; the case's layout is contiguous). The case is
executed and must fail; then it is minimized (``kfuzz.minimize``), which slices
the payload tensors and zeroes their elements while the signature holds.

A reported input may come from outside, so it is checked before its values are
read: the shapes and dtypes come from the file's headers (``.npz``: each array's
``.npy`` header; ``.pt``: the tensors' metadata, the storages mapped, not read),
the target's contract and the storage budget (``Target.validate``) are checked on
them, and only then are the values read. A ``.pt`` is read with
``weights_only=True`` (no code from the file runs); one that is not a zip archive
(torch's format before 1.6) cannot be mapped and is refused when larger than
``kfuzz.limits.max_case_bytes()``.

Refuses (``CaseError``, naming the file): a file that cannot be read, missing or
unknown argument names, a tensor whose rank, fixed sizes or dtype disagree with
the contract, one symbolic dim given two sizes, sizes outside the contract, a
case over the storage budget. A case that passes is refused with ``NotReproducible``.
"""
from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch

from kfuzz.case import Case
from kfuzz.errors import CaseError
from kfuzz.execute import execute
from kfuzz.limits import CASE_BYTES_ENV, describe, max_case_bytes
from kfuzz.minimize import DEFAULT_BUDGET, Minimized, NotReproducible, minimize
from kfuzz.target import Target
from kfuzz.tensors import case_from_tensors, contract_of
from kfuzz.verdict import Verdict

Tensors = dict[str, torch.Tensor] | list[torch.Tensor]


@dataclass(frozen=True)
class Arguments:
    """The tensors a file holds: ``shapes`` (tensors on the meta device: shape and dtype,
    no values) from the file's headers, and ``read`` for the values, by name or in order."""

    shapes: Tensors
    read: Callable[[], Tensors]


def open_arguments(path: str | Path) -> Arguments:
    """The shapes and dtypes of the tensors in a ``.pt`` or ``.npz`` file, read from its
    headers; their values are read only by ``Arguments.read``."""
    p = Path(path)
    if not p.is_file():
        raise CaseError(f"{p}: no such file" if not p.exists() else f"{p}: not a regular file")
    if p.suffix in (".pt", ".pth"):
        return _open_pt(p)
    if p.suffix == ".npz":
        return _open_npz(p)
    raise CaseError(f"{p}: unknown file type {p.suffix!r} (import reads .pt and .npz)")


def read_arguments(path: str | Path) -> Tensors:
    """The tensors in a ``.pt`` or ``.npz`` file: by name, or in order."""
    return open_arguments(path).read()


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _open_pt(p: Path) -> Arguments:
    mapped = zipfile.is_zipfile(p)
    if mapped:   # torch.save stores its members; a compressed one would be inflated whole
        try:
            with zipfile.ZipFile(p) as z:
                packed = [i.filename for i in z.infolist() if i.compress_type != zipfile.ZIP_STORED]
        except (OSError, zipfile.BadZipFile) as e:
            raise CaseError(f"{p}: not a readable torch file ({e})") from None
        if packed:
            raise CaseError(f"{p}: member {packed[0]!r} is compressed; torch.save writes none")
    if not mapped and p.stat().st_size > max_case_bytes():
        raise CaseError(f"{p}: a torch file of {describe(p.stat().st_size)} that is not a zip archive "
                        f"(torch's format before 1.6) is read whole; the cap is {describe(max_case_bytes())} "
                        f"(set {CASE_BYTES_ENV} to raise it, or save it again with a current torch)")
    try:   # a zip archive is mapped: the storages are not read until a value is
        obj = torch.load(p, map_location="cpu", weights_only=True, mmap=mapped)
    except Exception as e:  # torch raises many types for a bad file
        raise CaseError(f"{p}: not a readable torch file ({type(e).__name__}: {e})") from None
    if isinstance(obj, torch.Tensor):
        obj = [obj]
    if isinstance(obj, Mapping):
        obj = dict(obj)
    elif isinstance(obj, (list, tuple)):
        obj = list(obj)
    else:
        raise CaseError(f"{p}: holds a {type(obj).__name__}; expected a dict of name -> tensor or a list of tensors")
    values = obj.values() if isinstance(obj, dict) else obj
    if not all(isinstance(t, torch.Tensor) for t in values):
        raise CaseError(f"{p}: every argument must be a tensor")
    if isinstance(obj, dict):
        return Arguments({k: _meta(t) for k, t in obj.items()}, lambda: obj)
    return Arguments([_meta(t) for t in obj], lambda: obj)


def _open_npz(p: Path) -> Arguments:
    try:
        with zipfile.ZipFile(p) as z:
            headers = {}
            for info in z.infolist():
                if not info.filename.endswith(".npy"):
                    raise CaseError(f"{p}: member {info.filename!r} is not a .npy array")
                with z.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    if version not in ((1, 0), (2, 0)):
                        raise CaseError(f"{p}: array {info.filename!r} is .npy format {version}; import reads 1.0 and 2.0")
                    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) \
                        else np.lib.format.read_array_header_2_0
                    shape, _, dtype = read_header(f)
                headers[info.filename[:-4]] = (info, shape, dtype)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise CaseError(f"{p}: not a readable .npz file ({e})") from None
    shapes = {}
    for name, (info, shape, dtype) in headers.items():
        if dtype.hasobject:
            raise CaseError(f"{p}: array {name!r} holds Python objects; import reads numbers")
        try:
            tdtype = torch.from_numpy(np.empty(0, dtype=dtype.newbyteorder("="))).dtype
        except TypeError:
            raise CaseError(f"{p}: array {name!r} has dtype {dtype}, which torch does not have") from None
        shapes[name] = torch.empty(shape, dtype=tdtype, device="meta")

    def read() -> Tensors:
        try:
            with zipfile.ZipFile(p) as z:
                arrays = {}
                for name, (info, shape, dtype) in headers.items():
                    with z.open(info) as f:
                        a = np.lib.format.read_array(f, allow_pickle=False)
                    if a.shape != shape or a.dtype != dtype:
                        raise ValueError(f"array {name!r} changed while it was read")
                    arrays[name] = torch.from_numpy(np.ascontiguousarray(a, dtype=dtype.newbyteorder("=")))
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
            raise CaseError(f"{p}: not a readable .npz file ({e})") from None
        return _by_name_or_order(arrays)

    return Arguments(_by_name_or_order(shapes), read)


def _by_name_or_order(tensors: dict[str, torch.Tensor]) -> Tensors:
    """``arr_0, arr_1, ...`` (``numpy.savez`` of positional arrays) as a list."""
    positional = [f"arr_{i}" for i in range(len(tensors))]
    return [tensors[k] for k in positional] if sorted(tensors) == sorted(positional) else tensors


@dataclass(frozen=True)
class Imported:
    found: Case                    # the case as reported
    verdict: Verdict               # its verdict
    minimized: Minimized | None    # None when not minimized


def import_failure(path: str | Path, target: Target, device: str = "cpu", minimize_it: bool = True,
                   max_executions: int = DEFAULT_BUDGET) -> Imported:
    """Read a reported failing input (its contract and storage budget checked from the file's
    headers before its values are read), verify that it fails, and minimize it."""
    arguments = open_arguments(path)
    contract_of(target, arguments.shapes, str(path))
    case = case_from_tensors(target, arguments.read(), str(path))
    verdict = execute(case, target, device=device)
    if verdict.passed:
        raise NotReproducible(f"{path}: target {target.name!r} passes on these inputs ({device}); nothing imported")
    if not minimize_it:
        return Imported(case, verdict, None)
    m = minimize(case, target, signature=verdict.signature, device=device, max_executions=max_executions)
    return Imported(case, verdict, m)
