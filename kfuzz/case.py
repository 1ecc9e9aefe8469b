"""The case: kfuzz's unit of input.

A case *describes* the inputs of one kernel call (target, dtype, seed, sizes of
the symbolic dimensions, and per argument a layout, a value distribution and
special values injected at flat positions); it does not hold them, except for
an imported failure, whose tensors travel as an explicit ``payload``.
Materializing a case (``kfuzz.tensors``) is deterministic.

On disk a case is canonical JSON (sorted keys, schema version ``kfuzz: 1``)
compressed with zstd (``.case.zst``). A file may also carry a ``record`` (the
verdict it was saved with, what replay expects of it, versions, time); the
record is not part of the case and does not enter its hash.

A case file may come from outside (a pull request, a bug report), so decoding
is bounded before anything is allocated: the zstd stream is decompressed only up
to ``kfuzz.limits.max_case_file_bytes()`` and its JSON may hold at most
``kfuzz.limits.MAX_JSON_VALUES`` values.

This module refuses: unknown schema versions, unknown keys, unknown layouts,
distributions and special-value names, a number that is not an integer where
one belongs (``1e9`` for an offset), a payload entry that is not a dtype, a shape
and a base64 string, and a file over those caps. Checks that need the target's
contract (dims, dtypes, argument names, the storage a case takes) live in
``Target.validate``.
"""
from __future__ import annotations

import hashlib
import json
import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import zstandard

from kfuzz.errors import CaseError
from kfuzz.limits import CASE_FILE_ENV, MAX_JSON_VALUES, describe, max_case_file_bytes

SCHEMA = 1

LAYOUTS = ("contiguous", "permuted", "strided", "offset", "expanded")
DISTRIBUTIONS = (
    "normal", "uniform01", "scaled", "shifted", "ones", "binary01",
    "smallint", "heavytailed", "nearmax", "subnormal",
)
# parameters a distribution takes, with their defaults
DIST_PARAMS = {"scaled": {"factor": 100.0}, "shifted": {"shift": 5.0}}
SPECIAL_VALUES = ("nan", "inf", "-inf", "-0", "max", "-max", "tiny", "subnormal")


