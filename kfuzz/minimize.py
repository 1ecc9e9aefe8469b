"""The minimizer: a failing case shrunk to its smallest form with the same failure signature.

Designing the passes (after hypothesis's shrinker). The minimizer is a list of
small, named shrink passes; each pass looks at the current case and proposes
candidates, simplest first, each one reduction of the case. The first candidate
that still fails *the same way* (same signature, on every re-run) becomes the
current case and the pass starts again from it; a pass that has no accepted
candidate left is done. The list is swept until a whole sweep changes nothing
(a fixed point) or the budget of executions is spent. Cheap, large reductions
come first (drop injections, shrink dims), so that later passes run on small,
fast cases; zeroing payload elements, the one pass that can cost many
executions, comes last. On a GPU, where each new shape or dtype costs a JIT
compile, the passes that keep them come first (``COMPILED_PASSES``).

"Simpler" has one order per part of the case, so that two runs of the
minimizer agree: fewer injections; smaller dims (the contract fixes the rank,
so lowering the rank means driving dims to 1); injected values toward 0, 1, -1;
layouts toward contiguous; dtype toward ``DTYPE_ORDER``; distribution toward
``DIST_ORDER`` (``normal`` first: it is the default and drops out of the case);
seed toward 0; for an explicit payload, windows of each dimension and elements
set to zero, and an argument's payload dropped where generated values fail the
same way.

The predicate is "the same failure signature": a candidate is executed, and if
it matches it is executed again (``reruns``) and must match every time, so a
flaky result is never adopted. An execution is by default the kernel's call judged
by the oracle; a failure that only a gate's own rules find (a non-finite value, a
repeated run that differs) gives its own ``check``: the gate's verdict on a case,
candidates one at a time. Candidates that break the target's contract are
rejected without running, and every candidate's answer is cached by its hash.

Where cases come from hypothesis strategies, hypothesis's own shrinker shrinks
them (it sees the choice sequence); these passes cover what it cannot reach:
cases read from the corpus and imported payloads, which have no choice sequence.

The kernel's calls go to an ``executor`` (``kfuzz.executor``): by default this process,
and for an untrusted kernel a sandboxed worker, as in a campaign (the shrunk cases run
that kernel too); a crash or a hang is then a verdict like any other, and is minimized
too. The oracle always runs here, on the kernel's device. With several workers (a pool's
``jobs``), a pass's next ``jobs`` candidates run at once and the first of them (in the
pass's order) that keeps the failure is taken: the case reached is the one asking them
one at a time reaches, for the executions spent on candidates past it (on a GPU, where a
candidate of a new shape compiles for seconds, those compiles run side by side).

This module refuses (``NotReproducible``): a case that passes, or does not fail
with the signature asked for on every run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from kfuzz.case import ArgCase, Case, Dist, Layout
from kfuzz.dtypes import torch_dtype
from kfuzz.errors import KfuzzError
from kfuzz.execute import execute, judge
from kfuzz.programs import Program, settled
from kfuzz.target import Target, get_target
from kfuzz.tensors import decode_payload, encode_payload, logical_values, materialize
from kfuzz.verdict import Signature, Verdict

DTYPE_ORDER = ("float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
               "int64", "int32", "bool")
DIST_ORDER = ("normal", "ones", "binary01", "smallint", "uniform01", "shifted", "scaled",
              "heavytailed", "subnormal", "nearmax")
# other numbers rank between -1 and the names
VALUE_ORDER = (0.0, 1.0, -1.0, None, "-0", "tiny", "subnormal", "max", "-max", "inf", "-inf", "nan")
DEFAULT_BUDGET = 200      # executions, re-runs included
ZERO_CHUNKS = 64          # zero_payload_elements stops at chunks of 1/64 of the nonzeros


class NotReproducible(KfuzzError):
    """The case does not fail with the expected signature on every run."""


class BudgetSpent(Exception):
    """Internal: the predicate may not execute again."""


# the predicate -------------------------------------------------------------------------------

def run_once(case: Case, target: Target, device: str = "cpu", executor=None) -> Verdict:
    """One execution of ``case``: in this process (``execute``), or its kernel in ``executor``
    and the oracle here."""
    if executor is None:
        return execute(case, target, device=device)
    return _judged(executor.run(_call(case, target)), target, device)


def _call(case: Case, target: Target) -> Program:
    return Program("call", case, {"case": materialize(case, target, "cpu")})


def _judged(result, target: Target, device: str) -> Verdict:
    """The verdict on a ``call`` program's result: the call's own, or the oracle's here."""
    case, inputs = result.program.case, result.program.inputs["case"]
    outputs, verdict = settled(result, target, case, inputs)
    return verdict if verdict is not None else judge(case, target, inputs, outputs, device)


