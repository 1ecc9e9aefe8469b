"""The gates that need more than one call or a prepared memory: G08-G11, all tolerance-free.

- G08 determinism: the same inputs, several times and between other launches,
  give bitwise-equal outputs.
- G09 containment: inputs bitwise unchanged, guard regions before and after
  every input unchanged, no output sharing storage with an input, another
  output or an output of the call before (kfuzz's targets declare no aliasing;
  a kernel that returns one global buffer every call overwrites what its
  caller still holds).
- G10 complete writes: memory handed out during the call is poisoned (NaN) and
  must never show in the output; the kernel runs before any reference run.
- G11 input dependence: inputs whose oracle outputs differ give kernel outputs
  that differ, both for fresh tensors (called right after the first call's
  outputs are freed) and for new values written into the same buffers
  (catches constant outputs, caching by shape or by pointer, and returning
  freed memory that still holds an earlier result).

Guard regions surround kernel inputs only: outputs are the kernel's own
allocations, so nothing can be placed around them.
"""
from __future__ import annotations

import contextlib

import torch

from kfuzz.compare import BOUND_C
from kfuzz.execute import _storage_bytes, bits, call_kernel, kernel_stage, oracle_outputs
from kfuzz.gates.base import Gate, fit_dims, gate_seed, make_case, nominal_dims
from kfuzz.tensors import materialize, torch_dtype
from kfuzz.verdict import Verdict

REPEATS = 4           # G08: calls on the same inputs
GUARD_BYTES = 256     # G09: guard region on each side of every input
GUARD_FILL = 0xA5


def _bits(t: torch.Tensor) -> torch.Tensor:
    return bits(t.cpu())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


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

    def check(self, target, case, device="cpu", c=BOUND_C):
        inputs, first, verdict = kernel_stage(case, target, device)
        if verdict is not None:
            return verdict
        first = {k: v.clone() for k, v in first.items()}
        other = case.with_(seed=case.seed + 1)
        dev = torch.device(device)
        for r in range(1, REPEATS):
            if r == 2:   # another launch in between: state left behind must not matter
                _, _, verdict = kernel_stage(other, target, device)
                if verdict is not None:
                    return verdict
            outputs, verdict = call_kernel(target, case, inputs, dev)
            if verdict is not None:
                return verdict
            for name, out in outputs.items():
                if not _same_bits(out, first[name]):
                    i = _first_bit_difference(out, first[name])
                    return Verdict(target.name, "nondeterminism", output=name,
                                   detail=(f"call {r + 1} on the same inputs differs from call 1 at flat index {i}: "
                                           f"{out.reshape(-1)[i].item()!r} vs {first[name].reshape(-1)[i].item()!r}"))
        return Verdict(target.name, "pass")