def _integer(value: Any, what: str) -> int:
    """``value`` as an int; CaseError if it is not an integer (a float, a bool, a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise CaseError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
    return int(value)


def _integers(values: Any, what: str) -> tuple[int, ...] | None:
    if values is None:
        return None
    if not isinstance(values, (list, tuple)):
        raise CaseError(f"{what} must be a list of integers, got {values!r}")
    return tuple(_integer(v, f"{what} entry") for v in values)


def _freeze(x: Any) -> Any:
    if isinstance(x, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return x


@dataclass(frozen=True, slots=True)
class Layout:
    """How an argument sits in memory; its logical shape and values never change."""

    kind: str = "contiguous"
    perm: tuple[int, ...] | None = None   # permuted: physical order of the logical dims
    step: tuple[int, ...] | None = None   # strided: step per logical dim
    offset: int = 0                        # offset: storage elements before the data
    dims: tuple[int, ...] | None = None   # expanded: logical dims held at stride 0

    def __post_init__(self):
        if not isinstance(self.kind, str) or self.kind not in LAYOUTS:
            raise CaseError(f"unknown layout {self.kind!r} (known: {', '.join(LAYOUTS)})")
        for name in ("perm", "step", "dims"):
            object.__setattr__(self, name, _integers(getattr(self, name), f"layout {self.kind!r}: {name}"))
        object.__setattr__(self, "offset", _integer(self.offset, f"layout {self.kind!r}: offset"))
        needs = {"permuted": "perm", "strided": "step", "expanded": "dims"}.get(self.kind)
        if needs and getattr(self, needs) is None:
            raise CaseError(f"layout {self.kind!r} needs {needs!r}")
        if self.kind == "offset" and self.offset < 1:
            raise CaseError("layout 'offset' needs offset >= 1")
        if self.step is not None and any(s < 1 for s in self.step):
            raise CaseError(f"layout 'strided' needs steps >= 1, got {list(self.step)}")

    def check_rank(self, rank: int, where: str) -> None:
        if self.perm is not None and sorted(self.perm) != list(range(rank)):
            raise CaseError(f"{where}: perm {list(self.perm)} is not a permutation of {rank} dims")
        if self.step is not None and len(self.step) != rank:
            raise CaseError(f"{where}: step has {len(self.step)} entries for {rank} dims")
        if self.dims is not None and any(not 0 <= d < rank for d in self.dims):
            raise CaseError(f"{where}: expanded dims {list(self.dims)} out of range for {rank} dims")

    def span(self, shape: tuple[int, ...]) -> int:
        """How many storage elements the layout holds for a tensor of ``shape``, at most (what
        ``kfuzz.tensors.lay_out`` allocates or keeps), in Python ints. Needs ``check_rank``."""
        if self.kind == "strided":
            return math.prod(n * s for n, s in zip(shape, self.step))
        if self.kind == "offset":
            return self.offset + math.prod(shape)
        return math.prod(shape)

    def to_json(self) -> dict:
        d: dict = {"kind": self.kind}
        if self.perm is not None:
            d["perm"] = list(self.perm)
        if self.step is not None:
            d["step"] = list(self.step)
        if self.kind == "offset":
            d["offset"] = self.offset
        if self.dims is not None:
            d["dims"] = list(self.dims)
        return d

    @classmethod
    def from_json(cls, d: Any) -> "Layout":
        if isinstance(d, str):
            d = {"kind": d}
        if not isinstance(d, Mapping) or "kind" not in d:
            raise CaseError(f"layout must be an object with 'kind', got {d!r}")
        unknown = set(d) - {"kind", "perm", "step", "offset", "dims"}
        if unknown:
            raise CaseError(f"layout has unknown keys {sorted(unknown)}")
        return cls(kind=d["kind"], perm=d.get("perm"), step=d.get("step"), offset=d.get("offset", 0),
                   dims=d.get("dims"))


@dataclass(frozen=True, slots=True)
class Dist:
    """A value distribution; ``params`` holds the distribution's numbers (sorted pairs)."""

    kind: str = "normal"
    params: tuple[tuple[str, float], ...] = ()

    def __post_init__(self):
        if not isinstance(self.kind, str) or self.kind not in DISTRIBUTIONS:
            raise CaseError(f"unknown distribution {self.kind!r} (known: {', '.join(DISTRIBUTIONS)})")
        allowed = DIST_PARAMS.get(self.kind, {})
        for k, v in self.params:
            if k not in allowed:
                raise CaseError(f"distribution {self.kind!r} takes no parameter {k!r}")
            if not math.isfinite(v):
                raise CaseError(f"distribution parameter {k}={v} is not finite")

    def param(self, name: str) -> float:
        return dict(self.params).get(name, DIST_PARAMS[self.kind][name])

    def to_json(self) -> Any:
        if not self.params:
            return self.kind
        return {"kind": self.kind, **dict(self.params)}

    @classmethod
    def from_json(cls, d: Any) -> "Dist":
        if isinstance(d, str):
            return cls(d)
        if not isinstance(d, Mapping) or "kind" not in d:
            raise CaseError(f"dist must be a name or an object with 'kind', got {d!r}")
        params = []
        for k, v in d.items():
            if k != "kind":
                if isinstance(v, bool) or not isinstance(v, numbers.Real):
                    raise CaseError(f"distribution parameter {k!r} must be a number, got {v!r}")
                params.append((k, float(v)))
        return cls(d["kind"], tuple(sorted(params)))


def _check_special(value: Any) -> Any:
    if isinstance(value, str):
        if value not in SPECIAL_VALUES:
            raise CaseError(f"unknown special value {value!r} (known: {', '.join(SPECIAL_VALUES)}, or a number)")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CaseError(f"special value must be a name or a number, got {value!r}")
    if not math.isfinite(value):
        raise CaseError(f"special value {value!r} is not finite (name it: {', '.join(SPECIAL_VALUES)})")
    return float(value)


