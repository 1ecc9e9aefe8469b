"""Kernel programs: each use of the kernel (a campaign's case, a gate's calls, the audit's
checks), as a small named program that the kernel side runs on inputs kfuzz's process
materialized.

A gate never calls the kernel itself. It builds a ``Program`` (a name, the case's target,
dtype and dims, never its seed; input tensors by role, made by kfuzz; a few JSON parameters)
and hands it to an executor, which returns a ``ProgramResult``: the outputs of each call
(copies, by role), each input's storage after the program (role ``after:<role>``, bit for
bit with its layout and the bytes around it), JSON facts, and the verdict of a call itself
when one ended the program (``exception``, ``contract``, ``mutation``; ``crash`` and
``timeout`` from the executor). Everything else (the oracle, the trusted implementation,
the comparison, bitwise equality between calls, guard bytes, overlapping storage) is
judged in kfuzz's process, on what came back.

The programs (``PROGRAMS``), with the gates that use them:

- ``call`` (campaigns, the minimizer, G01-G07): one call under the call contract (``execute.kernel_stage``), its
  outputs copied at return;
- ``repeat`` (G08): the same inputs ``repeats`` times, the ``other`` case's launch
  between the second and third call; every call's outputs;
- ``guarded`` (G09): two calls on inputs with guard bytes around them (kfuzz made them),
  the first call's outputs held during the second; the storage spans of inputs and
  outputs. Spans are addresses in the kernel's process, a fact kfuzz cannot check: an
  overlap is evidence of a bug, not a trust boundary;
- ``poisoned`` (G10): one call while every allocation is filled with NaN;
- ``rebind`` (G11): a call on the case's inputs, a call on the ``partner``'s, then the
  partner's values written into the first buffers and a third call;
- ``backward`` (G12): a forward on grad-enabled leaves and a backward with kfuzz's
  cotangents; the gradients, and whether the outputs carried a graph (a reported fact);
- ``weights``, ``standard`` and ``build`` (the audit): registered by ``kfuzz.kernelbench``
  (``register_program``; ``kfuzz.kernelbench.programs`` describes them).

The executors that run them (``kfuzz.executor``: ``InProcess`` in this process, ``Pool``
and ``Sandboxed`` in confined workers) are one interface for every caller: the oracle
and its outputs never enter a worker, and a worker that dies or hangs is that program's
``crash`` or ``timeout``. A campaign's cases are ``call`` programs too.

Refuses: an unknown program name (KeyError on the kernel side is a malformed request).
"""
from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass, field
from typing import Callable

import torch

from kfuzz import sandbox
from kfuzz.case import Case
from kfuzz.execute import (DEVICE_ERROR, call_kernel, contract_violation, kernel_stage, raising_frame,
                           release_device_memory, storage_bytes, storage_view)
from kfuzz.target import Target
from kfuzz.tensors import raw_bytes
from kfuzz.verdict import Verdict
from kfuzz.wire import dense_outputs, geometry, pack, rebuild

Tensors = dict[str, torch.Tensor]


@dataclass
class Program:
    """A kernel program to run: ``name`` in ``PROGRAMS``, the ``case`` (its seed is never
    sent), input tensors by role (kfuzz's, on the CPU; the executor copies them to the
    device), and JSON ``params``."""

    name: str
    case: Case
    inputs: dict[str, Tensors] = field(default_factory=dict)
    params: dict = field(default_factory=dict)


@dataclass
class ProgramResult:
    """What came back: ``outputs`` by role (on the CPU; ``after:<role>`` the inputs' storage
    after the program), ``facts`` (JSON), and the verdict that ended the program, if any."""

    verdict: Verdict | None
    outputs: dict[str, Tensors] = field(default_factory=dict)
    facts: dict = field(default_factory=dict)
    seconds: float = 0.0
    program: Program | None = None          # what ran (its inputs are kfuzz's own, for the judge)
    coverage: frozenset = frozenset()       # harness edges reached, when the executor records them
    compile_seconds: float = 0.0            # of ``seconds``, the JIT compiles (kfuzz.jit notes)
    device: str = ""                        # where the kernel ran
    compiled: tuple[str, ...] = ()          # what compiled, a label each (kfuzz.jit.label)

    @property
    def case(self) -> Case | None:
        return self.program.case if self.program is not None else None

    @property
    def inputs(self) -> Tensors | None:
        """kfuzz's own inputs of the ``call`` program (the case's arguments)."""
        return self.program.inputs.get("case") if self.program is not None else None


