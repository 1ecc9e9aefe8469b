"""Targets: a kernel, its float64 oracle and its input contract, registered by name.

A target names its tensor arguments with symbolic shapes, the dtypes and layouts
it admits, the domain rules its inputs obey, the kernel, the reference math
(run on float64-upcast inputs it is the oracle; run at the kernel's own
precision it is the trusted implementation that scales the error bound, unless
the target names another ``trusted``), and the outputs to compare.

Targets register through one decorator, ``@target``; kfuzz finds them by
importing the modules named in the entry-point group ``kfuzz.targets``, so
kfuzz's own ``harnesses/`` are written exactly as a user's package would be.
The group ``kfuzz.fixtures`` names the test suite's targets (sandbox escapes,
reward hacks, the gates' positive controls); it is imported only when the
environment sets ``KFUZZ_FIXTURES=1``.

A target module that fails to import is that module's error, not every
target's: its targets are absent, ``broken_modules()`` names it with its
exception, and every other target still loads.

Refuses: duplicate names, unknown names (``TargetError``), and cases that break
the contract (``CaseError`` from ``Target.validate``).
"""
from __future__ import annotations

import importlib
import json
import math
import os
import sys
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Callable, Mapping, Sequence

from kfuzz.case import Case, payload_chars
from kfuzz.dtypes import DTYPES, special_value_table, torch_dtype
from kfuzz.errors import CaseError, TargetError
from kfuzz.interpreter import exact_bf16, scalar_index, share_language_patch, skip_dead_overflow_checks
from kfuzz.limits import CASE_BYTES_ENV, describe

ALL_LAYOUTS = ("contiguous", "permuted", "strided", "offset", "expanded")
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Dim:
    """A symbolic dimension and the sizes the contract admits.

    ``cpu_hi`` caps the sizes that searches draw when Triton kernels run under the
    interpreter (no GPU), where large sizes cost minutes; the contract is unchanged."""

    lo: int = 1
    hi: int = 256
    multiple_of: int = 1   # a contract may require, e.g., a size that is a multiple of 8
    cpu_hi: int | None = None

    def admits(self, n: int) -> bool:
        return self.lo <= n <= self.hi and n % self.multiple_of == 0

    @property
    def search_hi(self) -> int:
        if self.cpu_hi is not None and os.environ.get("TRITON_INTERPRET") == "1":
            return max(self.lo, min(self.hi, self.cpu_hi))
        return self.hi


def size_of(sym: str | int, dims: Mapping[str, int]) -> int:
    """A symbolic size: an int, a dim name, or ``NAME+k`` (e.g. ``N+1`` offsets of N sequences)."""
    if isinstance(sym, int):
        return sym
    name, _, k = sym.partition("+")
    return dims[name] + (int(k) if k else 0)


def dim_names(shape: Sequence[str | int]) -> list[str]:
    return [d.partition("+")[0] for d in shape if isinstance(d, str)]


@dataclass(frozen=True)
class Arg:
    """A tensor argument: symbolic shape, and its dtype ('case' = the case's dtype).

    ``specials=False``: the argument's values are structural (offsets, indices, lengths) and
    come only through the target's domain; no special value is injected into it, and a case
    that injects one is refused (the kernel may rightly refuse such values itself)."""

    shape: tuple[str | int, ...]
    dtype: str = "case"
    layouts: tuple[str, ...] = ALL_LAYOUTS
    differentiable: bool = True
    specials: bool = True


@dataclass(frozen=True)
class Output:
    shape: tuple[str | int, ...]
    dtype: str = "case"


