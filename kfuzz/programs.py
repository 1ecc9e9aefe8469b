"""Kernel programs: each gate's use of the kernel, as a small named program that the kernel
side runs on inputs kfuzz's process materialized, and the executors that run them.

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

- ``call`` (G01-G07): one call under the call contract (``execute.kernel_stage``), its
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
- ``weights`` and ``standard`` (the audit): a KernelBench solution's weights contract and
  the standard test that accepted it; both run the solution, so they are kernel-side too,
  and what they report is the kernel process's word (an audit records it as such).

Two executors, one interface: ``InProcess`` runs a program in this process on copies of
the inputs (trusted kernels, measurements, tests; no isolation), ``Sandboxed`` in a
confined worker (``kfuzz.workers``): the oracle and its outputs never enter that process,
and a worker that dies or hangs is that program's ``crash`` or ``timeout``, the next
program getting a fresh worker.

Refuses: an unknown program name (KeyError on the kernel side is a malformed request).
"""
from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kfuzz import sandbox
from kfuzz.case import Case
from kfuzz.errors import KfuzzError
from kfuzz.execute import _storage_bytes, bits, call_kernel, kernel_stage, raising_frame
from kfuzz.target import Target
from kfuzz.verdict import Verdict
from kfuzz.wire import dense_outputs, geometry, pack, rebuild, unpack
from kfuzz.workers import _WORKER_VERDICTS, Worker, _worker_case, death, resource_crash, worker_policy

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
    second, verdict = call_kernel(target, case, fresh, device)
    if verdict is not None:
        return verdict, {"first": first}, {}
    second = _copies(second)
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
    snapshot = {k: _storage_bytes(v) for k, v in mine.items()}
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
        if not torch.equal(_storage_bytes(t), snapshot[name]):
            return Verdict(target.name, "mutation", output=name,
                           detail=f"input {name!r} changed during the forward or backward call"), {}, {"graph": True}
    return None, {"grads": {k: g.detach() for k, g in got.items() if g is not None}}, {"graph": True}


def _weights(target, program, inputs, device):
    bench = target.options["bench"]
    model = bench.solution_model(dict(bench.contract.dims), device)
    del model
    return None, {}, {"status": bench.weights_status or ""}


def _standard(target, program, inputs, device):
    from kfuzz.kernelbench import standard_test
    pair = target.options["pair"] if "pair" in target.options else target.options["bench"].pair
    return None, {}, standard_test(pair, device=str(device)).to_json()


# name -> (target, program, inputs on the device by role, device) -> (verdict, outputs by role, facts)
PROGRAMS: dict[str, Callable[..., tuple[Verdict | None, dict[str, Tensors], dict]]] = {
    "call": _call, "repeat": _repeat, "guarded": _guarded, "poisoned": _poisoned, "rebind": _rebind,
    "backward": _backward, "weights": _weights, "standard": _standard}


def run_program(target: Target, program: Program, inputs: dict[str, Tensors], device: str
                ) -> tuple[Verdict | None, dict[str, Tensors], dict]:
    """Run ``program`` here on ``inputs`` (already on ``device``; the program may write into
    them). Adds ``after:<role>`` for every input role: the inputs as they are afterwards."""
    verdict, outputs, facts = PROGRAMS[program.name](target, program, inputs, torch.device(device))
    outputs = dict(outputs)
    outputs.update({f"after:{role}": dict(ts) for role, ts in inputs.items()})
    return verdict, outputs, facts


def is_storage_role(role: str) -> bool:
    """Roles whose tensors travel with their whole storage (inputs after a program); outputs
    travel dense."""
    return role.startswith("after:")


def replicate(t: torch.Tensor, device: str | torch.device = "cpu") -> torch.Tensor:
    """A copy of ``t`` with its own storage: the same bytes, layout and bytes around the view."""
    return rebuild(_storage_bytes(t.detach()).cpu(), geometry(t), device)


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
            same = torch.equal(_storage_bytes(a).cpu(), _storage_bytes(t).cpu())
        else:    # a copy of another layout (a grad-enabled leaf): its values bit for bit
            same = a.shape == t.shape and torch.equal(bits(a.cpu()), bits(t.to(a.dtype).cpu()))
        if not same:
            return Verdict(target_name, "mutation", output=name,
                           detail=f"input {name!r} (or the storage around it) changed during the call")
    return None