def resource_crash(verdict: Verdict | None) -> Verdict | None:
    """An exception, or a CUDA error that ended the call, that says a resource ran out (memory,
    open files) is a ``crash`` named after the resource, not the kernel's exception."""
    if verdict is not None and (verdict.kind == "exception"
                                or verdict.kind == "crash" and verdict.detail.startswith(DEVICE_ERROR)):
        kind = sandbox.resource_kind(verdict.exc_type, verdict.detail)
        if kind is not None:
            return Verdict(verdict.target, "crash", detail=verdict.detail, exc_type=kind)
    return verdict


# the kernel side: the programs themselves ---------------------------------------------------------

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


def _copies(outputs: Tensors) -> Tensors:
    return {k: v.detach().clone() for k, v in outputs.items()}


def _host_copies(outputs: Tensors) -> Tensors:
    """Copies of ``outputs`` in the host's memory (they go there to be sent back in any case):
    a program that calls the kernel again then leaves the GPU only the next call's memory."""
    return {k: v.detach().to("cpu", copy=True) for k, v in outputs.items()}


def _span(t: torch.Tensor) -> list[int]:
    start = t.untyped_storage().data_ptr()
    return [start, start + t.untyped_storage().nbytes()]


def _call(target, program, inputs, device):
    _, outputs, verdict = kernel_stage(program.case, target, str(device), inputs=inputs["case"])
    return verdict, {"out": outputs} if outputs is not None else {}, {}


def _repeat(target, program, inputs, device):
    case = program.case
    _, first, verdict = kernel_stage(case, target, str(device), inputs=inputs["case"])
    if verdict is not None:
        return verdict, {}, {}
    out = {"call1": _copies(first)}
    for r in range(1, int(program.params.get("repeats", 4))):
        if r == 2:   # another launch in between: state left behind must not matter
            _, _, verdict = kernel_stage(case, target, str(device), inputs=inputs["other"])
            if verdict is not None:
                return verdict, out, {}
        outputs, verdict = call_kernel(target, case, inputs["case"], device)
        if verdict is not None:
            return verdict, out, {}
        out[f"call{r + 1}"] = _copies(outputs)
    return None, out, {}


def _guarded(target, program, inputs, device):
    case, given = program.case, inputs["case"]
    earlier, verdict = call_kernel(target, case, given, device)
    if verdict is not None:
        return verdict, {}, {}
    # a second call while the first call's outputs are still held: it must not write into them
    outputs, verdict = call_kernel(target, case, given, device)
    if verdict is not None:
        return verdict, {}, {}
    facts = {"inputs": {k: _span(v) for k, v in given.items()},
             "earlier": {k: _span(v) for k, v in earlier.items()},
             "outputs": [[k, *_span(v)] for k, v in outputs.items()]}
    return None, {}, facts


def _poisoned(target, program, inputs, device):
    with poisoned_allocations():
        outputs, verdict = call_kernel(target, program.case, inputs["case"], device)
    return verdict, {"out": outputs} if outputs is not None else {}, {}


def _rebind(target, program, inputs, device):
    case, mine, fresh = program.case, inputs["case"], inputs["partner"]
    # kernel_stage returns copies and releases the kernel's own outputs, so nothing is
    # allocated between that release and the next call: a kernel that returns freed
    # memory unwritten gets this call's result back where the allocator reuses blocks
    _, first, verdict = kernel_stage(case, target, str(device), inputs=mine)
    if verdict is not None:
        return verdict, {}, {}
    first = _host_copies(first)     # a GPU holds one call's outputs at a time
    second, verdict = call_kernel(target, case, fresh, device)
    if verdict is not None:
        return verdict, {"first": first}, {}
    second = _host_copies(second)
    for name, t in mine.items():        # the partner's values, in the first call's buffers
        t.copy_(fresh[name])
    reused, verdict = call_kernel(target, case, mine, device)
    if verdict is not None:
        return verdict, {"first": first, "second": second}, {}
    return None, {"first": first, "second": second, "reused": reused}, {}