def run_many(cases: list[Case], target: Target, device: str = "cpu", executor=None) -> list[Verdict | KfuzzError]:
    """One execution of each of ``cases``, at once where ``executor`` has several workers
    (``jobs``): every kernel call is queued, then each case is judged here as its call comes
    back. A case kfuzz cannot run gives its KfuzzError in its place."""
    if executor is None or getattr(executor, "jobs", 1) <= 1 or len(cases) <= 1:
        out: list[Verdict | KfuzzError] = []
        for c in cases:
            try:
                out.append(run_once(c, target, device, executor))
            except KfuzzError as e:
                out.append(e)
        return out
    programs = [_call(c, target) for c in cases]
    for program in programs:
        executor.submit(program)
    back: dict[int, object] = {}
    while len(back) < len(programs):
        for r in executor.results(None):
            back[id(r.program)] = r
    verdicts: list[Verdict | KfuzzError] = []
    for program in programs:
        try:
            verdicts.append(_judged(back[id(program)], target, device))
        except KfuzzError as e:
            verdicts.append(e)
    return verdicts


Check = Callable[[Case], Verdict]      # a case's verdict, where it is not the oracle's on one call


class SameFailure:
    """Does a candidate fail with ``signature`` on each of ``1 + reruns`` executions?
    ``first`` asks it of several candidates at once (``run_many``), or, with ``check``, of
    each in turn through it."""

    def __init__(self, target: Target, signature: Signature, device: str = "cpu", reruns: int = 1,
                 max_executions: int = DEFAULT_BUDGET, deadline: float | None = None, executor=None,
                 check: Check | None = None):
        self.target, self.signature, self.device, self.executor = target, signature, device, executor
        self.check = check
        self.reruns, self.max_executions, self.deadline = reruns, max_executions, deadline
        self.executions = 0
        self.answers: dict[str, bool] = {}
        self.verdicts: dict[str, Verdict] = {}

    def __call__(self, case: Case) -> bool:
        return self.first([case]) == 0

    def first(self, cases: list[Case]) -> int | None:
        """The index of the first of ``cases`` that fails with the signature on every run, or
        None: the candidates not answered yet run together, each run round at once (a
        candidate that stops matching runs no more). The answer is the one asking them one
        by one in order would give; the executions spent past it are the price of asking at
        once."""
        alive: list[Case] = []
        for case in cases:
            if case.hash in self.answers or any(case.hash == c.hash for c in alive):
                continue
            try:
                self.target.validate(case)
            except KfuzzError:
                self.answers[case.hash] = False
                continue
            alive.append(case)
        for _ in range(1 + self.reruns):
            if not alive:
                break
            room = self.max_executions - self.executions
            if room <= 0 or (self.deadline is not None and time.monotonic() > self.deadline):
                raise BudgetSpent
            batch = alive[:room]
            self.executions += len(batch)
            matched = []
            for case, verdict in zip(batch, self.run(batch)):
                if isinstance(verdict, Verdict) and verdict.signature == self.signature:
                    self.verdicts[case.hash] = verdict
                    matched.append(case)
                else:
                    self.answers[case.hash] = False
            if len(batch) < len(alive):
                raise BudgetSpent
            alive = matched
        for case in alive:
            self.answers[case.hash] = True
        return next((i for i, case in enumerate(cases) if self.answers.get(case.hash)), None)

    def run(self, cases: list[Case]) -> list[Verdict | KfuzzError]:
        """One execution of each of ``cases``: ``run_many``'s, or ``check``'s one after another."""
        if self.check is None:
            return run_many(cases, self.target, self.device, self.executor)
        out: list[Verdict | KfuzzError] = []
        for case in cases:
            try:
                out.append(self.check(case))
            except KfuzzError as e:
                out.append(e)
        return out