def _guarded(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A copy of ``t`` (same strides) inside a storage with guard bytes before and after."""
    data = _storage_bytes(t)
    pad = GUARD_BYTES // t.element_size() * t.element_size()
    raw = torch.full((pad + data.numel() + pad,), GUARD_FILL, dtype=torch.uint8, device=t.device)
    raw[pad:pad + data.numel()] = data
    flat = raw.view(t.dtype)
    view = flat.as_strided(t.shape, t.stride(), t.storage_offset() + pad // t.element_size())
    return view, raw, pad


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.untyped_storage().data_ptr()
    return start, start + t.untyped_storage().nbytes()


class Containment(Gate):
    id, name = "G09", "containment"
    property = ("inputs and guard regions around them bitwise unchanged; no output aliases an input, another "
                "output or the previous call's output")

    def cases(self, target, seed):
        shapes = [nominal_dims(target), fit_dims(target, {n: d.lo for n, d in target.dims.items()})]
        i = 0
        for dims in [s for s in shapes if s is not None]:
            for dtype in target.dtypes:
                yield make_case(target, dtype, gate_seed(seed, self.id, i), dims)
                i += 1

    def check(self, target, case, device="cpu", c=BOUND_C):
        plain = materialize(case, target, torch.device(device))
        guarded = {k: _guarded(v) for k, v in plain.items()}
        inputs = {k: g[0] for k, g in guarded.items()}
        before = {k: g[1].clone() for k, g in guarded.items()}
        earlier, verdict = call_kernel(target, case, inputs, torch.device(device))
        if verdict is not None:
            return verdict
        # a second call while the first call's outputs are still held: it must not write into them
        outputs, verdict = call_kernel(target, case, inputs, torch.device(device))
        if verdict is not None:
            return verdict
        for name, (_, raw, pad) in guarded.items():
            changed = (raw != before[name]).nonzero().reshape(-1)
            if changed.numel():
                pos = int(changed[0])
                where = ("the guard region before" if pos < pad else
                         "the guard region after" if pos >= raw.numel() - pad else "the storage of")
                return Verdict(target.name, "mutation", output=name,
                               detail=f"{where} input {name!r} changed ({changed.numel()} byte(s), first at byte {pos - pad:+d})")
        spans = {f"input {k!r}": _storage_span(raw) for k, (_, raw, _) in guarded.items()}
        spans.update({f"output {k!r} of the previous call (a later call overwrites it)": _storage_span(t)
                      for k, t in earlier.items()})
        for name, out in outputs.items():
            lo, hi = _storage_span(out)
            for other, (a, b) in spans.items():
                if lo < b and a < hi:
                    return Verdict(target.name, "contract", output=name,
                                   detail=f"output {name!r} shares storage with {other} (undeclared aliasing)")
            spans[f"output {name!r}"] = (lo, hi)
        return Verdict(target.name, "pass")


@contextlib.contextmanager
def poisoned_allocations():
    """Every tensor allocated by torch inside the block comes filled with NaN (torch's
    deterministic mode fills uninitialized memory; integers get their largest value)."""
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = was_fill
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn)


class CompleteWrites(Gate):
    id, name = "G10", "complete writes"
    property = "memory poisoned before the call never shows in the output; the kernel runs before any reference run"

    def cases(self, target, seed):
        return _per_dtype(self, target, seed, nominal_dims(target))

    def check(self, target, case, device="cpu", c=BOUND_C):
        inputs = materialize(case, target, torch.device(device))
        with poisoned_allocations():
            outputs, verdict = call_kernel(target, case, inputs, torch.device(device))
        if verdict is not None:
            return verdict
        oracle = oracle_outputs(target, inputs)     # only after the kernel returned
        for name, out in outputs.items():
            dt = torch_dtype(target.output_dtype(name, case.dtype))
            if not dt.is_floating_point:
                continue
            leaked = torch.isnan(out.detach().cpu()) & ~torch.isnan(oracle[name].cpu().to(dt))
            if leaked.any():
                idx = int(leaked.reshape(-1).nonzero()[0])
                return Verdict(target.name, "stale", output=name,
                               detail=(f"poisoned memory (NaN) shows in output {name!r} at {int(leaked.sum())} of "
                                       f"{out.numel()} position(s), first at flat index {idx}; the oracle there is "
                                       f"{oracle[name].reshape(-1)[idx].item():.6g}"))
        return Verdict(target.name, "pass")


class InputDependence(Gate):
    id, name = "G11", "input dependence"
    property = ("inputs whose oracle outputs differ give kernel outputs that differ, for fresh tensors and for "
                "new values written into the same buffers")

    def cases(self, target, seed):
        return _per_dtype(self, target, seed, nominal_dims(target))

    def check(self, target, case, device="cpu", c=BOUND_C):
        dev = torch.device(device)
        partner = case.with_(seed=case.seed + 1)
        fresh = materialize(partner, target, dev)
        # kernel_stage returns copies and releases the kernel's own outputs, so nothing is
        # allocated between that release and the next call: a kernel that returns freed
        # memory unwritten gets this call's result back where the allocator reuses blocks
        inputs, first, verdict = kernel_stage(case, target, device)
        if verdict is not None:
            return verdict
        second, verdict = call_kernel(target, partner, fresh, dev)
        if verdict is not None:
            return verdict
        second = {k: v.clone() for k, v in second.items()}
        for name, t in inputs.items():        # the partner's values, in the first call's buffers
            t.copy_(fresh[name])
        reused, verdict = call_kernel(target, partner, inputs, dev)
        if verdict is not None:
            return verdict
        oracle_a = oracle_outputs(target, materialize(case, target, dev))
        oracle_b = oracle_outputs(target, fresh)
        for name in first:
            dt = torch_dtype(target.output_dtype(name, case.dtype))
            if _same_bits(oracle_a[name].to(dt), oracle_b[name].to(dt)):
                continue
            for how, out in (("fresh tensors", second[name]), ("the same buffers", reused[name])):
                if _same_bits(out, first[name]):
                    return Verdict(target.name, "stale", output=name,
                                   detail=(f"new inputs in {how} (seed {partner.seed}) gave bitwise the same output "
                                           f"{name!r} as seed {case.seed}, though the oracle's outputs differ"))
        return Verdict(target.name, "pass")