@dataclass
class Target:
    name: str
    kernel: Callable
    reference: Callable                 # the math; float64 inputs -> oracle
    args: Mapping[str, Arg]
    outputs: Mapping[str, Output]
    dims: Mapping[str, Dim]
    dtypes: tuple[str, ...] = FLOAT_DTYPES
    domain: Callable | None = None      # (dict of float64 tensors, dims) -> dict, before injection
    trusted: Callable | None = None     # same-precision implementation; default: reference in fp32
    constraint: Callable | None = None  # dims -> error message or None (cross-dim rules)
    planted_bug: str | None = None      # a positive control: the bug this kernel carries
    bound_scale: float = 1.0            # calibrated multiplier on compare.BOUND_C for this target
    # other honest realizations of the trusted implementation's roundings it gives, as
    # trusted(**inputs, variant=i) for i < trusted_variants (e.g. stochastic rounding of its
    # low-precision operands): where the bound fails, a kernel no farther from the oracle than
    # the farthest of them passes (kfuzz.execute.varied_trusted)
    trusted_variants: int = 0
    description: str = ""
    options: Mapping = field(default_factory=dict)   # free-form, for engines and gates

    # shapes -----------------------------------------------------------------------
    def shape_of(self, symbolic: Sequence[str | int], dims: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(size_of(d, dims) for d in symbolic)

    def special_names(self, name: str, dtype: str) -> list[str]:
        """The special values an injection may put into argument ``name`` in a case of ``dtype``:
        those its dtype has; none for a structural argument (``Arg.specials``)."""
        if not self.args[name].specials:
            return []
        return [n for n, v in special_value_table(self.arg_dtype(name, dtype)).items() if v is not None]

    def numel(self, name: str, dims: Mapping[str, int]) -> int:
        """How many elements argument ``name`` has at ``dims``."""
        size = 1
        for n in self.shape_of(self.args[name].shape, dims):
            size *= n
        return size

    def keep_chance(self, dims: Mapping[str, int]) -> float:
        """The chance that the random engine keeps a case drawn at ``dims``: the target's
        ``options["keep"]`` of them (``dims -> (0, 1]``), else 1. A target whose oracle's work
        grows with its dims declares it, so that its costliest draws, which would take most of
        a campaign's judging time although few, are drawn the less often the more they cost."""
        keep = self.options.get("keep") if self.options else None
        return 1.0 if keep is None else float(keep(dims))

    def arg_dtype(self, name: str, case_dtype: str) -> str:
        d = self.args[name].dtype
        return case_dtype if d == "case" else d

    def output_dtype(self, name: str, case_dtype: str) -> str:
        d = self.outputs[name].dtype
        return case_dtype if d == "case" else d

    def call_trusted(self, inputs: Mapping, variant: int | None = None):
        """The trusted implementation; by default the reference math with fp32 totals
        (low-precision inputs upcast to float32), as PyTorch's eager ops compute.  ``variant``:
        its variant i (``trusted_variants``)."""
        if variant is not None:
            if not 0 <= variant < self.trusted_variants:
                raise TargetError(f"target {self.name!r} has {self.trusted_variants} trusted variants; "
                                  f"there is no variant {variant}")
            return self.trusted(**inputs, variant=variant)
        if self.trusted is not None:
            return self.trusted(**inputs)
        wide = {k: v.float() if v.is_floating_point() and v.element_size() < 4 else v for k, v in inputs.items()}
        return self.reference(**wide)

    # the contract ---------------------------------------------------------------------
    def validate(self, case: Case) -> None:
        """Raise CaseError naming what in ``case`` breaks this target's contract, the storage
        its layouts and payload may take included (``check_storage``)."""
        where = f"case for target {self.name!r}"
        if case.target != self.name:
            raise CaseError(f"{where}: names target {case.target!r}")
        if case.dtype not in self.dtypes:
            raise CaseError(f"{where}: dtype {case.dtype!r} not admitted (admits {', '.join(self.dtypes)})")
        dims = case.dim
        if set(dims) != set(self.dims):
            raise CaseError(f"{where}: dims {sorted(dims)} but the contract has {sorted(self.dims)}")
        for name, n in dims.items():
            spec = self.dims[name]
            if not spec.admits(n):
                extra = f", a multiple of {spec.multiple_of}" if spec.multiple_of > 1 else ""
                raise CaseError(f"{where}: dim {name}={n} outside the contract [{spec.lo}, {spec.hi}]{extra}")
        if self.constraint is not None:
            msg = self.constraint(dims)
            if msg:
                raise CaseError(f"{where}: {msg}")
        for name, argcase in case.args:
            if name not in self.args:
                raise CaseError(f"{where}: unknown argument {name!r} (has {', '.join(self.args)})")
            arg = self.args[name]
            argcase.layout.check_rank(len(arg.shape), f"{where}, argument {name!r}")
            if argcase.layout.kind not in arg.layouts:
                raise CaseError(f"{where}: argument {name!r} does not admit layout {argcase.layout.kind!r}")
            numel = self.numel(name, dims)
            table = special_value_table(self.arg_dtype(name, case.dtype))
            if argcase.inject and not arg.specials:
                raise CaseError(f"{where}: argument {name!r} takes no injected values (its values come "
                                f"only through the target's domain)")
            for pos, value in argcase.inject:
                if pos >= numel:
                    raise CaseError(f"{where}: injection at {pos} outside argument {name!r} of {numel} elements")
                if isinstance(value, str) and table.get(value) is None:
                    raise CaseError(f"{where}: dtype {self.arg_dtype(name, case.dtype)} has no {value!r}")
        if case.payload is not None:
            unknown = set(case.payload_dict) - set(self.args)
            if unknown:
                raise CaseError(f"{where}: payload names unknown arguments {sorted(unknown)}")
        check_storage(case, self)


# the storage budget ----------------------------------------------------------------------------

STEP_ROOM = 4        # per dim, how far a layout may spread an argument beyond its size (kfuzz draws steps <= 3)
OFFSET_ROOM = 4096   # storage elements a layout may add besides (kfuzz draws offsets <= 17)


def _largest_size(target: Target, name: str) -> int:
    """Argument ``name``'s element count with every dim at the contract's largest size."""
    return target.numel(name, {d: spec.hi for d, spec in target.dims.items()})


def check_storage(case: Case, target: Target, cap: int | None = None) -> int:
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


# the registry ---------------------------------------------------------------------------
_REGISTRY: dict[str, Target] = {}
_LOADED = False


def target(name: str, *, reference: Callable, args: Mapping[str, Arg], outputs: Mapping[str, Output],
           dims: Mapping[str, Dim], **kw) -> Callable[[Callable], Callable]:
    """Register the decorated kernel as target ``name``; returns the kernel unchanged."""
    def register(kernel: Callable) -> Callable:
        add_target(Target(name=name, kernel=kernel, reference=reference, args=dict(args),
                          outputs=dict(outputs), dims=dict(dims), **kw))
        return kernel
    return register


def add_target(t: Target) -> Target:
    if t.name in _REGISTRY and _REGISTRY[t.name].kernel is not t.kernel:
        raise TargetError(f"target {t.name!r} registered twice")
    if t.trusted_variants and t.trusted is None:
        raise TargetError(f"target {t.name!r}: trusted_variants without a trusted implementation")
    for name, arg in t.args.items():
        missing = [d for d in dim_names(arg.shape) if d not in t.dims]
        if missing:
            raise TargetError(f"target {t.name!r}: argument {name!r} uses undeclared dims {missing}")
    for dt in t.dtypes:
        if dt not in DTYPES:
            raise TargetError(f"target {t.name!r}: unknown dtype {dt!r}")
    _REGISTRY[t.name] = t
    return t


def variant(base: str, name: str, kernel: Callable, planted_bug: str | None = None, **changes) -> Target:
    """Register ``kernel`` under ``name`` with the contract of the already registered ``base``."""
    b = _REGISTRY[base]
    fields = {f: getattr(b, f) for f in b.__dataclass_fields__}
    fields.update(name=name, kernel=kernel, planted_bug=planted_bug, **changes)
    return add_target(Target(**fields))


def prepare_triton(device: str | None = None) -> None:
    """Triton kernels run on CPU tensors only under the interpreter; it must be chosen before
    ``triton.jit`` decorates them, so before target modules are imported.  It is chosen for
    ``device`` ``cpu`` (also on a machine with a GPU) and, with no device named, where torch
    sees no GPU; an explicit ``TRITON_INTERPRET`` is kept.  Under the interpreter, nested jit
    calls share their launch's language patch, bf16 converts and multiplies as on a GPU, a
    scalar serves as an index under any NumPy, and no integer overflow check is built where
    nothing asserts it (`kfuzz.interpreter`)."""
    if device is not None:
        interpret = not str(device).startswith("cuda")
    else:
        try:
            import torch
            interpret = not torch.cuda.is_available()
        except ImportError:
            interpret = False
    if interpret:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        share_language_patch()
        exact_bf16()
        scalar_index()
        skip_dead_overflow_checks()


GROUP = "kfuzz.targets"
FIXTURE_GROUP = "kfuzz.fixtures"
FIXTURES_ENV = "KFUZZ_FIXTURES"
OPTIONAL_DEPENDENCIES = {"triton", "atheris"}   # a module that needs a missing one is simply absent


@dataclass(frozen=True)
class BrokenModule:
    """A target module that failed to import: its entry point, its module, the exception."""

    entry_point: str
    module: str
    error: str          # "ExceptionType: message"

    def __str__(self) -> str:
        return f"target module {self.module!r} (entry point {self.entry_point!r}) failed to import: {self.error}"


_BROKEN: dict[str, BrokenModule] = {}


def fixtures_enabled() -> bool:
    return os.environ.get(FIXTURES_ENV) == "1"


def target_entry_points() -> list:
    """The entry points whose modules register targets: ``kfuzz.targets``, and
    ``kfuzz.fixtures`` when ``KFUZZ_FIXTURES=1``."""
    groups = [GROUP] + ([FIXTURE_GROUP] if fixtures_enabled() else [])
    return [ep for g in groups for ep in entry_points(group=g)]


def _import_target_module(ep) -> None:
    module = ep.value.split(":")[0]
    before = set(_REGISTRY)
    try:
        importlib.import_module(module)
    except (Exception, SystemExit) as e:
        # a half-imported module registers nothing (target modules it imported itself stay)
        for name in set(_REGISTRY) - before:
            if getattr(_REGISTRY[name].kernel, "__module__", None) not in sys.modules:
                del _REGISTRY[name]
        if isinstance(e, ImportError) and getattr(e, "name", None) in OPTIONAL_DEPENDENCIES:
            return
        _BROKEN[module] = BrokenModule(ep.name, module, f"{type(e).__name__}: {e}")


def load_targets() -> dict[str, Target]:
    """Import every target module of the entry points (once); a module that fails is
    recorded in ``broken_modules()`` and the others load."""
    global _LOADED
    if not _LOADED:
        prepare_triton()
        seen = set()
        for ep in target_entry_points():
            if ep.value not in seen:
                seen.add(ep.value)
                _import_target_module(ep)
        _LOADED = True
    return dict(_REGISTRY)


def broken_modules() -> list[BrokenModule]:
    """The target modules that failed to import, in entry-point order."""
    load_targets()
    return list(_BROKEN.values())


# targets built on demand from their name: prefix -> module whose ``resolve(name)`` builds one
# (a sandboxed worker finds a KernelBench pair by its name, kb:<corpus file>:<row>)
RESOLVERS = {"kb:": "kfuzz.kernelbench"}


def get_target(name: str) -> Target:
    targets = load_targets()
    if name not in targets:
        for prefix, module in RESOLVERS.items():
            if name.startswith(prefix):
                return add_target(importlib.import_module(module).resolve(name))
        why = "".join(f"; {b}" for b in _BROKEN.values())
        if not fixtures_enabled() and any(True for _ in entry_points(group=FIXTURE_GROUP)):
            why += f"; the test suite's fixture targets load with {FIXTURES_ENV}=1"
        raise TargetError(f"unknown target {name!r} (known: {', '.join(sorted(targets)) or 'none'}){why}")
    return targets[name]


def load_target(name: str, module: str | None = None, resolve: dict | None = None) -> Target:
    """The target, importing only its own module when that registers it (a worker starts
    in a second instead of importing every harness), else through the entry points.
    ``resolve``: keyword arguments for the resolver of a name built on demand (``kb:``)."""
    prepare_triton()
    if resolve is not None:
        for prefix, resolver in RESOLVERS.items():
            if name.startswith(prefix):
                return importlib.import_module(resolver).resolve(name, **resolve)
    if module:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
        if name in _REGISTRY:
            return _REGISTRY[name]
    return get_target(name)
