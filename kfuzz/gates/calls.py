"""The gates that need more than one call or a prepared memory: G08-G11, all tolerance-free.

- G08 determinism: the same inputs, several times and between other launches,
  give bitwise-equal outputs. On a target whose trusted implementation is its reference's
  own float32 code (``options["reference_limited"]``), calls that differ no more than ``c``
  times as far as the trusted implementation's own runs on the same inputs differ pass as
  reference-limited: the reference is not bitwise repeatable there either.
- G09 containment: inputs bitwise unchanged, guard regions before and after
  every input unchanged, no output sharing storage with an input, another
  output or an output of the call before (kfuzz's targets declare no aliasing;
  a kernel that returns one global buffer every call overwrites what its
  caller still holds).
- G10 complete writes: memory handed out during the call is poisoned (NaN) and
  must never show in the output; the kernel runs before any reference run.
  Cases at the nominal shape and at odd prime sizes, so that a kernel that
  skips a tail row or column (the last of an odd count, the rest past a
  block) leaves poison there.
- G11 input dependence: inputs whose oracle outputs differ give kernel outputs
  that differ, both for fresh tensors (called right after the first call's
  outputs are freed) and for new values written into the same buffers
  (catches constant outputs, caching by shape or by pointer, and returning
  freed memory that still holds an earlier result). Some cases' new inputs
  differ from the first everywhere but one element (the first, a middle or
  the last of every float argument), which catches a result cached by the
  shape and that one element.

G09 and G11 also run at the sizes a target is used at outside kfuzz where it names
them (``options["own_dims"]``: a KernelBench reference's size constants), where a
kernel may keep one buffer for the size its own test runs.

Guard regions surround kernel inputs only: outputs are the kernel's own
allocations, so nothing can be placed around them.
"""
from __future__ import annotations

import math

import torch

from kfuzz.case import ArgCase
from kfuzz.compare import BOUND_C, largest
from kfuzz.dtypes import torch_dtype, widen_float8
from kfuzz.execute import oracle_outputs, storage_bytes, trusted_outputs
from kfuzz.executor import executor_for
from kfuzz.gates.base import Gate, fit_dims, float_args, gate_seed, inner_dims, make_case, nominal_dims
from kfuzz.programs import (Program, changed_input, malformed, outputs_of,
                            poisoned_allocations)  # noqa: F401  (poisoned_allocations: the gate's tool)
from kfuzz.tensors import logical_values, materialize, raw_bytes
from kfuzz.verdict import Verdict

REPEATS = 4           # G08: calls on the same inputs
GUARD_BYTES = 256     # G09: guard region on each side of every input
GUARD_FILL = 0xA5
ODD_SHAPES = ((67, 13), (131, 7))   # G10: (inner, other) sizes, primes past blocks of 64 and 128
KEPT = ("first", "middle", "last")  # G11: the one element new inputs share with the first ones