# case surgery shared by the passes -------------------------------------------------------------

def _rebuild(case: Case, *, dims=None, args=None, payload="keep", dtype=None, seed=None) -> Case:
    return Case.make(case.target, dtype or case.dtype, case.seed if seed is None else seed,
                     case.dim if dims is None else dims, dict(case.args) if args is None else args,
                     case.payload_dict if payload == "keep" else payload)


def _with_injections(case: Case, items: list[tuple[str, tuple]]) -> Case:
    names = {n for n, _ in case.args} | {n for n, _ in items}
    args = {}
    for name in names:
        ac = case.arg(name)
        args[name] = ArgCase(ac.layout, ac.dist, tuple(inj for n, inj in items if n == name))
    return _rebuild(case, args=args)


def _payload_tensors(case: Case) -> dict[str, torch.Tensor]:
    return {name: decode_payload(entry, name) for name, entry in (case.payload_dict or {}).items()}


def _with_payload(case: Case, tensors: dict[str, torch.Tensor], **changes) -> Case:
    return _rebuild(case, payload={k: encode_payload(t) for k, t in tensors.items()} or None, **changes)


def window(case: Case, target: Target, dim: str, start: int, size: int) -> Case:
    """``case`` with dimension ``dim`` cut to ``[start, start + size)``: payload tensors are
    sliced, injections keep their logical place (those outside the window are dropped)."""
    dims = case.dim
    new_dims = {**dims, dim: size}
    args = {}
    for name, spec in target.args.items():
        ac = case.arg(name)
        if not ac.inject:
            args[name] = ac
            continue
        old_shape = target.shape_of(spec.shape, dims)
        new_shape = target.shape_of(spec.shape, new_dims)
        axes = [i for i, d in enumerate(spec.shape) if d == dim]
        kept = []
        for pos, value in ac.inject:
            idx = [int(i) for i in np.unravel_index(pos, old_shape)]
            for a in axes:
                idx[a] -= start
            if all(0 <= i < n for i, n in zip(idx, new_shape)):
                kept.append((int(np.ravel_multi_index(idx, new_shape)), value))
        args[name] = ArgCase(ac.layout, ac.dist, tuple(sorted(kept, key=lambda x: x[0])))
    tensors = _payload_tensors(case)
    for name, t in tensors.items():
        for a, d in enumerate(target.args[name].shape):
            if d == dim:
                t = t.narrow(a, start, size)
        tensors[name] = t
    return _with_payload(case, tensors, dims=new_dims, args=args)


def _smaller_sizes(n: int, lo: int, multiple_of: int) -> list[int]:
    """Admitted sizes below ``n``: the smallest first, then ``n`` less halving chunks."""
    smallest = max(lo, multiple_of) + (-max(lo, multiple_of)) % multiple_of
    sizes, chunk = [smallest], (n - smallest) // 2
    while chunk >= 1:
        sizes.append(n - chunk)
        chunk //= 2
    sizes.append(n - multiple_of)
    out = []
    for s in sizes:
        s -= s % multiple_of
        if smallest <= s < n and s not in out:
            out.append(s)
    return out


def _value_rank(value) -> int:
    if isinstance(value, str):
        return VALUE_ORDER.index(value)
    return VALUE_ORDER.index(value) if value in VALUE_ORDER[:3] else VALUE_ORDER.index(None)


# the passes: each yields (what it changed, candidate), simplest first ----------------------------

Candidates = Iterator[tuple[str, Case]]


