"""Executing a case: the kernel under the call contract, then the oracle, then the verdict.

The kernel runs first, before any reference run, so that no result of the
oracle or the trusted implementation can be lying in memory for it to return.
The call contract, checked on every call:

- outputs are plain dense ``torch.Tensor`` objects (no subclass, no sparse or
  lazy tensor, no view whose elements overlap, as an expanded constant's do)
  of the declared shape, dtype and device;
- all work is finished at return: no Python thread that the call started is
  still running (an idle thread-pool worker with nothing queued is not work),
  and on CUDA the outputs copied on the current stream right at return equal
  the outputs after the device is synchronized (work left on a side stream
  shows as a difference; an error that surfaces there is a ``crash``); what
  ``kernel_stage`` returns to be judged is those copies taken at return, so
  work that finishes later cannot make a wrong answer right;
- no hook was installed that runs code after return without a thread (trace
  or profile functions, garbage-collection callbacks, signal handlers); each
  is undone;
- nothing in the namespaces a comparison relies on was replaced: the
  attributes of torch, torch.nn.functional, torch.testing, torch.Tensor,
  numpy, numpy.testing, builtins, math and kfuzz's own modules keep their
  identities (names added are not counted, as a lazy import adds submodules,
  unless they shadow a class's inherited attribute), and their Python
  functions keep their code. A replacement is undone before the verdict, so
  it does not outlive the call;
- inputs, including the storage around strided and offset views, are bitwise
  unchanged (``mutation``).

The tripwires behind the hooks, threads, overlap and namespace checks are in
``kfuzz.contract``. This module does not isolate the kernel: ``kernel_stage`` and
``call_kernel`` are the kernel's side, which ``kfuzz.executor`` (campaigns, the
gates, the minimizer, the audit) runs in a sandboxed worker; ``judge`` and the
oracle's functions are kfuzz's side (``kfuzz.judges`` runs several judges at once).
Called directly (``execute``), both run in this process, and a kernel that segfaults
takes it down.
"""
from __future__ import annotations

import os
import sys
import traceback
import warnings
from typing import Any, Callable, Mapping

import torch

from kfuzz.case import Case
from kfuzz.compare import BOUND_C, NONFINITE_KINDS, compare, kinds
from kfuzz.contract import NamespaceSnapshot, current_hooks, overlapping, restore_hooks, threads_left
from kfuzz.devices import compiled_triton_on_cpu
from kfuzz.dtypes import torch_dtype, unit_roundoff, widen_float8
from kfuzz.target import Target, get_target
from kfuzz.tensors import materialize, raw_bytes
from kfuzz.verdict import Verdict


def _tensors_of(result: Any) -> list[torch.Tensor]:
    values = result.values() if isinstance(result, Mapping) else (
        result if isinstance(result, (tuple, list)) else (result,))
    return [v for v in values if type(v) is torch.Tensor]


