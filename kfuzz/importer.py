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

Refuses (``CaseError``, naming the file): a file that cannot be read, missing or
unknown argument names, a tensor whose rank, fixed sizes or dtype disagree with
the contract, one symbolic dim given two sizes, sizes outside the contract. A
case that passes is refused with ``NotReproducible``.
"""
from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from kfuzz.case import Case
from kfuzz.errors import CaseError
from kfuzz.execute import execute
from kfuzz.minimize import DEFAULT_BUDGET, Minimized, NotReproducible, minimize
from kfuzz.target import Target
from kfuzz.tensors import encode_payload
from kfuzz.verdict import Verdict


def read_arguments(path: str | Path) -> dict[str, torch.Tensor] | list[torch.Tensor]:
    """The tensors in a ``.pt`` or ``.npz`` file: by name, or in order."""
    p = Path(path)
    if not p.is_file():
        raise CaseError(f"{p}: no such file")
    if p.suffix in (".pt", ".pth"):
        try:
            obj = torch.load(p, map_location="cpu", weights_only=True)
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
        return obj
    if p.suffix == ".npz":
        try:
            with np.load(p, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError, zipfile.BadZipFile) as e:
            raise CaseError(f"{p}: not a readable .npz file ({e})") from None
        tensors = {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in arrays.items()}
        positional = [f"arr_{i}" for i in range(len(tensors))]
        return [tensors[k] for k in positional] if sorted(tensors) == sorted(positional) else tensors
    raise CaseError(f"{p}: unknown file type {p.suffix!r} (import reads .pt and .npz)")


def case_from_tensors(target: Target, tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
                      source: str = "<tensors>") -> Case:
    """The case whose payload is ``tensors``, its dims and dtype read off their shapes."""
    names = list(target.args)
    if not isinstance(tensors, Mapping):
        if len(tensors) != len(names):
            raise CaseError(f"{source}: {len(tensors)} tensors for {len(names)} arguments ({', '.join(names)})")
        tensors = dict(zip(names, tensors))
    missing, unknown = set(names) - set(tensors), set(tensors) - set(names)
    if missing or unknown:
        raise CaseError(f"{source}: target {target.name!r} takes {', '.join(names)}"
                        + (f"; missing {sorted(missing)}" if missing else "")
                        + (f"; unknown {sorted(unknown)}" if unknown else ""))
    dims: dict[str, int] = {}
    case_dtypes = set()
    for name, spec in target.args.items():
        t = tensors[name]
        if t.dim() != len(spec.shape):
            raise CaseError(f"{source}: argument {name!r} has {t.dim()} dims {list(t.shape)}, "
                            f"the contract says {len(spec.shape)} {list(spec.shape)}")
        for axis, (sym, n) in enumerate(zip(spec.shape, t.shape)):
            if isinstance(sym, int):
                if n != sym:
                    raise CaseError(f"{source}: argument {name!r} has size {n} at axis {axis}, the contract says {sym}")
            elif dims.setdefault(sym, int(n)) != n:
                raise CaseError(f"{source}: dim {sym} is {dims[sym]} by one argument and {n} by {name!r}")
        dt = str(t.dtype).removeprefix("torch.")
        if spec.dtype == "case":
            case_dtypes.add(dt)
        elif dt != spec.dtype:
            raise CaseError(f"{source}: argument {name!r} is {dt}, the contract says {spec.dtype}")
    if len(case_dtypes) > 1:
        raise CaseError(f"{source}: arguments of the case's dtype disagree: {sorted(case_dtypes)}")
    undetermined = set(target.dims) - set(dims)
    if undetermined:
        raise CaseError(f"{source}: no argument gives the size of dims {sorted(undetermined)}")
    dtype = case_dtypes.pop() if case_dtypes else target.dtypes[0]
    case = Case.make(target.name, dtype, 0, dims,
                     payload={name: encode_payload(t) for name, t in tensors.items()})
    try:
        target.validate(case)
    except CaseError as e:
        raise CaseError(f"{source}: {e}") from None
    return case


@dataclass(frozen=True)
class Imported:
    found: Case                    # the case as reported
    verdict: Verdict               # its verdict
    minimized: Minimized | None    # None when not minimized


def import_failure(path: str | Path, target: Target, device: str = "cpu", minimize_it: bool = True,
                   max_executions: int = DEFAULT_BUDGET) -> Imported:
    """Read a reported failing input, verify that it fails, and minimize it."""
    case = case_from_tensors(target, read_arguments(path), str(path))
    verdict = execute(case, target, device=device)
    if verdict.passed:
        raise NotReproducible(f"{path}: target {target.name!r} passes on these inputs ({device}); nothing imported")
    if not minimize_it:
        return Imported(case, verdict, None)
    m = minimize(case, target, signature=verdict.signature, device=device, max_executions=max_executions)
    return Imported(case, verdict, m)