def drop_injections(case: Case, target: Target) -> Candidates:
    """Delta debugging over every injection of every argument: all, halves, quarters, ... one."""
    items = [(name, inj) for name, ac in case.args for inj in ac.inject]
    n, k = len(items), len(items)
    while k >= 1:
        for start in range(0, n, k):
            yield f"dropped {min(k, n - start)} of {n} injections", _with_injections(case, items[:start] + items[start + k:])
        k //= 2


def explicit(case: Case, target: Target) -> Case:
    """``case`` with every argument's logical values written out as its payload."""
    values = logical_values(case, target)
    return _with_payload(case, values)


def shrink_dims(case: Case, target: Target) -> Candidates:
    """Each dimension toward its smallest admitted size, cutting from the end or the start.

    Generated values are drawn afresh for the new shape, so a failure that lives in the
    last rows is lost by any cut; for those, the values are written out explicitly and
    sliced like a payload (not for targets with domain rules: a slice of, say, normalized
    keys is no longer normalized)."""
    writable = target.domain is None and set(target.args) - set(case.payload_dict or {})
    for name, n in case.dims:
        spec = target.dims[name]
        sizes = _smaller_sizes(n, spec.lo, spec.multiple_of)
        for size in sizes:
            yield f"{name} {n} -> {size}", window(case, target, name, 0, size)
            yield f"{name} {n} -> {size} (kept the last {size})", window(case, target, name, n - size, size)
        if writable:
            full = explicit(case, target)
            for size in sizes:
                for start in dict.fromkeys((0, n - size)):
                    yield (f"{name} {n} -> {size} (values written out, kept [{start}:{start + size}])",
                           window(full, target, name, start, size))


def simplify_layouts(case: Case, target: Target) -> Candidates:
    """Each non-contiguous argument to contiguous, else to a simpler layout of its kind."""
    for name, ac in case.args:
        lay = ac.layout
        if lay.kind == "contiguous":
            continue
        simpler = [Layout()]
        if lay.kind == "strided":
            simpler += [Layout("strided", step=lay.step[:i] + (1,) + lay.step[i + 1:])
                        for i, s in enumerate(lay.step) if s > 1]
        elif lay.kind == "offset" and lay.offset > 1:
            simpler.append(Layout("offset", offset=1))
        elif lay.kind == "expanded" and len(lay.dims) > 1:
            simpler += [Layout("expanded", dims=lay.dims[:i] + lay.dims[i + 1:]) for i in range(len(lay.dims))]
        for new in simpler:
            yield f"{name}: layout {lay.to_json()} -> {new.to_json()}", case.with_arg(name, ArgCase(new, ac.dist, ac.inject))


def simplify_dtype(case: Case, target: Target) -> Candidates:
    """The dtype toward ``DTYPE_ORDER``; payload tensors of the case's dtype are converted."""
    here = DTYPE_ORDER.index(case.dtype) if case.dtype in DTYPE_ORDER else len(DTYPE_ORDER)
    for dt in DTYPE_ORDER[:here]:
        if dt not in target.dtypes:
            continue
        tensors = {k: (t.to(torch_dtype(dt)) if target.args[k].dtype == "case" else t)
                   for k, t in _payload_tensors(case).items()}
        yield f"dtype {case.dtype} -> {dt}", _with_payload(case, tensors, dtype=dt)


def simplify_distributions(case: Case, target: Target) -> Candidates:
    """Each argument's distribution toward ``DIST_ORDER``, then its parameters to the defaults."""
    for name, ac in case.args:
        d = ac.dist
        here = DIST_ORDER.index(d.kind)
        options = [Dist(k) for k in DIST_ORDER[:here]] + ([Dist(d.kind)] if d.params else [])
        for new in options:
            yield f"{name}: dist {d.to_json()} -> {new.to_json()}", case.with_arg(name, ArgCase(ac.layout, new, ac.inject))