@dataclass(frozen=True, slots=True)
class ArgCase:
    """What a case says about one tensor argument."""

    layout: Layout = Layout()
    dist: Dist = Dist()
    inject: tuple[tuple[int, Any], ...] = ()   # (flat logical position, special value)

    def __post_init__(self):
        for pos, value in self.inject:
            if isinstance(pos, bool) or not isinstance(pos, int) or pos < 0:
                raise CaseError(f"injection position must be an int >= 0, got {pos!r}")
            _check_special(value)

    @property
    def is_default(self) -> bool:
        return self == ArgCase()

    def to_json(self) -> dict:
        return {"layout": self.layout.to_json(), "dist": self.dist.to_json(),
                "inject": [[p, v] for p, v in self.inject]}

    @classmethod
    def from_json(cls, d: Any) -> "ArgCase":
        if not isinstance(d, Mapping):
            raise CaseError(f"argument entry must be an object, got {d!r}")
        unknown = set(d) - {"layout", "dist", "inject"}
        if unknown:
            raise CaseError(f"argument entry has unknown keys {sorted(unknown)}")
        inject = []
        if not isinstance(d.get("inject", []), (list, tuple)):
            raise CaseError(f"injections must be a list of [position, value], got {d['inject']!r}")
        for item in d.get("inject", []):
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise CaseError(f"injection must be [position, value], got {item!r}")
            inject.append((item[0], _check_special(item[1])))
        return cls(layout=Layout.from_json(d.get("layout", {"kind": "contiguous"})),
                   dist=Dist.from_json(d.get("dist", "normal")), inject=tuple(inject))