def storage_view(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` (the view's bytes and those around it), as a uint8 view."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of the whole storage under ``t`` (``storage_view``)."""
    return storage_view(t).clone()


def raising_frame(exc: BaseException) -> str:
    """``file:function`` of the innermost frame, without line numbers (signatures survive edits)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "<native>"
    f = frames[-1]
    return f"{os.path.basename(f.filename)}:{f.name}"


def as_outputs(result: Any, target: Target) -> dict[str, Any]:
    """The kernel's return value by output name; raises ValueError on a wrong structure."""
    names = list(target.outputs)
    if isinstance(result, Mapping):
        if set(result) != set(names):
            raise ValueError(f"returned outputs {sorted(result)}, expected {names}")
        return dict(result)
    if not isinstance(result, (tuple, list)):
        result = (result,)
    if len(result) != len(names):
        raise ValueError(f"returned {len(result)} output(s), expected {len(names)} ({', '.join(names)})")
    return dict(zip(names, result))


def contract_violation(outputs: Mapping[str, Any], target: Target, case: Case,
                       device: torch.device) -> tuple[str, str] | None:
    dims = case.dim
    for name, out in outputs.items():
        spec = target.outputs[name]
        if type(out) is not torch.Tensor:
            return name, f"output {name!r} is a {type(out).__module__}.{type(out).__qualname__}, not a plain torch.Tensor"
        if out.layout != torch.strided:
            return name, f"output {name!r} has layout {out.layout}, not a dense strided tensor"
        if overlapping(out):
            return name, (f"output {name!r} is a view whose elements overlap (strides {list(out.stride())} "
                          f"for shape {list(out.shape)}: an expanded or aliased view, not a dense tensor)")
        shape = target.shape_of(spec.shape, dims)
        if tuple(out.shape) != shape:
            return name, f"output {name!r} has shape {list(out.shape)}, the contract says {list(shape)}"
        want = torch_dtype(target.output_dtype(name, case.dtype))
        if out.dtype != want:
            return name, f"output {name!r} has dtype {out.dtype}, the contract says {want}"
        if out.device.type != device.type:
            return name, f"output {name!r} is on {out.device}, inputs are on {device}"
    return None


def _upcast(inputs: Mapping[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: (v.detach().to(device, torch.float64) if v.dtype.is_floating_point else v.detach().to(device))
            for k, v in inputs.items()}


def flush_subnormals(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The inputs with subnormal values flushed to (signed) zero, or None if there are none."""
    out, any_sub = {}, False
    for k, v in inputs.items():
        if v.is_floating_point():
            w = widen_float8(v)
            sub = (w != 0) & (w.abs() < torch.finfo(v.dtype).tiny)
            if sub.any():
                any_sub = True
                v = torch.where(sub, w * 0, w).to(v.dtype)
        out[k] = v
    return out if any_sub else None


# Where the bound fails, the oracle is evaluated again on inputs perturbed by this many draws of
# one unit of roundoff (relative, random signs): the trusted error is raised to that change
# (`perturbed_trusted`)
PERTURB_DRAWS = 2
# Where a non-finite finding may be the rounding of the inputs' choice, the envelope takes this
# many draws (the first PERTURB_DRAWS are the bound's): an Inf times a sum that cancels to its
# rounding noise takes each sign in about half of them, and a kind that 4 of 10 draws take is
# missed by 8 in 1.7% of cases, by 2 in 36%
ENVELOPE_DRAWS = 8


def perturbed_inputs(inputs: Mapping[str, torch.Tensor], u: float, seed: int) -> dict[str, torch.Tensor]:
    """Copies of ``inputs`` with every floating value scaled by 1 +- u (random signs from
    ``seed``): zeros, NaN and Inf stay as they are."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in inputs.items():
        if v.is_floating_point():
            signs = torch.randint(0, 2, v.shape, generator=gen).to(torch.float64) * 2 - 1
            v = v.detach().to(torch.float64) * (1 + u * signs.to(v.device))
        out[k] = v
    return out


def moved_oracles(target: Target, case: Case, inputs: Mapping[str, torch.Tensor],
                  device="cpu", draws: int = PERTURB_DRAWS, where="cpu") -> list[dict[str, torch.Tensor]]:
    """The oracle's outputs on ``draws`` copies of ``inputs``, each moved by one unit of the
    compute precision's roundoff (fp32's; float64's for float64 cases), computed on ``device``
    and kept on ``where`` (the comparison's device); draw i from seed ``case.seed + i``, so
    fewer draws are the first of more."""
    u = unit_roundoff("float64" if case.dtype == "float64" else "float32")
    return [_on(oracle_outputs(target, perturbed_inputs(inputs, u, case.seed + draw), device), where)
            for draw in range(draws)]


def oracle_envelope(oracle: Mapping[str, torch.Tensor], moved: list[Mapping[str, torch.Tensor]]
                    ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per output, the oracle's value minus and plus the farthest the ``moved`` copies went
    from it (float64; an Inf where a copy left the oracle's class, NaN where any is NaN), and
    where the oracle is non-finite, the non-finite kinds (``kfuzz.compare.kinds``) it and the
    copies take there: how far the rounding of the inputs alone can take the answer, either
    way (``kfuzz.compare``). On the oracle's device."""
    out = {}
    for k, o in oracle.items():
        o = o.to(torch.float64)
        r = torch.zeros_like(o)
        held = kinds(o)
        for m in moved:
            m = m[k].to(o.device, torch.float64)
            d = (m - o).abs()
            r = torch.maximum(r, torch.where(torch.isnan(d) & (m == o), 0.0, d))   # the same Inf: 0
            held = held | kinds(m)
        wide = torch.isinf(r)
        out[k] = (torch.where(wide, -torch.inf, o - r), torch.where(wide, torch.inf, o + r),
                  torch.where(torch.isfinite(o), 0, held))
    return out


def _widest(o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The envelope that holds every non-NaN value (-Inf to +Inf everywhere) and, where the
    oracle is non-finite, every non-finite kind."""
    far = torch.full(o.shape, torch.inf, dtype=torch.float64, device=o.device)
    return -far, far, torch.where(torch.isfinite(o), 0, NONFINITE_KINDS)


def perturbed_trusted(target: Target, case: Case, inputs: Mapping[str, torch.Tensor],
                      oracle: Mapping[str, torch.Tensor], trusted: Mapping[str, torch.Tensor],
                      device="cpu", moved: list[Mapping[str, torch.Tensor]] | None = None
                      ) -> dict[str, torch.Tensor]:
    """The trusted outputs with each finite value moved, where the oracle itself moves farther,
    to the oracle's value on inputs perturbed by one unit of the compute precision's roundoff
    (fp32's; float64's for float64 cases), the farthest of PERTURB_DRAWS draws.  The trusted
    error then covers the answer's own sensitivity to rounding: an output that cancels to
    (nearly) zero, whose terms are far larger than it, may be one rounding of those terms away
    from the oracle in any honest kernel, while an implementation that cancels them exactly in
    its order of operations has no error to scale the bound by.  ``moved``: the oracle's
    outputs on those inputs (``moved_oracles``), when already computed."""
    return _farther(oracle, trusted, moved if moved is not None
                    else moved_oracles(target, case, inputs, device))


def trusted_realizations(target: Target, case: Case, inputs: Mapping[str, torch.Tensor],
                         device=None, where="cpu") -> list[dict[str, torch.Tensor]]:
    """The outputs of the target's trusted variants (``Target.trusted_variants``: other honest
    realizations of the trusted implementation's roundings) on ``inputs``, computed on
    ``device`` and kept on ``where``."""
    return [_on(trusted_outputs(target, case, inputs, device, variant=i), where)
            for i in range(target.trusted_variants)]


def with_realized_kinds(envelope: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                        oracle: torch.Tensor, realizations: list[torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``envelope`` (``oracle_envelope``'s, of one output) with, where the oracle is
    non-finite, the non-finite kinds the trusted realizations take there added: where an
    honest realization of the trusted precision lands on an Inf where the oracle's is NaN (or
    the other way), the kind is its roundings' choice (an infinite step applied to a state
    whose sign lies below that precision's noise), and a kernel that takes it is as honest."""
    lo, hi, held = envelope
    o = oracle.to(held.device)
    for r in realizations:
        held = held | torch.where(torch.isfinite(o), 0, kinds(r.to(held.device)))
    return lo, hi, held


def varied_trusted(target: Target, case: Case, inputs: Mapping[str, torch.Tensor],
                   oracle: Mapping[str, torch.Tensor], trusted: Mapping[str, torch.Tensor],
                   c: float, device=None, realizations: list[Mapping[str, torch.Tensor]] | None = None
                   ) -> dict[str, torch.Tensor]:
    """The trusted outputs with each finite value moved, where one of the target's trusted
    variants (``Target.trusted_variants``: other honest realizations of its roundings) lands
    farther from the oracle, to o + (v - o) / ``c``: the bound, ``c`` times the trusted error,
    is then that variant's own error.  An implementation of the trusted one's precision may
    land as far as its farthest realization: on an output of an element or two, the roundings
    of one realization can cancel to far below the others' (so a bound scaled by it alone is
    luck), while a kernel farther off than every realization still fails."""
    oracle64 = {k: v.to(torch.float64) for k, v in oracle.items()}
    if realizations is None:
        realizations = trusted_realizations(target, case, inputs, device)
    shrunk = [{k: oracle64[k] + (var[k].to(oracle64[k].device, torch.float64) - oracle64[k]) / c for k in trusted}
              for var in realizations]
    return _farther(oracle, trusted, shrunk)


def _farther(oracle: Mapping[str, torch.Tensor], trusted: Mapping[str, torch.Tensor],
             others: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``trusted`` (float64, on the oracle's device) with each finite value replaced by the
    farthest from the oracle of the finite ``others`` there, where one is farther."""
    out = {k: v.to(oracle[k].device, torch.float64) for k, v in trusted.items()}
    for draw in others:
        for k, t in out.items():
            o, m = oracle[k].to(torch.float64), draw[k].to(t.device, torch.float64)
            farther = torch.isfinite(t) & torch.isfinite(o) & torch.isfinite(m) & ((m - o).abs() > (t - o).abs())
            out[k] = torch.where(farther, m, t)
    return out


def without_specials(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The inputs with every NaN and Inf replaced by 0, or None if they hold none: where the
    trusted implementation is non-finite on these too, no special value of the inputs made it
    so, only an overflow (``kfuzz.compare``)."""
    out, any_special = {}, False
    for k, v in inputs.items():
        w = widen_float8(v)
        if v.is_floating_point() and not bool(torch.isfinite(w).all()):
            any_special = True
            v = torch.where(torch.isfinite(w), w, torch.zeros_like(w)).to(v.dtype)
        out[k] = v
    return out if any_special else None


def lazy_outputs(compute: Callable[[], Mapping[str, torch.Tensor]]) -> Callable[[str], Callable[[], torch.Tensor]]:
    """For each output name, a function returning that output of ``compute()``, which runs
    once, at the first call."""
    done: list[Mapping[str, torch.Tensor]] = []

    def output(name: str) -> Callable[[], torch.Tensor]:
        def get() -> torch.Tensor:
            if not done:
                done.append(compute())
            return done[0][name]
        return get
    return output


def oracle_outputs(target: Target, inputs: Mapping[str, torch.Tensor], device="cpu") -> dict[str, torch.Tensor]:
    """The reference math on float64-upcast copies of ``inputs``, computed on ``device``."""
    return as_outputs(target.reference(**_upcast(inputs, device)), target)


def trusted_outputs(target: Target, case: Case, inputs: Mapping[str, torch.Tensor],
                    device=None, variant: int | None = None) -> dict[str, torch.Tensor]:
    """The trusted implementation at the kernel's own precision (its ``variant``, if given), on
    copies of ``inputs`` (moved to ``device`` if given), its outputs rounded to the declared
    output dtypes."""
    copies = {k: (v.detach().to(device, copy=True) if device is not None else v.detach().clone())
              for k, v in inputs.items()}
    outs = as_outputs(target.call_trusted(copies, variant), target)
    return {k: v.to(torch_dtype(target.output_dtype(k, case.dtype))) for k, v in outs.items()}


def _on(outputs: Mapping[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in outputs.items()}


COMPARE_ON_DEVICE_MIN = 1 << 20    # output elements from which a GPU oracle's comparison runs on the GPU


def comparison_device(oracle: Mapping[str, torch.Tensor], oracle_device) -> str:
    """Where ``judge`` compares: on the GPU where the oracle ran on one and an output holds at
    least ``COMPARE_ON_DEVICE_MIN`` elements (a comparison makes about ten float64 passes over
    an output, each bound by the memory's bandwidth), else on the CPU, where a small output
    costs less than the GPU's launches and synchronizations."""
    big = any(t.numel() >= COMPARE_ON_DEVICE_MIN for t in oracle.values())
    return str(oracle_device) if str(oracle_device).startswith("cuda") and big else "cpu"


DEVICE_ERROR = "CUDA error"     # how the detail of a crash that a CUDA error ended the call with starts
CACHE_KEPT = 2 << 30     # bytes of GPU memory a process may keep cached by torch's allocator after a case


def release_device_memory(device: str) -> None:
    """Give the GPU memory that torch's allocator cached in this process beyond ``CACHE_KEPT``
    back to the GPU: a GPU's kernel workers and judges share its memory, and the cache of one
    large case held by each would leave none for the others' launches."""
    if str(device).startswith("cuda") and reserved_bytes() > CACHE_KEPT:
        torch.cuda.empty_cache()


def reserved_bytes() -> int:
    """The GPU memory torch's allocator holds in this process on the current device: what
    ``torch.cuda.memory_reserved`` says, read from the nested statistics (it flattens all of
    them first, ~0.25 ms, where this is read after every case)."""
    stats = torch.cuda.memory_stats_as_nested_dict()
    return stats.get("reserved_bytes", {}).get("all", {}).get("current", 0)


def is_device_error(e: BaseException) -> bool:
    """A CUDA error (illegal address, launch failure, ...) raised by torch or by Triton's launcher."""
    text = str(e)
    return (type(e).__name__ == "AcceleratorError" or "CUDA error" in text
            or "Triton Error [CUDA]" in text or "illegal memory access" in text)


def call_kernel(target: Target, case: Case, inputs: Mapping[str, torch.Tensor],
                device: torch.device, at_return: bool = False
                ) -> tuple[dict[str, torch.Tensor] | None, Verdict | None]:
    """Call the kernel under the contract: its outputs, or the verdict that ends the case.
    With ``at_return``, copies of the outputs taken the moment the kernel returned (on CUDA:
    ordered on the current stream), so that work still writing into them afterwards (a
    thread that existed before the call, a hook) cannot make a wrong answer right."""
    namespaces = NamespaceSnapshot()
    threads = set(sys._current_frames())
    hooks = current_hooks()
    early: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with warnings.catch_warnings():
            # overflow and invalid-value warnings are what fuzzing provokes, not news
            warnings.simplefilter("ignore", RuntimeWarning)
            result = target.kernel(**inputs)
        # copies first, before anything releases the GIL (on CUDA ordered on the current
        # stream only: work left on a side stream is missing from them)
        early = [(t, t.detach().clone()) for t in _tensors_of(result)] if at_return or device.type == "cuda" else []
        if device.type == "cuda":
            try:
                torch.cuda.synchronize(device)
            except Exception as e:  # an asynchronous CUDA error
                namespaces.undo()
                return None, Verdict(target.name, "crash", detail=f"{DEVICE_ERROR} after the call: {e}",
                                     exc_type=type(e).__name__)
    except Exception as e:
        mismatch = compiled_triton_on_cpu(e, device.type)
        if mismatch is not None:
            namespaces.undo()
            restore_hooks(hooks)
            raise mismatch from e
        if device.type == "cuda" and is_device_error(e):
            # the context is unusable after this: a crash, not an exception to carry on from
            namespaces.undo()
            return None, Verdict(target.name, "crash", detail=f"{DEVICE_ERROR} in the call: {e}"[:2000],
                                 exc_type=type(e).__name__)
        namespaces.undo()
        restore_hooks(hooks)
        return None, Verdict(target.name, "exception", detail=f"{type(e).__name__}: {e}"[:2000],
                             exc_type=type(e).__name__, frame=raising_frame(e))
    replaced = namespaces.undo()
    hooked = restore_hooks(hooks)
    if hooked:
        return None, Verdict(target.name, "contract",
                             detail=(f"pending work: the call installed {', '.join(hooked)} (undone): code that "
                                     f"would run after return, while its outputs are judged"))
    if replaced:
        return None, Verdict(target.name, "contract", detail=f"the call replaced {', '.join(sorted(replaced)[:8])}"
                             + (f" and {len(replaced) - 8} more" if len(replaced) > 8 else "")
                             + " (undone)")
    left = threads_left(threads)
    if left:
        return None, Verdict(target.name, "contract",
                             detail=(f"pending work: the call left {len(left)} thread(s) running "
                                     f"({', '.join(left[:4])}); all work must be finished at return"))
    for t, copy in early if device.type == "cuda" else ():
        if not torch.equal(raw_bytes(t), raw_bytes(copy)):
            return None, Verdict(target.name, "contract",
                                 detail=("pending work: an output changed after return (work left on another "
                                         "stream); all work must be finished at return"))
    try:
        outputs = as_outputs(result, target)
    except ValueError as e:
        return None, Verdict(target.name, "contract", detail=str(e))
    bad = contract_violation(outputs, target, case, device)
    if bad:
        return None, Verdict(target.name, "contract", output=bad[0], detail=bad[1])
    if at_return:
        copies = {id(t): c for t, c in early}
        outputs = {k: copies[id(v)] for k, v in outputs.items()}
    return outputs, None


def kernel_stage(case: Case, target: Target, device: str = "cpu",
                 inputs: Mapping[str, torch.Tensor] | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, Verdict | None]:
    """The kernel's half of an execution (what a sandboxed worker runs): materialize,
    call under the contract, check the inputs' storage. Returns (inputs, outputs, verdict):
    outputs to judge (copies taken at return), or the verdict that already ends the case. ``inputs``: the case's
    arguments when the caller has materialized them already (a worker receives them from
    kfuzz's process, so it never needs the case's seed)."""
    dev = torch.device(device)
    inputs = materialize(case, target, dev) if inputs is None else dict(inputs)
    snapshot = {k: storage_bytes(v) for k, v in inputs.items()}
    outputs, verdict = call_kernel(target, case, inputs, dev, at_return=True)
    if verdict is not None:
        return inputs, None, verdict
    for name, t in inputs.items():
        if not torch.equal(storage_view(t), snapshot[name]):
            return inputs, None, Verdict(target.name, "mutation", output=name,
                                         detail=f"input {name!r} (or the storage around it) changed during the call")
    return inputs, outputs, None


def execute(case: Case, target: Target | None = None, device: str = "cpu",
            oracle_device: str | None = None, c: float = BOUND_C) -> Verdict:
    """Run ``case`` once and judge it: pass, or the first failure found. The oracle runs on
    ``oracle_device``, by default the kernel's ``device``."""
    target = target or get_target(case.target)
    inputs, outputs, verdict = kernel_stage(case, target, device)
    if verdict is not None:
        return verdict
    return judge(case, target, inputs, outputs, oracle_device or device, c)


def _clean_trusted(target: Target, case: Case, inputs: Mapping[str, torch.Tensor], device, where="cpu"
                   ) -> Callable[[str], Callable[[], torch.Tensor]] | None:
    """Per output, the trusted implementation's output on ``inputs`` without their NaN and Inf
    (computed once, on ``device``, when first asked for, and kept on ``where``); None where the
    inputs hold none."""
    clean = without_specials(inputs)
    if clean is None:
        return None
    return lazy_outputs(lambda: _on(trusted_outputs(target, case, clean, device), where))


def judge(case: Case, target: Target, inputs: Mapping[str, torch.Tensor],
          outputs: Mapping[str, torch.Tensor], oracle_device: str = "cpu", c: float = BOUND_C) -> Verdict:
    """The oracle's half: compare the kernel's ``outputs`` on ``inputs`` with the float64
    oracle, the bound scaled by the trusted implementation (FTZ-tolerant). The oracle and the
    trusted implementation run on ``oracle_device`` (a GPU, where the kernel ran on one);
    the comparison where ``comparison_device`` says. On a GPU, ``inputs`` are moved there once,
    first: the oracle's upcast, the trusted run's copies and the scans for subnormals and
    specials then run on the GPU, not on the host's one thread."""
    if str(oracle_device).startswith("cuda"):
        inputs = _on(inputs, oracle_device)
    oracle = oracle_outputs(target, inputs, oracle_device)
    where = comparison_device(oracle, oracle_device)
    oracle = _on(oracle, where)
    trusted = _on(trusted_outputs(target, case, inputs, oracle_device), where)
    outputs = _on(outputs, where)
    flushed = flush_subnormals(inputs)
    clean = _clean_trusted(target, case, inputs, oracle_device, where)
    raised = varied = moved = envelope = realized = None
    worst = 0.0
    metrics: dict[str, float] = {}
    for name, out in outputs.items():
        dtype = target.output_dtype(name, case.dtype)
        finding = compare(out, oracle[name], trusted[name], dtype, c * target.bound_scale,
                          clean and clean(name), device=where)
        if finding.kind is not None and flushed is not None:
            # flush-to-zero is a legitimate IEEE mode on GPUs: judge against it too
            oracle_ftz = _on(oracle_outputs(target, flushed, oracle_device), where)
            trusted_ftz = _on(trusted_outputs(target, case, flushed, oracle_device), where)
            clean_ftz = _clean_trusted(target, case, flushed, oracle_device, where)
            alt = compare(out, oracle_ftz[name], trusted_ftz[name], dtype, c * target.bound_scale,
                          clean_ftz and clean_ftz(name), device=where)
            finding = alt if alt.kind is None else finding
        if finding.kind == "nonfinite" and compare(out, oracle[name], trusted[name], dtype, c * target.bound_scale,
                                                   clean and clean(name), _widest(oracle[name]), device=where).kind != "nonfinite":
            # an answer whose class the rounding of the inputs decides: any value in its envelope
            # (computed only where some envelope could pass the kernel: never for a NaN where
            # the oracle is finite)
            if envelope is None:
                more = moved_oracles(target, case, inputs, oracle_device, ENVELOPE_DRAWS, where)
                moved, envelope = more[:PERTURB_DRAWS], oracle_envelope(oracle, more)
            alt = compare(out, oracle[name], trusted[name], dtype, c * target.bound_scale,
                          clean and clean(name), envelope[name], device=where)
            if alt.kind == "nonfinite" and target.trusted_variants:
                # a kind that an honest realization of the trusted precision takes
                realized = realized or trusted_realizations(target, case, inputs, oracle_device, where)
                envelope[name] = with_realized_kinds(envelope[name], oracle[name],
                                                     [r[name] for r in realized])
                alt = compare(out, oracle[name], trusted[name], dtype, c * target.bound_scale,
                              clean and clean(name), envelope[name], device=where)
            finding = alt if alt.kind != "nonfinite" else finding
        if finding.kind == "bound":
            # an answer that cancels: the trusted error raised to the oracle's own sensitivity
            moved = moved or moved_oracles(target, case, inputs, oracle_device, where=where)
            if raised is None:
                raised = perturbed_trusted(target, case, inputs, oracle, trusted, oracle_device, moved)
            alt = compare(out, oracle[name], raised[name], dtype, c * target.bound_scale, clean and clean(name),
                          envelope and envelope[name], device=where)
            finding = alt if alt.kind is None else finding
        if finding.kind == "bound" and target.trusted_variants:
            # no farther from the oracle than an honest realization of the trusted precision
            if varied is None:
                realized = realized or trusted_realizations(target, case, inputs, oracle_device, where)
                varied = varied_trusted(target, case, inputs, oracle, raised, c * target.bound_scale,
                                        oracle_device, realized)
            alt = compare(out, oracle[name], varied[name], dtype, c * target.bound_scale, clean and clean(name),
                          envelope and envelope[name], device=where)
            finding = alt if alt.kind is None else finding
        metrics.update({f"{name}.{k}": v for k, v in finding.metrics})
        if finding.kind is not None:
            return Verdict(target.name, finding.kind, output=name, detail=finding.detail,
                           ratio=finding.ratio, metrics=metrics)
        worst = max(worst, finding.ratio)
    return Verdict(target.name, "pass", ratio=worst, metrics=metrics)