def _bits(t: torch.Tensor) -> torch.Tensor:
    return raw_bytes(t.cpu())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold bitwise the same values, compared where ``a`` is (two outputs of
    an oracle on a GPU are not copied to the host for it)."""
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(raw_bytes(a.detach()), raw_bytes(b.detach().to(a.device))))


def _first_bit_difference(a, b) -> int:
    size = a.element_size()
    diff = (_bits(a).reshape(-1, size) != _bits(b).reshape(-1, size)).any(dim=1)
    return int(diff.nonzero()[0])


def _per_dtype(gate, target, seed, dims, seeds=2):
    i = 0
    for dtype in target.dtypes:
        for _ in range(seeds):
            yield make_case(target, dtype, gate_seed(seed, gate.id, i), dims)
            i += 1


class Determinism(Gate):
    id, name = "G08", "determinism"
    property = "the same inputs, several times and between other launches, give bitwise-equal outputs"

    def cases(self, target, seed):
        return _per_dtype(self, target, seed, nominal_dims(target))

    def check(self, target, case, device="cpu", c=BOUND_C, executor=None):
        inputs = materialize(case, target)
        other = materialize(case.with_(seed=case.seed + 1), target)
        r = executor_for(target, device, executor).run(
            Program("repeat", case, {"case": inputs, "other": other}, {"repeats": REPEATS}))
        verdict = r.verdict or changed_input(target.name, inputs, r.outputs.get("after:case", {}))
        if verdict is not None:
            return verdict
        calls = [outputs_of(r, target, case, f"call{i + 1}") for i in range(REPEATS)]
        bad = next((v for v in calls if isinstance(v, Verdict)), None)
        if bad is not None:
            return bad
        first = calls[0]
        differing = [(i, name, out) for i, outputs in enumerate(calls[1:], start=2)
                     for name, out in outputs.items() if not _same_bits(out, first[name])]
        if not differing:
            return Verdict(target.name, "pass")
        i, name, out = differing[0]
        j = _first_bit_difference(out, first[name])
        own = _reference_spread(target, case, inputs, device) if target.options.get("reference_limited") else {}
        spread: dict[str, float] = {}     # the kernel's own, where the reference's is known
        if own:
            for _, k, o in differing:
                spread[k] = max(spread.get(k, 0.0), _largest_difference(o, first[k]))
        if own and all(0 < own.get(k, 0.0) and spread[k] <= c * own[k] for k in spread):
            return Verdict(target.name, "pass", detail=(
                f"reference-limited: calls on the same inputs differ (by at most {spread[name]:.3g} in '{name}'), "
                f"as the reference in float32 does on them (by at most {own[name]:.3g})"))
        also = (f"; the reference in float32 differs run to run too, by at most {own[name]:.3g}"
                if own.get(name) else "")
        return Verdict(target.name, "nondeterminism", output=name,
                       detail=(f"call {i} on the same inputs differs from call 1 at flat index {j}: "
                               f"{out.reshape(-1)[j].item()!r} vs {first[name].reshape(-1)[j].item()!r}{also}"))


def _largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference of two outputs of one shape (NaN at the same position
    in both: none; NaN or Inf in one only: infinite), computed where ``a`` is (the trusted
    implementation's runs on a GPU stay there), a chunk at a time (``compare.largest``)."""
    def difference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        same = (x == y) | (torch.isnan(x) & torch.isnan(y))
        return torch.where(same, 0.0, (x - y).abs().nan_to_num(nan=math.inf))
    return largest(a, b, difference)


def _reference_spread(target, case, inputs, device) -> dict[str, float]:
    """How far the trusted implementation's own outputs differ run to run on ``inputs``
    (``REPEATS`` runs on ``device``): the largest difference from its first run, per output. A
    reference that is not bitwise repeatable there (cuDNN's transposed convolution on a GPU)
    sets what a kernel calling the same layers can do (``options["reference_limited"]``)."""
    runs = [trusted_outputs(target, case, inputs, device) for _ in range(REPEATS)]
    return {k: max(_largest_difference(r[k], runs[0][k]) for r in runs[1:]) for k in runs[0]}