def outputs_of(result: ProgramResult, target: Target, case: Case, role: str) -> Tensors | Verdict:
    """The outputs of ``role``, checked again here against the call contract (names, type,
    shape, dtype): a malformed answer if they break it (the kernel side reports honest failures)."""
    from kfuzz.execute import contract_violation
    outs = result.outputs.get(role)
    if outs is None or set(outs) != set(target.outputs):
        return malformed(target.name, f"the kernel side returned outputs {sorted(outs or ())} for {role!r}, "
                                      f"expected {sorted(target.outputs)}")
    bad = contract_violation(outs, target, case, torch.device("cpu"))
    return malformed(target.name, f"{role}: {bad[1]}") if bad else outs


def called(executor, target: Target, case: Case, inputs: Tensors) -> tuple[Tensors | None, Verdict | None]:
    """One call (the ``call`` program) on kfuzz's ``inputs``: the outputs to judge, or the
    verdict that ends the case (the call's own, or a change to the inputs seen here)."""
    r = executor.run(Program("call", case, {"case": inputs}))
    if r.verdict is not None:
        return None, r.verdict
    verdict = changed_input(target.name, inputs, r.outputs.get("after:case", {}))
    if verdict is not None:
        return None, verdict
    outs = outputs_of(r, target, case, "out")
    return (None, outs) if isinstance(outs, Verdict) else (outs, None)


# the worker's side -------------------------------------------------------------------------------

def answer(target: Target, case: Case, name: str, params: dict, layouts: list, storages: list,
           device: str, cpu_seconds: int | None) -> tuple[bytes, bool]:
    """The worker's side: run one kernel program on the inputs received (storages and their
    layouts by role); the answer to send, and whether the worker must end (a crash verdict)."""
    inputs: dict[str, dict[str, torch.Tensor]] = {}
    for (role, arg, geo), st in zip(layouts, storages):
        inputs.setdefault(role, {})[arg] = rebuild(st, geo, device)
    sandbox.start_case(cpu_seconds)
    outputs, facts = {}, {}
    try:
        verdict, outputs, facts = run_program(target, Program(name, case, {}, params), inputs, device)
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
    back, tensors = [], []
    for role, ts in sendable(outputs).items():
        for arg, t in ts.items():
            back.append((role, arg, geometry(t)))
            tensors.append(t.detach())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    msg = pack(("program-done", back, None if verdict is None else verdict.to_json(), facts,
                usage.ru_utime + usage.ru_stime), tensors)
    return msg, verdict is not None and verdict.kind == "crash"


# executors -----------------------------------------------------------------------------------------