@dataclass(frozen=True, slots=True)
class Case:
    """One kernel call's inputs, described. Frozen and hashable; see the module docstring."""

    target: str
    dtype: str
    seed: int
    dims: tuple[tuple[str, int], ...]
    args: tuple[tuple[str, ArgCase], ...] = ()
    payload: Any = field(default=None, compare=True)   # frozen mapping for imported failures

    @classmethod
    def make(cls, target: str, dtype: str, seed: int, dims: Mapping[str, int],
             args: Mapping[str, ArgCase] | None = None, payload: Mapping | None = None) -> "Case":
        args = {k: v for k, v in (args or {}).items() if not v.is_default}
        return cls(target=target, dtype=dtype, seed=int(seed),
                   dims=tuple(sorted((k, int(v)) for k, v in dims.items())),
                   args=tuple(sorted(args.items())),
                   payload=_freeze(payload) if payload else None)

    # convenient views ------------------------------------------------------------
    @property
    def dim(self) -> dict[str, int]:
        return dict(self.dims)

    def arg(self, name: str) -> ArgCase:
        return dict(self.args).get(name, ArgCase())

    @property
    def payload_dict(self) -> dict | None:
        if self.payload is None:
            return None
        return {k: dict(v) for k, v in self.payload}

    def with_(self, **changes) -> "Case":
        """A new case with some fields replaced (dims/args may be given as mappings)."""
        if "dims" in changes and isinstance(changes["dims"], Mapping):
            changes["dims"] = tuple(sorted((k, int(v)) for k, v in changes["dims"].items()))
        if "args" in changes and isinstance(changes["args"], Mapping):
            changes["args"] = tuple(sorted((k, v) for k, v in changes["args"].items() if not v.is_default))
        return replace(self, **changes)

    def with_arg(self, name: str, argcase: ArgCase) -> "Case":
        args = dict(self.args)
        args[name] = argcase
        return self.with_(args=args)

    # canonical JSON and hashing -------------------------------------------------------
    def to_json(self) -> dict:
        return {"kfuzz": SCHEMA, "target": self.target, "dtype": self.dtype, "seed": self.seed,
                "dims": dict(self.dims), "args": {k: v.to_json() for k, v in self.args},
                "payload": self.payload_dict}

    def canonical(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()[:16]

    @classmethod
    def from_json(cls, d: Any) -> "Case":
        if not isinstance(d, Mapping):
            raise CaseError("a case must be a JSON object")
        if d.get("kfuzz") != SCHEMA:
            raise CaseError(f"unsupported case schema {d.get('kfuzz')!r} (this kfuzz reads {SCHEMA})")
        unknown = set(d) - {"kfuzz", "target", "dtype", "seed", "dims", "args", "payload", "record"}
        if unknown:
            raise CaseError(f"case has unknown keys {sorted(unknown)}")
        for key, typ in (("target", str), ("dtype", str), ("seed", int), ("dims", Mapping)):
            if not isinstance(d.get(key), typ) or isinstance(d.get(key), bool):
                raise CaseError(f"case field {key!r} is missing or not a {typ.__name__}")
        for name, size in d["dims"].items():
            if not isinstance(size, int) or isinstance(size, bool):
                raise CaseError(f"dim {name!r} must be an integer, got {size!r}")
        args = d.get("args") or {}
        if not isinstance(args, Mapping):
            raise CaseError("case field 'args' must be an object")
        return cls.make(d["target"], d["dtype"], d["seed"], d["dims"],
                        {k: ArgCase.from_json(v) for k, v in args.items()}, _check_payload(d.get("payload")))


def payload_chars(nbytes: int) -> int:
    """The length of the base64 text of ``nbytes`` bytes."""
    return 4 * -(-nbytes // 3)


def _check_payload(payload: Any) -> Any:
    """A payload as a case file holds it: argument name -> {dtype, shape, data (base64)}.
    Whether each entry fits the contract is ``kfuzz.target.check_storage``'s question."""
    if payload is None:
        return None
    if not isinstance(payload, Mapping):
        raise CaseError(f"case field 'payload' must be an object, got {type(payload).__name__}")
    for name, entry in payload.items():
        if not isinstance(entry, Mapping) or set(entry) != {"dtype", "shape", "data"}:
            raise CaseError(f"payload for argument {name!r} must be an object with dtype, shape and data")
        if not isinstance(entry["dtype"], str) or not isinstance(entry["data"], str):
            raise CaseError(f"payload for argument {name!r}: dtype and data must be strings")
        for n in _integers(entry["shape"], f"payload for argument {name!r}: shape"):
            if n < 0:
                raise CaseError(f"payload for argument {name!r}: negative size in shape {entry['shape']}")
    return payload


# the .case.zst codec ------------------------------------------------------------------

def encode(case: Case, record: Mapping | None = None) -> bytes:
    """Canonical JSON of the case (plus an optional record), zstd-compressed. CaseError if
    the JSON is larger than ``decode`` would read back."""
    doc = case.to_json()
    if record is not None:
        doc["record"] = record
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    cap = max_case_file_bytes()
    if len(text) > cap:
        raise CaseError(f"case for target {case.target!r} is {describe(len(text))} of JSON, over the "
                        f"{describe(cap)} a case file may hold (set {CASE_FILE_ENV} to raise it)")
    return zstandard.ZstdCompressor(level=10).compress(text)


def decompress(data: bytes, source: str = "<bytes>") -> bytes:
    """The one zstd frame in ``data``, decompressed in chunks and refused (CaseError naming
    ``source``) as soon as it passes ``max_case_file_bytes()``: a small file that claims or
    expands to gigabytes never gets them."""
    cap, size = max_case_file_bytes(), 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(data) as reader:
            while True:
                chunk = reader.read(min(1 << 20, cap + 1 - size))
                if not chunk:
                    break
                size += len(chunk)
                if size > cap:
                    raise CaseError(f"{source}: decompresses to more than {describe(cap)}, the most a "
                                    f"case file may hold (set {CASE_FILE_ENV} to raise it)")
        # within the cap: decode again in one piece, which tells a whole frame from a cut one
        whole = zstandard.ZstdDecompressor().decompressobj()
        text = whole.decompress(data)
    except zstandard.ZstdError as e:
        raise CaseError(f"{source}: not a valid zstd stream ({e})") from None
    if not whole.eof:
        raise CaseError(f"{source}: not a valid zstd stream (the frame is cut short)")
    if whole.unused_data:
        raise CaseError(f"{source}: not a valid zstd stream ({len(whole.unused_data)} bytes after the frame)")
    return text


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def decode(data: bytes, source: str = "<bytes>") -> tuple[Case, dict | None]:
    """The case and its record (or None) from ``.case.zst`` bytes; CaseError names ``source``."""
    text = decompress(data, source)
    values = sum(text.count(c) for c in (b",", b":", b"[", b"{"))
    if values > MAX_JSON_VALUES:
        raise CaseError(f"{source}: holds about {values} JSON values, more than the {MAX_JSON_VALUES} "
                        f"a case file may hold")
    try:
        doc = json.loads(text, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CaseError(f"{source}: not valid case JSON ({type(e).__name__}: {e})") from None
    try:
        case = Case.from_json(doc)
    except CaseError as e:
        raise CaseError(f"{source}: {e}") from None
    record = doc.get("record")
    return case, (record if isinstance(record, dict) else None)