def simplify_injected_values(case: Case, target: Target) -> Candidates:
    """Each injected value toward 0, 1, -1, then the special values in ``VALUE_ORDER``."""
    for name, ac in case.args:
        for i, (pos, value) in enumerate(ac.inject):
            for simpler in VALUE_ORDER[:_value_rank(value)]:
                if simpler is None:
                    continue
                inject = ac.inject[:i] + ((pos, simpler),) + ac.inject[i + 1:]
                yield f"{name}[{pos}]: {value} -> {simpler}", case.with_arg(name, ArgCase(ac.layout, ac.dist, inject))


def seed_toward_zero(case: Case, target: Target) -> Candidates:
    s = case.seed
    for new in dict.fromkeys((0, 1, s // 2, s - 1)):
        if 0 <= new < s:
            yield f"seed {s} -> {new}", _rebuild(case, seed=new)


def drop_payload(case: Case, target: Target) -> Candidates:
    """An argument's explicit tensor replaced by values generated from the seed."""
    tensors = _payload_tensors(case)
    for name in tensors:
        yield f"{name}: payload -> generated values", _with_payload(case, {k: t for k, t in tensors.items() if k != name})


def zero_payload_elements(case: Case, target: Target) -> Candidates:
    """Delta debugging over the nonzero elements of each payload tensor: set chunks to zero."""
    tensors = _payload_tensors(case)
    for name, t in tensors.items():
        flat = t.reshape(-1)
        nonzero = torch.nonzero(flat != 0).reshape(-1).tolist()
        n = k = len(nonzero)
        while k >= 1 and n / k <= ZERO_CHUNKS:
            for start in range(0, n, k):
                z = flat.clone()
                z[nonzero[start:start + k]] = 0
                yield (f"{name}: zeroed {min(k, n - start)} of {n} nonzero elements",
                       _with_payload(case, {**tensors, name: z.reshape(t.shape)}))
            k //= 2


@dataclass(frozen=True)
class ShrinkPass:
    name: str
    candidates: Callable[[Case, Target], Candidates]


PASSES = tuple(ShrinkPass(f.__name__, f) for f in (
    drop_injections, shrink_dims, simplify_layouts, simplify_dtype, simplify_distributions,
    simplify_injected_values, seed_toward_zero, drop_payload, zero_payload_elements))
# where every new shape or dtype costs a JIT compile (a Triton kernel on a GPU: seconds each),
# the passes that keep the case's dims and dtype come first, on the kernel already compiled,
# so that a budget spent in the compiles still leaves a case without its noise
COMPILED_PASSES = tuple(ShrinkPass(f.__name__, f) for f in (
    drop_injections, simplify_layouts, simplify_distributions, simplify_injected_values,
    seed_toward_zero, drop_payload, shrink_dims, simplify_dtype, zero_payload_elements))


def passes_for(device: str) -> tuple[ShrinkPass, ...]:
    """The pass order for a kernel on ``device``: ``COMPILED_PASSES`` on a GPU."""
    return COMPILED_PASSES if str(device).startswith("cuda") else PASSES


# the driver ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    pass_name: str
    change: str


def summary(case: Case) -> dict:
    """What a reader compares between a case as found and minimized."""
    tensors = {name: entry["shape"] for name, entry in (case.payload_dict or {}).items()}
    return {"hash": case.hash, "dtype": case.dtype, "seed": case.seed, "dims": case.dim,
            "injections": {n: [[p, v] for p, v in ac.inject] for n, ac in case.args if ac.inject},
            "layouts": {n: ac.layout.to_json() for n, ac in case.args if ac.layout.kind != "contiguous"},
            "dists": {n: ac.dist.to_json() for n, ac in case.args if ac.dist != Dist()},
            "payload_elements": sum(int(np.prod(s)) for s in tensors.values()),
            "bytes": len(case.canonical())}


@dataclass(frozen=True)
class Minimized:
    original: Case
    case: Case
    verdict: Verdict
    steps: tuple[Step, ...]
    executions: int
    sweeps: int
    exhausted: bool       # the budget ran out before a fixed point

    def to_json(self) -> dict:
        return {"found": summary(self.original), "minimized": summary(self.case),
                "steps": [[s.pass_name, s.change] for s in self.steps],
                "executions": self.executions, "sweeps": self.sweeps, "fixed_point": not self.exhausted}


def _first_kept(candidates: Candidates, current: Case, same: SameFailure, width: int) -> Iterator[tuple[str, Case]]:
    """The first candidate (in the pass's order) that keeps the failure, if any: asked
    ``width`` at a time (one a worker of the executor)."""
    batch: list[tuple[str, Case]] = []
    for change, candidate in candidates:
        if candidate == current:
            continue
        batch.append((change, candidate))
        if len(batch) == width:
            i = same.first([c for _, c in batch])
            if i is not None:
                yield batch[i]
                return
            batch = []
    if batch:
        i = same.first([c for _, c in batch])
        if i is not None:
            yield batch[i]


def minimize(case: Case, target: Target | None = None, *, signature: Signature | None = None,
             device: str = "cpu", max_executions: int = DEFAULT_BUDGET, reruns: int = 1,
             max_seconds: float | None = None, passes: tuple[ShrinkPass, ...] = PASSES,
             on_step: Callable[[Step, Case], None] | None = None, executor=None,
             check: Check | None = None) -> Minimized:
    """Shrink ``case`` keeping its failure signature (by default the one its first run shows).
    ``executor`` runs the kernel (default: this process); ``max_seconds`` and
    ``max_executions`` bound the work, re-runs included. ``check``: a case's verdict (a gate's,
    which runs the kernel in ``executor`` itself) in place of the oracle's on one call.

    Raises NotReproducible if the case passes, or fails otherwise or flakily."""
    target = target or get_target(case.target)
    target.validate(case)
    executions = 0
    if signature is None:
        first = check(case) if check is not None else run_once(case, target, device, executor)
        executions = 1
        if first.passed:
            raise NotReproducible(f"case {case.hash} for {case.target!r} passes: there is no failure to keep")
        signature = first.signature
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    same = SameFailure(target, signature, device, reruns, max_executions, deadline, executor, check)
    same.executions = executions
    try:
        reproduced = same(case)
    except BudgetSpent:
        reproduced = False
    if not reproduced:
        raise NotReproducible(f"case {case.hash} does not fail as {signature} on each of "
                              f"{1 + reruns} runs; not minimized")
    current, steps, sweeps, exhausted = case, [], 0, False
    width = max(1, getattr(executor, "jobs", 1)) if executor is not None and check is None else 1
    try:
        changed = True
        while changed:
            changed, sweeps = False, sweeps + 1
            for p in passes:
                accepted = True
                while accepted:
                    accepted = False
                    for change, candidate in _first_kept(p.candidates(current, target), current, same, width):
                        current, accepted, changed = candidate, True, True
                        steps.append(Step(p.name, change))
                        if on_step is not None:
                            on_step(steps[-1], current)
    except BudgetSpent:
        exhausted = True
    return Minimized(case, current, same.verdicts[current.hash], tuple(steps), same.executions,
                     sweeps, exhausted)


def minimize_failure(case: Case, target: Target, verdict: Verdict, device: str = "cpu",
                     max_executions: int = DEFAULT_BUDGET, max_seconds: float | None = None, executor=None,
                     passes: tuple[ShrinkPass, ...] | None = None, check: Check | None = None
                     ) -> tuple[Case, Verdict, dict]:
    """What the corpus keeps of a new failure: the minimized case, its verdict and a note
    for the record; the case as found (and why) when it does not reproduce. Without a
    sandboxed ``executor`` a crash or a hang is kept as found (it would take this process
    down). ``check`` as ``minimize`` takes it."""
    if executor is None and verdict.kind in ("crash", "timeout"):
        return case, verdict, {"minimize": {"error": f"a {verdict.kind} is kept as found, not minimized in process"}}
    try:
        m = minimize(case, target, signature=verdict.signature, device=device, max_executions=max_executions,
                     max_seconds=max_seconds, executor=executor, passes=passes or passes_for(device),
                     check=check)
    except NotReproducible as e:
        return case, verdict, {"minimize": {"error": str(e)}}
    return m.case, m.verdict, {"minimize": m.to_json()}
