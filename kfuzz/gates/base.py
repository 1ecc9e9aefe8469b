"""What every gate shares: the gate itself, its result, and the shapes its cases use.

A gate is a fixed property check. It builds its own cases from the target's
contract and a seed (``cases``), so a gate run is reproducible, and judges one
case at a time (``check``), so any failing case can be saved and replayed on
its own. ``check`` returns a ``Verdict``. A gate never calls the kernel
itself: it materializes the inputs here and hands a kernel program
(``kfuzz.programs``) to an executor, in this process or in a sandboxed worker,
and judges what comes back here. The call contract (plain dense tensors of the
declared shape, dtype and device, work finished at return, no torch function
replaced, inputs unchanged) is enforced in every gate because every program
calls the kernel through ``kfuzz.execute.kernel_stage`` or ``call_kernel``,
and the outputs' contract and the inputs' bytes are checked again here.

A gate that does not apply to a target says so (``not_applicable`` returns
the reason); it is reported ``n/a``, never ``pass``.
"""
from __future__ import annotations

import gc
import zlib
from dataclasses import dataclass, field, replace
from typing import Iterable

import torch

from kfuzz.case import ArgCase, Case
from kfuzz.compare import BOUND_C
from kfuzz.devices import shares_memory
from kfuzz.dtypes import is_float
from kfuzz.errors import KfuzzError
from kfuzz.execute import release_device_memory, trusted_outputs
from kfuzz.sandbox import MEMORY
from kfuzz.target import Target
from kfuzz.tensors import materialize
from kfuzz.verdict import Verdict

NOMINAL = 64          # the nominal size of inner dims, clipped to the contract
OUTER = 16            # ... and of the others
STATUSES = ("pass", "fail", "n/a")
MEMORY_RERUN = "memory_rerun"   # a verdict's metric: out of a GPU's memory twice (``Gate.judge_case``)


def verdict_of(judged: Verdict | tuple[Case, Verdict]) -> Verdict:
    """The verdict of what ``Gate.check`` or ``Gate.judge_case`` returns (a verdict, or the
    case that failed and its verdict)."""
    return judged[1] if isinstance(judged, tuple) else judged


def gate_seed(seed: int, gate: str, i: int) -> int:
    """The case seed of case ``i`` of ``gate`` in a run with ``seed``: stable across runs."""
    return zlib.crc32(f"{gate}:{seed}:{i}".encode())


def _fit(target: Target, name: str, n: int) -> int | None:
    d = target.dims[name]
    n = max(d.lo, min(d.search_hi, n))
    n -= n % d.multiple_of
    if n < d.lo:
        n += d.multiple_of
    return n if d.admits(n) else None


def fit_dims(target: Target, wanted: dict[str, int]) -> dict[str, int] | None:
    """``wanted`` sizes moved into the contract, or None if the contract refuses them."""
    dims = {}
    for name in target.dims:
        n = _fit(target, name, wanted.get(name, NOMINAL))
        if n is None:
            return None
        dims[name] = n
    if target.constraint is not None and target.constraint(dims):
        return None
    return dims


def refused_by_reference(target: Target, case: Case, device: str = "cpu") -> Verdict | None:
    """For a target whose trusted implementation is its reference's own math
    (``options["reference_limited"]``, KernelBench), where judging ``case`` raised: a pass saying
    the case is outside the reference's domain when the reference itself (the trusted run, on
    ``device``) raises on the case's inputs, sizes or values it refuses (a Cholesky of a matrix
    that is not positive definite, a convolution over fewer elements than its window, a
    ``.view()`` of a permuted input) while the kernel took them. None otherwise: the error is
    kfuzz's own, a gate that could not run."""
    if not target.options.get("reference_limited"):
        return None
    try:
        inputs = materialize(case, target)
    except KfuzzError:      # kfuzz's own refusal of the case (a CaseError): the error stands
        return None
    try:
        trusted_outputs(target, case, inputs, device)
    except (torch.OutOfMemoryError, KfuzzError):    # the device's memory, or kfuzz's own refusal
        return None
    except Exception as e:
        return Verdict(target.name, "pass", detail=f"outside the reference's domain: the reference raises "
                                                   f"{type(e).__name__} on these inputs ({e})"[:500])
    return None


def inner_dims(target: Target) -> set[str]:
    """Dims that are the last (fastest) dim of some argument or output: the ones kernels
    block over and reduce along."""
    shapes = [a.shape for a in target.args.values()] + [o.shape for o in target.outputs.values()]
    return {str(s[-1]).partition("+")[0] for s in shapes if s and isinstance(s[-1], str)}


def nominal_dims(target: Target) -> dict[str, int]:
    """The shape G01 checks and most gates use: ``options["nominal"]`` if the target names
    one, else 64 for inner dims and 16 for the others (clipped to the contract), so
    that a Triton kernel under the CPU interpreter runs few programs."""
    inner = inner_dims(target)
    wanted = {n: NOMINAL if n in inner else OUTER for n in target.dims}
    wanted.update(dict(target.options.get("nominal", {})))
    dims = fit_dims(target, wanted)
    if dims is None:
        raise ValueError(f"target {target.name!r}: no nominal shape fits its contract; "
                         f"name one in options['nominal']")
    return dims