def leaves(inputs: Tensors, names, dtype=None) -> Tensors:
    """``inputs`` with the ``names`` as fresh grad-enabled copies (cast to ``dtype`` if given)."""
    out = {}
    for k, v in inputs.items():
        v = v.detach()
        if k in names:
            v = (v.to(dtype) if dtype is not None else v.clone()).requires_grad_(True)
        out[k] = v
    return out


def grads(outputs: Tensors, leaves_: Tensors, names, cots: Tensors) -> dict[str, torch.Tensor | None]:
    """The gradients of ``outputs`` (those with a graph) for the leaves ``names`` under ``cots``."""
    outs, gs = [], []
    for name, out in outputs.items():
        if out.requires_grad:
            outs.append(out)
            gs.append(cots[name].to(out.dtype).to(out.device))
    return dict(zip(names, torch.autograd.grad(outs, [leaves_[n] for n in names], gs, allow_unused=True)))


def _backward(target, program, inputs, device):
    names = list(program.params["names"])
    mine = leaves(inputs["case"], names)
    snapshot = {k: storage_bytes(v) for k, v in mine.items()}
    with torch.enable_grad():
        outputs, verdict = call_kernel(target, program.case, mine, device)
        if verdict is not None:
            return verdict, {}, {}
        if not any(o.requires_grad for o in outputs.values()):
            return None, {}, {"graph": False}
        if program.params.get("probe"):
            return None, {}, {"graph": True}
        try:
            got = grads(outputs, mine, names, inputs["cotangents"])
        except Exception as e:
            return Verdict(target.name, "exception", detail=f"backward: {type(e).__name__}: {e}"[:2000],
                           exc_type=type(e).__name__, frame="backward"), {}, {"graph": True}
    for name, t in mine.items():
        if not torch.equal(storage_view(t), snapshot[name]):
            return Verdict(target.name, "mutation", output=name,
                           detail=f"input {name!r} changed during the forward or backward call"), {}, {"graph": True}
    return None, {"grads": {k: g.detach() for k, g in got.items() if g is not None}}, {"graph": True}


# name -> (target, program, inputs on the device by role, device) -> (verdict, outputs by role, facts)
ProgramFn = Callable[..., tuple[Verdict | None, dict[str, Tensors], dict]]
PROGRAMS: dict[str, ProgramFn] = {
    "call": _call, "repeat": _repeat, "guarded": _guarded, "poisoned": _poisoned, "rebind": _rebind,
    "backward": _backward}


def register_program(name: str, program: ProgramFn) -> None:
    """Add a kernel program to ``PROGRAMS`` (``kfuzz.kernelbench`` adds its own on import). A
    name is registered once; the same function again is accepted."""
    if PROGRAMS.get(name, program) is not program:
        raise ValueError(f"kernel program {name!r} is already registered")
    PROGRAMS[name] = program


# programs that compare their inputs' bytes themselves, with a snapshot taken before the call
# (``execute.kernel_stage``): a change is their ``mutation`` verdict, and the inputs do not
# travel back (kfuzz's comparison would rest on bytes from the same process, at the price of
# a device-to-host copy and a pipe transfer of every input a case)
SELF_CHECKED = frozenset({"call"})


def run_program(target: Target, program: Program, inputs: dict[str, Tensors], device: str
                ) -> tuple[Verdict | None, dict[str, Tensors], dict]:
    """Run ``program`` here on ``inputs`` (already on ``device``; the program may write into
    them). Adds ``after:<role>`` for every input role, the inputs as they are afterwards,
    unless the program checks them itself (``SELF_CHECKED``)."""
    verdict, outputs, facts = PROGRAMS[program.name](target, program, inputs, torch.device(device))
    outputs = dict(outputs)
    if program.name not in SELF_CHECKED:
        outputs.update({f"after:{role}": dict(ts) for role, ts in inputs.items()})
    return verdict, outputs, facts