def _guarded(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A copy of ``t`` (same strides) inside a storage with guard bytes before and after."""
    data = storage_bytes(t)
    pad = GUARD_BYTES // t.element_size() * t.element_size()
    raw = torch.full((pad + data.numel() + pad,), GUARD_FILL, dtype=torch.uint8, device=t.device)
    raw[pad:pad + data.numel()] = data
    flat = raw.view(t.dtype)
    view = flat.as_strided(t.shape, t.stride(), t.storage_offset() + pad // t.element_size())
    return view, raw, pad


class Containment(Gate):
    id, name = "G09", "containment"
    property = ("inputs and guard regions around them bitwise unchanged; no output aliases an input, another "
                "output or the previous call's output")

    def cases(self, target, seed):
        shapes = [nominal_dims(target), fit_dims(target, {n: d.lo for n, d in target.dims.items()}),
                  own_dims(target)]
        shapes = [d for k, d in enumerate(shapes) if d is not None and d not in shapes[:k]]
        i = 0
        for dims in [s for s in shapes if s is not None]:
            for dtype in target.dtypes:
                yield make_case(target, dtype, gate_seed(seed, self.id, i), dims)
                i += 1

    def check(self, target, case, device="cpu", c=BOUND_C, executor=None):
        plain = materialize(case, target)
        guarded = {k: _guarded(v) for k, v in plain.items()}
        inputs = {k: g[0] for k, g in guarded.items()}
        r = executor_for(target, device, executor).run(Program("guarded", case, {"case": inputs}))
        if r.verdict is not None:
            return r.verdict
        after = r.outputs.get("after:case", {})
        for name, (_, raw, pad) in guarded.items():
            back = storage_bytes(after[name]).cpu() if name in after else None
            if back is None or back.numel() != raw.numel():
                return malformed(target.name, f"input {name!r} did not come back whole")
            changed = (back != raw).nonzero().reshape(-1)
            if changed.numel():
                pos = int(changed[0])
                where = ("the guard region before" if pos < pad else
                         "the guard region after" if pos >= raw.numel() - pad else "the storage of")
                return Verdict(target.name, "mutation", output=name,
                               detail=f"{where} input {name!r} changed ({changed.numel()} byte(s), first at byte {pos - pad:+d})")
        # spans are addresses in the kernel's process: what it reports is evidence, not checked here
        try:
            facts = r.facts
            spans = {f"input {k!r}": _pair(facts["inputs"][k]) for k in inputs}
            spans.update({f"output {k!r} of the previous call (a later call overwrites it)": _pair(v)
                          for k, v in facts["earlier"].items()})
            outputs = [(str(n), *_pair((lo, hi))) for n, lo, hi in facts["outputs"]]
        except (KeyError, TypeError, ValueError) as e:
            return malformed(target.name, f"the storage spans are malformed ({e!r})")
        for name, lo, hi in outputs:
            for other, (a, b) in spans.items():
                if lo < b and a < hi:
                    return Verdict(target.name, "contract", output=name,
                                   detail=f"output {name!r} shares storage with {other} (undeclared aliasing)")
            spans[f"output {name!r}"] = (lo, hi)
        return Verdict(target.name, "pass")


def own_dims(target) -> dict[str, int] | None:
    """The sizes the target is used at outside kfuzz (``options["own_dims"]``: a KernelBench
    reference's own size constants), where the contract admits them; None if it names none. A
    kernel that returns one cached buffer only at the size its own test runs is caught there."""
    own = target.options.get("own_dims")
    return fit_dims(target, dict(own)) if own else None


def _pair(span) -> tuple[int, int]:
    lo, hi = span
    if type(lo) is not int or type(hi) is not int:
        raise ValueError(f"{span!r} is not two addresses")
    return lo, hi


def odd_dims(target, inner: int, other: int) -> dict[str, int] | None:
    """Inner dims at ``inner``, others at ``other``, each moved to the largest odd size the contract
    admits at or below that (the search's CPU cap included)."""
    inner_names = inner_dims(target)
    wanted = {}
    for n, d in target.dims.items():
        k = min(inner if n in inner_names else other, d.search_hi)
        wanted[n] = k - 1 if k % 2 == 0 and d.admits(k - 1) else k
    return fit_dims(target, wanted)


class CompleteWrites(Gate):
    id, name = "G10", "complete writes"
    property = ("memory poisoned before the call never shows in the output, at the nominal shape and at odd "
                "prime sizes (tail rows and columns); the kernel runs before any reference run")

    def cases(self, target, seed):
        yield from _per_dtype(self, target, seed, nominal_dims(target))
        shapes = [d for d in (odd_dims(target, *s) for s in ODD_SHAPES) if d is not None]
        shapes = [d for k, d in enumerate(shapes) if d not in shapes[:k]]
        i = 0
        for dims in shapes:
            for dtype in target.dtypes:
                yield make_case(target, dtype, gate_seed(seed, self.id + "-odd", i), dims)
                i += 1

    def check(self, target, case, device="cpu", c=BOUND_C, executor=None):
        inputs = materialize(case, target)
        r = executor_for(target, device, executor).run(Program("poisoned", case, {"case": inputs}))
        if r.verdict is not None:
            return r.verdict
        outputs = outputs_of(r, target, case, "out")
        if isinstance(outputs, Verdict):
            return outputs
        oracle = oracle_outputs(target, inputs, device)     # only after the kernel returned
        for name, out in outputs.items():
            dt = torch_dtype(target.output_dtype(name, case.dtype))
            if not dt.is_floating_point:
                continue
            leaked = (torch.isnan(widen_float8(out.detach().cpu()))
                      & ~torch.isnan(widen_float8(oracle[name].cpu().to(dt))))
            if leaked.any():
                idx = int(leaked.reshape(-1).nonzero()[0])
                return Verdict(target.name, "stale", output=name,
                               detail=(f"poisoned memory (NaN) shows in output {name!r} at {int(leaked.sum())} of "
                                       f"{out.numel()} position(s), first at flat index {idx}; the oracle there is "
                                       f"{oracle[name].reshape(-1)[idx].item():.6g}"))
        return Verdict(target.name, "pass")


def kept_element(case) -> str:
    """Which element the partner inputs of a G11 case share with the case's own (for the detail)."""
    kept = {n: a.inject[0][0] for n, a in case.args if a.inject}
    if not kept:
        return ""
    return ", differing from the first everywhere but " + ", ".join(f"{n!r}[flat {p}]" for n, p in kept.items())


class InputDependence(Gate):
    id, name = "G11", "input dependence"
    property = ("inputs whose oracle outputs differ give kernel outputs that differ, for fresh tensors and for "
                "new values written into the same buffers, also when the new inputs share one element (the "
                "first, a middle or the last) with the first ones")

    def cases(self, target, seed):
        dims = nominal_dims(target)
        yield from _per_dtype(self, target, seed, dims)
        # the partner (seed + 1) keeps the case's injections: one element of every float argument,
        # set to the value the case draws there, is the same in both inputs and all else differs
        i = 0
        for dtype in target.dtypes:
            for where in KEPT:
                base = make_case(target, dtype, gate_seed(seed, self.id + "-kept", i), dims)
                values = logical_values(base, target)
                args = {}
                for n in float_args(target, dtype):
                    size = target.numel(n, dims)
                    pos = {"first": 0, "middle": size // 2, "last": size - 1}[where]
                    args[n] = ArgCase(inject=((pos, float(values[n].reshape(-1)[pos])),))
                yield make_case(target, dtype, base.seed, dims, args)
                i += 1
        own = own_dims(target)
        if own is not None and own != dims:
            for j, dtype in enumerate(target.dtypes):
                yield make_case(target, dtype, gate_seed(seed, self.id + "-own", j), own)

    def check(self, target, case, device="cpu", c=BOUND_C, executor=None):
        partner = case.with_(seed=case.seed + 1)
        inputs, fresh = materialize(case, target), materialize(partner, target)
        r = executor_for(target, device, executor).run(Program("rebind", case, {"case": inputs, "partner": fresh}))
        verdict = r.verdict or changed_input(target.name, fresh, r.outputs.get("after:partner", {}))
        if verdict is not None:
            return verdict
        sets = [outputs_of(r, target, case, role) for role in ("first", "second", "reused")]
        bad = next((v for v in sets if isinstance(v, Verdict)), None)
        if bad is not None:
            return bad
        first, second, reused = sets
        dts = {name: torch_dtype(target.output_dtype(name, case.dtype)) for name in first}
        # the first oracle's outputs kept rounded to the output dtypes, its float64 ones freed
        # before the second's are made: at a reference's own sizes two float64 sets may not fit
        oracle_a = {name: t.to(dts[name]) for name, t in oracle_outputs(target, inputs, device).items() if name in dts}
        oracle_b = oracle_outputs(target, fresh, device)
        for name in first:
            if _same_bits(oracle_a[name], oracle_b[name].to(dts[name])):
                continue
            for how, out in (("fresh tensors", second[name]), ("the same buffers", reused[name])):
                if _same_bits(out, first[name]):
                    return Verdict(target.name, "stale", output=name,
                                   detail=(f"new inputs in {how} (seed {partner.seed}{kept_element(case)}) gave "
                                           f"bitwise the same output {name!r} as seed {case.seed}, though the "
                                           f"oracle's outputs differ"))
        return Verdict(target.name, "pass")
