"""Dtype facts: the dtypes kfuzz knows by name (``DTYPES``), and per dtype its special values
(``special_value_table``) and unit roundoff (``unit_roundoff``); ``widen_float8`` for the
arithmetic torch lacks on float8.

Refuses (CaseError): an unknown dtype name.
"""
from __future__ import annotations

import math

import torch

from kfuzz.errors import CaseError

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32,
    "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "bool": torch.bool,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise CaseError(f"unknown dtype {name!r} (known: {', '.join(DTYPES)})") from None


def is_float(name: str) -> bool:
    return torch_dtype(name).is_floating_point


def special_value_table(dtype: str) -> dict[str, float | None]:
    """Each special value's float64 value in ``dtype``; None where the dtype has none."""
    dt = torch_dtype(dtype)
    if not dt.is_floating_point:
        info = torch.iinfo(dt) if dt != torch.bool else None
        mx = float(info.max) if info else 1.0
        mn = float(info.min) if info else 0.0
        return {"nan": None, "inf": None, "-inf": None, "-0": 0.0, "max": mx, "-max": mn,
                "tiny": 1.0, "subnormal": None}
    fi = torch.finfo(dt)
    has_inf = dt not in (getattr(torch, "float8_e4m3fn", None),)
    return {"nan": math.nan, "inf": math.inf if has_inf else None,
            "-inf": -math.inf if has_inf else None, "-0": -0.0,
            "max": float(fi.max), "-max": -float(fi.max),
            "tiny": float(fi.tiny), "subnormal": float(fi.tiny) * float(fi.eps)}


def unit_roundoff(dtype: str) -> float:
    dt = torch_dtype(dtype)
    return float(torch.finfo(dt).eps) / 2 if dt.is_floating_point else 0.0


def widen_float8(x: torch.Tensor) -> torch.Tensor:
    """``x``, as float32 where it is a float8 (float32 holds every float8 value, NaN and Inf
    exactly): torch has no comparisons, reductions or promotion to float64 for float8 on the
    CPU. Any other tensor is returned as it is."""
    return x.float() if x.is_floating_point() and x.element_size() == 1 else x