class InProcess:
    """Runs programs in this process, on copies of kfuzz's inputs: no isolation, no timeout.
    For trusted kernels, measurements and tests."""

    def __init__(self, target: Target, device: str = "cpu"):
        self.target, self.device = target, device

    def run(self, program: Program) -> ProgramResult:
        start = time.monotonic()
        inputs = {role: {k: replicate(v, self.device) for k, v in ts.items()} for role, ts in program.inputs.items()}
        told = Program(program.name, Case(program.case.target, program.case.dtype, 0, program.case.dims), {},
                       program.params)     # as a worker is told: no seed
        verdict, outputs, facts = run_program(self.target, told, inputs, self.device)
        back = {role: {k: (replicate(v) if is_storage_role(role) else v.detach().cpu().clone())
                       for k, v in ts.items()} for role, ts in sendable(outputs).items()}
        return ProgramResult(verdict, back, facts, time.monotonic() - start)

    def restart(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# what a worker imports before it is confined: the programs, and torch._dynamo, which
# torch.use_deterministic_algorithms (G10) imports and which makes a directory in /tmp
PROGRAM_IMPORTS = ("kfuzz.programs", "torch._dynamo")


class Sandboxed:
    """Runs programs in a confined worker (``kfuzz.workers.Worker``: forked from kfuzz's
    zygote, which never touches CUDA, confined by ``kfuzz.sandbox``), one at a time. A worker that
    dies is that program's ``crash`` (its signal or the limit it hit), one that gives no
    answer within ``timeout`` seconds is killed, ``timeout``; an answer that is not one
    (the kernel can reach its pipe) is ``crash``/``malformed-answer``; the next program gets a
    fresh worker. The worker finds the target by its name (``resolve``: options for a
    resolver such as ``kb:``'s), so the target must be registered or resolvable by name."""

    def __init__(self, target: Target, device: str = "cpu", timeout: float = 120.0,
                 policy: sandbox.Policy | None = None, resolve: dict | None = None, preload: tuple[str, ...] = ()):
        self.target, self.device, self.timeout, self.resolve = target, device, timeout, resolve
        self.preload = PROGRAM_IMPORTS + tuple(preload)
        self.policy = worker_policy(policy, device, timeout)
        self.worker = None
        self.spawned = 0          # workers started (the first, then one after each death or hang)

    def _spawn(self):
        return Worker(self.target.name, getattr(self.target.kernel, "__module__", None), self.device, False,
                      self.policy, self.resolve, self.preload)

    def restart(self) -> None:
        """End the current worker; the next program starts a fresh one."""
        if self.worker is not None:
            self.worker.stop()
            self.worker = None

    def _lost(self, kind: str, exc_type: str | None, detail: str, start: float) -> ProgramResult:
        self.worker.kill()
        self.worker = None
        return ProgramResult(Verdict(self.target.name, kind, exc_type=exc_type, detail=detail),
                             seconds=time.monotonic() - start)

    def run(self, program: Program) -> ProgramResult:
        if self.worker is None:
            self.worker = self._spawn()
            self.spawned += 1
        layouts, tensors = [], []
        for role, ts in program.inputs.items():
            for arg, t in ts.items():
                layouts.append((role, arg, geometry(t)))
                tensors.append(t)
        w, start = self.worker, time.monotonic()
        w.started = start
        w.credit.reset()
        w.post(pack(("program", _worker_case(program.case), program.name, program.params, layouts), tensors))
        while True:   # the deadline moves on while the kernel compiles (kfuzz.jit)
            if not w.conn.poll(max(0.0, w.deadline(self.timeout) - time.monotonic())):
                if time.monotonic() < w.deadline(self.timeout):
                    continue
                return self._lost("timeout", None, f"no answer within {self.timeout:g} s; the worker was killed",
                                  start)
            try:
                msg = w.conn.recv_bytes()
            except (EOFError, OSError):
                return self._lost("crash", *death(w, self.policy), start)
            if not w.compile_note(msg):
                break
        try:   # the answer is data from the kernel's process: parsed, checked
            (kind, back, verdict_json, facts, _cpu), storages = unpack(msg)
            if kind != "program-done" or not isinstance(facts, dict) or len(back) != len(storages):
                raise ValueError("not an answer to a program")
            verdict = None if verdict_json is None else Verdict.from_json(self.target.name, verdict_json)
            if verdict is not None and verdict.kind not in _WORKER_VERDICTS:
                raise ValueError(f"a worker may not report {verdict.kind!r}; kfuzz judges")
            outputs: dict[str, Tensors] = {}
            for (role, arg, geo), st in zip(back, storages):
                if not isinstance(role, str) or not isinstance(arg, str):
                    raise ValueError("a role or a name is not a string")
                outputs.setdefault(role, {})[arg] = rebuild(st, geo)
        except (ValueError, TypeError, KeyError, RuntimeError, KfuzzError) as e:
            return self._lost("crash", "malformed-answer", f"the worker's answer is malformed: {e}"[:2000], start)
        # seen by kfuzz, whatever the kernel did to its process's bookkeeping
        escape = w.escape(answered=verdict is None or verdict.kind != "crash")
        if escape is not None:
            return self._lost("crash", *escape, start)
        if verdict is not None and verdict.kind == "crash":
            self.worker.kill()      # the worker ends itself after a crash verdict
            self.worker = None
        return ProgramResult(verdict, outputs, facts, time.monotonic() - start)

    def close(self) -> None:
        self.restart()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def executor_for(target: Target, device: str = "cpu", executor: Any = None):
    """``executor`` if given, else an in-process one (the library's default: the CLI sandboxes)."""
    return executor if executor is not None else InProcess(target, device)