def answered(verdict: Verdict | None, outputs: dict[str, Tensors]) -> dict[str, Tensors]:
    """What of a program's outputs goes back with its verdict: nothing after a crash (nothing of
    a crashed case is judged, and after a CUDA error the device's memory cannot be read)."""
    return {} if verdict is not None and verdict.kind == "crash" else outputs


def is_storage_role(role: str) -> bool:
    """Roles whose tensors travel with their whole storage (inputs after a program); outputs
    travel dense."""
    return role.startswith("after:")


def replicate(t: torch.Tensor, device: str | torch.device = "cpu") -> torch.Tensor:
    """A copy of ``t`` with its own storage: the same bytes, layout and bytes around the view."""
    return rebuild(storage_bytes(t.detach()).cpu(), geometry(t), device)


def sendable(outputs: dict[str, Tensors]) -> dict[str, Tensors]:
    """What a program's outputs look like once received: dense outputs, whole storages for the
    ``after:`` roles."""
    out = {}
    for role, ts in outputs.items():
        if is_storage_role(role):
            out[role] = dict(ts)
        else:
            out[role] = dict(zip(ts, dense_outputs(ts)))
    return out


# judging what came back, in kfuzz's process -------------------------------------------------------

def malformed(target_name: str, detail: str) -> Verdict:
    """The verdict on an answer that cannot be an honest one (an honest kernel side reports a
    contract failure itself): a kernel that reached its worker's pipe."""
    return Verdict(target_name, "crash", exc_type="malformed-answer", detail=detail[:2000])


def changed_input(target_name: str, sent: Tensors, after: Tensors) -> Verdict | None:
    """``mutation`` if an input (or the storage around it) differs from what kfuzz sent."""
    for name, t in sent.items():
        a = after.get(name)
        if a is None:
            return malformed(target_name, f"input {name!r} did not come back from the kernel side")
        if geometry(a) == geometry(t) and a.untyped_storage().nbytes() == t.untyped_storage().nbytes():
            same = torch.equal(storage_view(a).cpu(), storage_view(t).cpu())
        else:    # a copy of another layout (a grad-enabled leaf): its values bit for bit
            same = a.shape == t.shape and torch.equal(raw_bytes(a.cpu()), raw_bytes(t.to(a.dtype).cpu()))
        if not same:
            return Verdict(target_name, "mutation", output=name,
                           detail=f"input {name!r} (or the storage around it) changed during the call")
    return None


def outputs_of(result: ProgramResult, target: Target, case: Case, role: str) -> Tensors | Verdict:
    """The outputs of ``role``, checked again here against the call contract (names, type,
    shape, dtype): a malformed answer if they break it (the kernel side reports honest failures)."""
    outs = result.outputs.get(role)
    if outs is None or set(outs) != set(target.outputs):
        return malformed(target.name, f"the kernel side returned outputs {sorted(outs or ())} for {role!r}, "
                                      f"expected {sorted(target.outputs)}")
    bad = contract_violation(outs, target, case, torch.device("cpu"))
    return malformed(target.name, f"{role}: {bad[1]}") if bad else outs


def shared_exception(target: Target, inputs: Tensors, verdict: Verdict) -> Verdict | None:
    """For a target whose trusted implementation is its reference's own math
    (``options["reference_limited"]``, KernelBench): a kernel exception that the trusted
    implementation raises too, of the same type, on the same inputs. The case is outside the
    contract: a pass that says so. None otherwise."""
    if verdict.kind != "exception" or not verdict.exc_type or not target.options.get("reference_limited"):
        return None
    try:
        target.call_trusted({k: v.detach().clone() for k, v in inputs.items()})
    except Exception as e:
        if type(e).__name__ == verdict.exc_type:
            return Verdict(target.name, "pass", detail=f"outside the contract: the reference raises "
                                                       f"{verdict.exc_type} on these inputs too ({e})"[:500])
    return None