def float_args(target: Target, dtype: str) -> list[str]:
    """Arguments whose values are floating point in a case of ``dtype`` and take special values."""
    return [n for n, a in target.args.items() if a.specials and is_float(target.arg_dtype(n, dtype))]


def make_case(target: Target, dtype: str, seed: int, dims: dict[str, int],
              args: dict[str, ArgCase] | None = None) -> Case:
    case = Case.make(target.name, dtype, seed, dims, args or {})
    target.validate(case)
    return case


@dataclass
class GateResult:
    """One gate on one target: ``status`` pass, fail or n/a, with the evidence."""

    gate: str
    name: str
    status: str
    reason: str = ""                      # n/a: why; fail: the first failure's detail
    cases: int = 0
    failures: int = 0
    worst_ratio: float = 0.0              # largest error/bound over the cases (bound gates)
    first_failure: tuple[Case, Verdict] | None = None
    saved: list = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        d = {"gate": self.gate, "name": self.name, "status": self.status, "reason": self.reason,
             "cases": self.cases, "failures": self.failures, "seconds": round(self.seconds, 3),
             "worst_ratio": self.worst_ratio if self.worst_ratio != float("inf") else "inf",
             "saved": [str(p) for p in self.saved]}
        if self.first_failure is not None:
            case, v = self.first_failure
            d["case"] = case.to_json()
            d["verdict"] = v.to_json()
        return d


class Gate:
    """A property check. Subclasses set ``id``, ``name``, ``tolerance_free`` and define
    ``cases`` and ``check``; ``not_applicable`` returns a reason or None."""

    id: str = ""
    name: str = ""
    tolerance_free: bool = True
    property: str = ""

    def not_applicable(self, target: Target, executor=None) -> str | None:
        """Why the gate does not apply to ``target`` (``executor``: for a gate that must call
        the kernel to know), or None."""
        return None

    def cases(self, target: Target, seed: int) -> Iterable[Case]:
        raise NotImplementedError

    def check(self, target: Target, case: Case, device: str = "cpu", c: float = BOUND_C, executor=None
              ) -> Verdict | tuple[Case, Verdict]:
        """The verdict on ``case``; or (the case that failed, its verdict) when the check
        judged inputs other than ``case``'s own (G01's hidden-seed trial). The kernel's side
        runs in ``executor`` (default: ``kfuzz.executor.InProcess`` on ``device``)."""
        raise NotImplementedError

    def judge_case(self, target: Target, case: Case, device: str = "cpu", c: float = BOUND_C, executor=None
                   ) -> Verdict | tuple[Case, Verdict]:
        """``check``, with the oracle and the trusted implementation where the kernel ran; where
        a GPU's memory left to this process does not hold them, the case again with them on the
        CPU (the kernel's side runs again, in ``executor`` on its own device). Where judging
        raises and the reference itself refuses the case's inputs, a pass that says so
        (``refused_by_reference``); any other error is raised. After the case,
        ``execute.release_device_memory``.

        On a GPU, a case whose kernel ran out of memory (``resource-memory``) runs once more
        after this process has given back the memory torch cached: the GPU is shared with
        kfuzz's own processes (this one's oracle, the kernel's other workers), and a crashed
        worker is replaced by a fresh one. Out of memory again is its verdict, its metrics
        saying ``memory_rerun`` (``kfuzz.audit`` counts a GPU's out-of-memory failure only with it)."""
        verdict = self._judged(target, case, device, c, executor)
        if verdict_of(verdict).exc_type != MEMORY or not shares_memory(device):
            return verdict
        gc.collect()
        torch.cuda.empty_cache()
        verdict = self._judged(target, case, device, c, executor)
        v = verdict_of(verdict)
        if v.exc_type != MEMORY:
            return verdict
        v = replace(v, metrics={**v.metrics, MEMORY_RERUN: 1})
        return (verdict[0], v) if isinstance(verdict, tuple) else v

    def _judged(self, target: Target, case: Case, device: str, c: float, executor
                ) -> Verdict | tuple[Case, Verdict]:
        """``check``, where the oracle's side may run out of the GPU's memory or the reference
        refuse the inputs (``judge_case``)."""
        try:
            return self.check(target, case, device, c, executor=executor)
        except torch.OutOfMemoryError:
            if executor is None or not str(device).startswith("cuda"):
                raise
            torch.cuda.empty_cache()
            return self.check(target, case, "cpu", c, executor=executor)
        except Exception:
            outside = refused_by_reference(target, case, device)
            if outside is None:
                raise
            return outside
        finally:    # what a large case's oracle left cached goes back to the GPU the kernels share
            release_device_memory(device)

    def no_evidence(self, target: Target, verdicts: list[Verdict]) -> str | None:
        """After all cases passed: a reason the gate found nothing to judge (then n/a)."""
        return None
