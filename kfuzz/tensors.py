"""Materialization: a case becomes tensors, the same bits on any machine.

Values are drawn in float64 on the CPU from numpy's PCG64 stream, seeded by
(case seed, CRC32 of the argument name), so they do not depend on torch's RNG,
the device or the thread count. The order is fixed:

1. draw the logical values from the distribution (or take the payload);
2. apply the target's domain rules (in float64, all arguments at once);
3. round to the argument's dtype;
4. inject special values at flat logical positions (row-major), from the dtype's
   own table: ``max``, ``tiny`` (smallest normal), ``subnormal`` (smallest
   subnormal) differ per dtype, and fp8 e4m3fn has no ``inf``;
5. lay the values out in memory: permuted (physically transposed, viewed back),
   strided (a view with steps), offset (a storage offset), expanded (stride 0).
   Storage that the view does not cover is filled with NaN (0 for integer
   dtypes), so a kernel that reads outside the view's elements shows it;
6. move to the device.

The storage budget (``check_storage``): before anything is allocated, each argument's
storage is computed from its shape and layout, and refused when its layout spans more
than the contract admits (``STEP_ROOM`` per dim times the argument's largest size under
the contract, plus ``OFFSET_ROOM`` elements; ``Target.validate`` checks this on every
case) or, for a case read from outside, when the whole case would take more than
``kfuzz.limits.max_case_bytes()``.

Refuses (CaseError): payload tensors of the wrong shape or dtype, layouts and payloads
over the storage budget.
"""
from __future__ import annotations

import base64
import binascii
import json
import math
import zlib
from typing import TYPE_CHECKING, Mapping

import numpy as np
import torch

from kfuzz.case import ArgCase, Case, Dist, Layout
from kfuzz.errors import CaseError
from kfuzz.limits import CASE_BYTES_ENV, describe

if TYPE_CHECKING:
    from kfuzz.target import Target

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


# 1. drawing ------------------------------------------------------------------------------

def rng_for(seed: int, arg: str) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed & 0xFFFFFFFFFFFF, zlib.crc32(arg.encode())]))


def draw(dist: Dist, shape: tuple[int, ...], dtype: str, rng: np.random.Generator) -> np.ndarray:
    kind = dist.kind
    if kind == "normal":
        return rng.standard_normal(shape)
    if kind == "uniform01":
        return rng.random(shape)
    if kind == "scaled":
        return rng.standard_normal(shape) * dist.param("factor")
    if kind == "shifted":
        return rng.standard_normal(shape) + dist.param("shift")
    if kind == "ones":
        return np.ones(shape)
    if kind == "binary01":
        return rng.integers(0, 2, shape).astype(np.float64)
    if kind == "smallint":
        return rng.integers(-4, 5, shape).astype(np.float64)
    if kind == "heavytailed":
        return rng.standard_cauchy(shape)
    table = special_value_table(dtype)
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    if kind == "nearmax":
        return sign * table["max"] * rng.uniform(0.5, 1.0, shape)
    if kind == "subnormal":
        # integer multiples of the smallest subnormal, below the smallest normal
        steps = max(1.0, table["tiny"] / table["subnormal"]) if table["subnormal"] else 1.0
        sub = table["subnormal"] or 0.0
        return sign * sub * rng.integers(1, int(steps), shape, endpoint=False).astype(np.float64)
    raise CaseError(f"unknown distribution {kind!r}")


def decode_payload(entry: Mapping, name: str) -> torch.Tensor:
    try:
        dt = torch_dtype(entry["dtype"])
        shape = tuple(int(s) for s in entry["shape"])
        if len(entry["data"]) != payload_chars(math.prod(shape) * dt.itemsize):
            raise ValueError(f"{len(entry['data'])} base64 characters for {list(shape)} {entry['dtype']}")
        raw = base64.b64decode(entry["data"], validate=True)
        t = torch.frombuffer(bytearray(raw), dtype=dt) if raw else torch.empty(0, dtype=dt)
        return t.reshape(shape).clone()
    except (KeyError, ValueError, RuntimeError, TypeError, binascii.Error) as e:
        raise CaseError(f"payload for argument {name!r} is malformed ({e})") from None


def payload_chars(nbytes: int) -> int:
    """The length of the base64 text of ``nbytes`` bytes."""
    return 4 * -(-nbytes // 3)


def encode_payload(t: torch.Tensor) -> dict:
    """The payload entry for one tensor: dtype, logical shape and its row-major bytes."""
    t = t.detach().contiguous().cpu()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(raw).decode()}


# 4. injection and 5. layout ----------------------------------------------------------------

def inject(t: torch.Tensor, argcase: ArgCase, dtype: str) -> torch.Tensor:
    if not argcase.inject:
        return t
    table = special_value_table(dtype)
    flat = t.reshape(-1)
    for pos, value in argcase.inject:
        v = table[value] if isinstance(value, str) else value
        flat[pos] = torch.tensor(v, dtype=torch.float64).to(t.dtype)
    return flat.reshape(t.shape)


def _filler(dt: torch.dtype) -> float:
    return math.nan if dt.is_floating_point else 0