def settled(r: ProgramResult, target: Target, case: Case, inputs: Tensors) -> tuple[Tensors | None, Verdict | None]:
    """What a ``call`` program's result on kfuzz's ``inputs`` leaves to judge: the outputs, or
    the verdict that ends the case (the call's own: a change to the inputs is its ``mutation``)."""
    if r.verdict is not None:
        return None, shared_exception(target, inputs, r.verdict) or r.verdict
    outs = outputs_of(r, target, case, "out")
    return (None, outs) if isinstance(outs, Verdict) else (outs, None)


def called(executor, target: Target, case: Case, inputs: Tensors) -> tuple[Tensors | None, Verdict | None]:
    """One call (the ``call`` program) on kfuzz's ``inputs`` in ``executor``: the outputs to
    judge, or the verdict that ends the case."""
    return settled(executor.run(Program("call", case, {"case": inputs})), target, case, inputs)


# the worker's side -------------------------------------------------------------------------------

def answer(target: Target, case: Case, name: str, params: dict, layouts: list, storages: list,
           device: str, cpu_seconds: int | None, coverage=None) -> tuple[bytes, bool]:
    """The worker's side: run one kernel program on the inputs received (storages and their
    layouts by role); the answer to send, and whether the worker must end (a crash verdict).
    ``coverage``: a ``kfuzz.coverage.HarnessCoverage`` to record the harness edges with."""
    if device.startswith("cuda:"):    # a worker pinned to one GPU: Triton launches on the current one
        torch.cuda.set_device(torch.device(device))
    inputs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        for (role, arg, geo), st in zip(layouts, storages):
            inputs.setdefault(role, {})[arg] = rebuild(st, geo, device)
    except Exception as e:   # before the kernel runs: only a resource that ran out (a GPU shared with
        kind = sandbox.resource_kind(type(e).__name__, str(e))     # other processes) is a verdict
        if kind is None:
            raise
        verdict = Verdict(target.name, "crash", exc_type=kind,
                          detail=f"the case's inputs did not fit on {device}: {type(e).__name__}: {e}"[:2000])
        return _done(verdict, {}, {}, ()), True
    sandbox.start_case(cpu_seconds)
    outputs, facts, edges = {}, {}, ()
    try:
        with coverage if coverage is not None else contextlib.nullcontext():
            verdict, outputs, facts = run_program(target, Program(name, case, {}, params), inputs, device)
        edges = sorted(coverage.edges) if coverage is not None else ()
        verdict = resource_crash(verdict)
    except sandbox.SandboxViolation:
        verdict = None
    except Exception as e:    # the program's own steps (a backward, a weights load) raised
        verdict = resource_crash(Verdict(target.name, "exception", detail=f"{type(e).__name__}: {e}"[:2000],
                                         exc_type=type(e).__name__, frame=raising_frame(e)))
        outputs, facts = {}, {}
    escape = sandbox.violation()    # recorded even when the kernel caught it
    if escape is not None:
        outputs, facts, verdict = {}, {}, Verdict(target.name, "crash", exc_type=escape[0], detail=escape[1])
    msg = _done(verdict, outputs, facts, edges)
    crashed = verdict is not None and verdict.kind == "crash"
    if not crashed:
        del inputs, outputs
        release_device_memory(device)
    return msg, crashed


def _done(verdict: Verdict | None, outputs: dict, facts: dict, edges) -> bytes:
    """A program's answer: its verdict, the outputs that go back (none after a crash), its facts,
    the worker's CPU seconds so far and the harness edges."""
    back, tensors = [], []
    for role, ts in sendable(answered(verdict, outputs)).items():
        for arg, t in ts.items():
            back.append((role, arg, geometry(t)))
            tensors.append(t.detach())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return pack(("program-done", back, None if verdict is None else verdict.to_json(), facts,
                 usage.ru_utime + usage.ru_stime, list(edges)), tensors)

