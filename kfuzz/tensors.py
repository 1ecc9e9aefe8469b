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

The storage budget (``kfuzz.target.check_storage``): before anything is allocated, each
argument's storage is computed from its shape and layout, and refused when its layout spans
more than the contract admits (``Target.validate`` checks this on every case) or, for a case
read from outside, when the whole case would take more than ``kfuzz.limits.max_case_bytes()``.

The way back: ``case_from_tensors`` makes the case whose payload is given tensors, its dims
and dtype read off their shapes (``contract_of``), as an imported failure or a gate's
hidden-seed inputs are saved.

Refuses (CaseError): payload tensors of the wrong shape or dtype, layouts and payloads
over the storage budget, tensors that break the target's contract (``contract_of``).
"""
from __future__ import annotations

import base64
import binascii
import math
import zlib
from typing import Mapping, Sequence

import numpy as np
import torch

from kfuzz.case import ArgCase, Case, Dist, Layout, payload_chars
from kfuzz.dtypes import special_value_table, torch_dtype
from kfuzz.errors import CaseError
from kfuzz.limits import max_case_bytes
from kfuzz.target import Target, check_storage

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
        # integer multiples of the smallest subnormal, below the smallest normal; a dtype
        # without subnormals (an integer dtype) has only 0 below its smallest nonzero value
        sub = table["subnormal"]
        steps = int(table["tiny"] / sub) if sub else 1
        if steps <= 1:
            return np.zeros(shape)
        return sign * sub * rng.integers(1, steps, shape, endpoint=False).astype(np.float64)
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


def row_major(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s values with row-major strides.  (``contiguous()`` keeps the stride of
    a size-1 dim, and ``view`` to another element size refuses a last stride other than 1.)"""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t.detach())


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as uint8, in logical order (NaN payloads and -0 included)."""
    return row_major(t).reshape(-1).view(torch.uint8)


def encode_payload(t: torch.Tensor) -> dict:
    """The payload entry for one tensor: dtype, logical shape and its row-major bytes."""
    t = t.detach().cpu()
    raw = raw_bytes(t).numpy().tobytes() if t.numel() else b""
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


# the whole path --------------------------------------------------------------------------------

def logical_values(case: Case, target: Target) -> dict[str, torch.Tensor]:
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
        # asarray keeps a 0-d draw 0-d (ascontiguousarray makes every array at least 1-d)
        drawn[name] = torch.from_numpy(np.asarray(values, dtype=np.float64))
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


def materialize(case: Case, target: Target, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
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


# tensors back to a case -------------------------------------------------------------------

def contract_of(target: Target, tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
                source: str = "<tensors>") -> tuple[dict[str, torch.Tensor], dict[str, int], str]:
    """The tensors by argument name, the sizes of the target's dims and the case's dtype,
    read off the tensors' shapes and dtypes (meta tensors will do); CaseError naming
    ``source`` where they break the contract."""
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
    bare = Case.make(target.name, dtype, 0, dims)   # its storage bounds the payload's (drawn in float64)
    try:   # the dims and the storage cap, before any value is read or encoded
        target.validate(bare)
        check_storage(bare, target, max_case_bytes())
    except CaseError as e:
        raise CaseError(f"{source}: {e}") from None
    return tensors, dims, dtype


def case_from_tensors(target: Target, tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
                      source: str = "<tensors>") -> Case:
    """The case whose payload is ``tensors``, its dims and dtype read off their shapes."""
    tensors, dims, dtype = contract_of(target, tensors, source)
    case = Case.make(target.name, dtype, 0, dims,
                     payload={name: encode_payload(t) for name, t in tensors.items()})
    try:
        target.validate(case)
    except CaseError as e:
        raise CaseError(f"{source}: {e}") from None
    return case