def lay_out(values: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A tensor equal to ``values`` (logically) with the given memory layout."""
    shape, dt = tuple(values.shape), values.dtype
    if layout.kind == "contiguous":
        return values.contiguous()
    if layout.kind == "permuted":
        inv = [layout.perm.index(i) for i in range(len(shape))]
        physical = values.permute(*layout.perm).contiguous()
        return physical.permute(*inv)
    if layout.kind == "strided":
        big = torch.full([n * s for n, s in zip(shape, layout.step)], _filler(dt), dtype=dt)
        view = big[tuple(slice(None, None, s) for s in layout.step)]
        view.copy_(values)
        return view
    if layout.kind == "offset":
        storage = torch.full((layout.offset + values.numel(),), _filler(dt), dtype=dt)
        view = storage[layout.offset:].view(shape)
        view.copy_(values)
        return view
    if layout.kind == "expanded":
        index = tuple(slice(0, 1) if d in layout.dims else slice(None) for d in range(len(shape)))
        return values[index].contiguous().expand(*shape)
    raise CaseError(f"unknown layout {layout.kind!r}")


def _expanded_positions(argcase: ArgCase, shape: tuple[int, ...]) -> ArgCase:
    """Move injections onto index 0 of expanded dims, where the one stored copy lives."""
    if argcase.layout.kind != "expanded" or not argcase.inject:
        return argcase
    moved = []
    for pos, value in argcase.inject:
        idx = list(np.unravel_index(pos, shape))
        for d in argcase.layout.dims:
            idx[d] = 0
        moved.append((int(np.ravel_multi_index(idx, shape)), value))
    return ArgCase(argcase.layout, argcase.dist, tuple(moved))


# the storage budget ----------------------------------------------------------------------------

STEP_ROOM = 4        # per dim, how far a layout may spread an argument beyond its size (kfuzz draws steps <= 3)
OFFSET_ROOM = 4096   # storage elements a layout may add besides (kfuzz draws offsets <= 17)


def _largest_size(target: "Target", name: str) -> int:
    """Argument ``name``'s element count with every dim at the contract's largest size."""
    return target.numel(name, {d: spec.hi for d, spec in target.dims.items()})


def check_storage(case: Case, target: "Target", cap: int | None = None) -> int:
    """The bytes materializing ``case`` takes, computed from shapes and layouts before
    anything is allocated: each argument's storage in its dtype and its logical values
    (drawn in float64; a payload's in its dtype). CaseError if an argument's layout spans
    more storage than the contract admits, a payload entry disagrees with the contract, or
    the total is over ``cap`` (what is read from outside is held to ``max_case_bytes()``).
    Needs the checks of ``Target.validate`` before it (dims in the contract, layouts of the
    right rank); ``Target.validate`` calls it without a cap."""
    where = f"case for target {target.name!r}"
    dims, payload, total = case.dim, case.payload_dict or {}, 0
    for name in target.args:
        shape = target.shape_of(target.args[name].shape, dims)
        dtype = target.arg_dtype(name, case.dtype)
        itemsize = torch_dtype(dtype).itemsize
        layout = case.arg(name).layout
        span, numel = layout.span(shape), math.prod(shape)
        room = _largest_size(target, name) * STEP_ROOM ** len(shape) + OFFSET_ROOM
        if span > room:
            raise CaseError(f"{where}: argument {name!r} with layout {json.dumps(layout.to_json())} spans {span} storage "
                            f"elements; its contract admits at most {room}")
        if name in payload:
            entry = payload[name]
            if entry["dtype"] != dtype or tuple(entry["shape"]) != shape:
                raise CaseError(f"{where}: payload for {name!r} is {list(entry['shape'])} {entry['dtype']}, "
                                f"the contract wants {list(shape)} {dtype}")
            if len(entry["data"]) != payload_chars(numel * itemsize):
                raise CaseError(f"{where}: payload for {name!r} holds {len(entry['data'])} base64 characters, "
                                f"{list(shape)} {dtype} takes {payload_chars(numel * itemsize)}")
        total += span * itemsize + numel * (itemsize if name in payload else 8)
    if cap is not None and total > cap:
        raise CaseError(f"{where}: materializing it takes {describe(total)}, over the cap of {describe(cap)} "
                        f"(set {CASE_BYTES_ENV} to raise it)")
    return total


# the whole path --------------------------------------------------------------------------------

def logical_values(case: Case, target: "Target") -> dict[str, torch.Tensor]:
    """Steps 1-4: each argument's logical values in its dtype, on the CPU."""
    dims = case.dim
    payload = case.payload_dict or {}
    drawn: dict[str, torch.Tensor] = {}
    for name, arg in target.args.items():
        shape = target.shape_of(arg.shape, dims)
        dtype = target.arg_dtype(name, case.dtype)
        if name in payload:
            continue
        values = draw(case.arg(name).dist, shape, dtype, rng_for(case.seed, name))
        drawn[name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
    if target.domain is not None and drawn:
        drawn = {**drawn, **target.domain(dict(drawn), dims)}
    out: dict[str, torch.Tensor] = {}
    for name, arg in target.args.items():
        shape = target.shape_of(arg.shape, dims)
        dtype = target.arg_dtype(name, case.dtype)
        if name in payload:
            t = decode_payload(payload[name], name)
            if tuple(t.shape) != shape or t.dtype != torch_dtype(dtype):
                raise CaseError(f"payload for {name!r} is {list(t.shape)} {t.dtype}, "
                                f"the contract wants {list(shape)} {dtype}")
        else:
            t = drawn[name].to(torch_dtype(dtype))
        argcase = _expanded_positions(case.arg(name), shape)
        out[name] = inject(t, argcase, dtype)
    return out


def materialize(case: Case, target: "Target", device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The kernel's arguments for ``case``: deterministic values, layouts, on ``device``."""
    target.validate(case)
    tensors = {}
    for name, values in logical_values(case, target).items():
        laid = lay_out(values, case.arg(name).layout)
        tensors[name] = laid if str(device) == "cpu" else _to_device(laid, device)
    return tensors


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Move keeping the layout: copy the whole storage, then take the same view."""
    storage = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (t.untyped_storage().nbytes() // t.element_size(),))
    moved = storage.to(device)
    return moved.as_strided(t.shape, t.stride(), t.storage_offset())
