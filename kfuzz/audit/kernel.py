"""One kernel audited in its oracle process (``audit_kernel``): its build, standard test,
weights contract and gates, each result handed on as it ends.

A solution that builds an extension (``load_inline``) is built first in a confined step of its
own (new processes allowed, no network, writes only beneath its build folder: ``build_policy``,
``kfuzz.kernelbench.build``). Then the standard test runs in a sandboxed worker (reference and
solution in one process, as the accepting harness ran them), then the weights contract
(``weights_checks``, ``lenient_check``) and each gate (``run_one_gate``) with their kernel
programs in a second worker (``kfuzz.executor.Sandboxed``: the oracle and its outputs stay in
the oracle's process); both load the built extension and may not start processes
(``kernel_policy``). A worker that dies in a gate is that case's ``crash`` and the gates go on;
a standard test or build that ends in a sandbox violation, a crash or a timeout is a finding of
that kind (``finding``). A failing gate's first case is saved beneath the results folder
(``case_path``, ``save_gate_case``), minimized first where the gate judges one call.

The oracle's process never runs the solution's source, and a kernel that misbehaves is never
an error here: it is what the record says.
"""
from __future__ import annotations

import contextlib
import resource
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from kfuzz.audit.policy import build_policy, kernel_policy
from kfuzz.audit.verdicts import excused_class

if TYPE_CHECKING:
    from kfuzz.kernelbench.corpus import CorpusEntry


# the kernel side's processes: forked from a forkserver of their own (started by the kernel's
# oracle process, never touching CUDA) with what every kernel needs imported once
KERNEL_PRELOAD = ("kfuzz.programs", "kfuzz.kernelbench", "kfuzz.kernelbench.build", "kfuzz.kernelbench.pch",
                  "kfuzz.kernelbench.cuda_compile")


def finding(verdict) -> dict:
    """A worker's verdict that ended a build or a standard test, as a finding: ``finding`` names
    it (the sandbox's or a limit's kind, ``malformed-answer``, else ``crash`` or ``timeout``)."""
    exc = verdict.exc_type or ""
    named = exc if verdict.kind == "crash" and exc.startswith(("sandbox-", "resource-", "malformed")) else verdict.kind
    return {"finding": named, "kind": verdict.kind, "exc_type": verdict.exc_type,
            "detail": (verdict.detail or "")[:600]}


def audit_kernel(entry: CorpusEntry, device: str, gates: list[str], seed: int,
                 emit: Callable[[str, dict], None], timeout: float = 300.0, cache: str | None = None,
                 policy: dict | None = None, build_only: bool = False, cases: str | None = None,
                 pch: str | None = None, build_timeout: float | None = None, built: dict | None = None) -> None:
    """``_audit_steps``, then (``starts``) the seconds the kernel's workers took to start (a fork,
    CUDA, the kernel's import each; part of the steps' own seconds or between them), those
    seconds by step (``phases``: ``Worker.start_phases``) and how many started; and (``cpu``) the
    CPU seconds of this process (the oracle's: ``oracle_process``, from its fork) and of the
    workers (``workers``, as of each one's last answer; the compilers a build started are the
    build's own ``cpu_seconds``)."""
    pools: list = []
    try:
        _audit_steps(entry, device, gates, seed, emit, timeout, cache, policy, build_only, cases, pch, build_timeout,
                     pools, built)
    finally:
        if pools:
            from kfuzz.workers import add_seconds
            phases: dict[str, float] = {}
            for p in pools:
                add_seconds(phases, p.start_phases)
            emit("starts", {"seconds": round(sum(p.start_seconds for p in pools), 3),
                            "workers": sum(p.spawned for p in pools), "phases": phases})
        usage = resource.getrusage(resource.RUSAGE_SELF)
        emit("cpu", {"oracle_process": round(usage.ru_utime + usage.ru_stime, 3),
                     "workers": round(sum(p.worker_cpu_seconds for p in pools), 3)})


def _audit_steps(entry: CorpusEntry, device: str, gates: list[str], seed: int,
                 emit: Callable[[str, dict], None], timeout: float, cache: str | None, policy: dict | None,
                 build_only: bool, cases: str | None, pch: str | None, build_timeout: float | None,
                 pools: list, built: dict | None = None) -> None:
    """The build (a solution that compiles), the standard test, the weights contract and each gate
    on one kernel, each result handed to ``emit`` as it ends (``phase`` when a step begins). This
    process is the oracle's: it never runs the solution's source. The build runs in a worker of
    its own (``build_policy``), the standard test in another (reference and solution in one
    process, as the original harness ran them); the weights contract and the gates' kernel
    programs in a third (``kfuzz.executor.Sandboxed``) that resolves the same ``kb:`` name, while
    the oracle, the trusted implementation and every comparison run here. ``policy``: overrides
    of the workers' Policy fields; ``build_only``: stop after the build (a build ahead of judging);
    ``cases``: the folder for each failing gate's case (``save_gate_case``); ``pch``: the folder of
    precompiled headers the build may read (``build_policy``); ``build_timeout``: the seconds
    the build may take (default ``timeout``); ``pools``: each executor opened is added to it;
    ``built``: the facts of the solution's build already run in this cache (a build ahead of
    judging, ``build_only``), recorded with ``ahead`` in place of a build step."""
    from kfuzz import sandbox
    from kfuzz.case import Case
    from kfuzz.kernelbench import as_target
    from kfuzz.kernelbench.target import StandardOnly
    from kfuzz.executor import Sandboxed
    from kfuzz.programs import Program, malformed
    pair = entry.pair
    overrides = dict(policy or {})
    def kept(pool):
        pools.append(pool)
        return pool
    # the workers that run the kernel load its built extensions: they read the cache, never write it
    confined = kernel_policy(device, **{"readable": (str(cache),) if cache else (), **overrides})
    bare = StandardOnly(pair.target_name, {"pair": pair})
    nothing = Case(pair.target_name, "float32", 0, ())
    if entry.compiles:
        if built is not None:
            built = {**built, "ahead": True}
        else:
            emit("phase", {"phase": "build"})
            with kept(Sandboxed(bare, device, build_timeout or timeout, build_policy(device, cache, pch, **overrides),
                                resolve={"standard": True}, preload=KERNEL_PRELOAD)) as ex:
                r = ex.run(Program("build", nothing))
            built, v = r.facts, r.verdict
            if v is None and not isinstance(built.get("status"), str):
                v = malformed(pair.target_name, f"the build step's report is malformed: {str(built)[:200]}")
            if v is not None:
                built = {"status": "finding", **finding(v), "seconds": round(r.seconds, 3)}
        emit("build", built)
        if built["status"] == "finding":
            return
        if built["status"] != "built":
            emit("unbuilt", {"error": f"build: {built.get('error', '')}"[:2100]})
            return
    if build_only:
        return
    emit("phase", {"phase": "standard"})
    with kept(Sandboxed(bare, device, timeout, confined, resolve={"standard": True, "prebuilt": True},
                        preload=KERNEL_PRELOAD)) as ex:
        r = ex.run(Program("standard", nothing))
    standard, v = r.facts, r.verdict
    if v is None and not (isinstance(standard.get("passed"), bool) and isinstance(standard.get("reason"), str)):
        v = malformed(pair.target_name, f"the standard test's verdict is malformed: {str(standard)[:200]}")
    if v is not None:
        # the standard test's worker was stopped (a sandbox violation, a limit), died or hung
        f = finding(v)
        emit("standard", {"passed": False, "reason": f"{f['finding']}: {f['detail']}"[:500], "trials": 0, **f})
        return
    exhausted = sandbox.resource_kind(None, standard["reason"]) if not standard["passed"] else None
    if exhausted is not None:   # the solution raised running out of a limited resource: a finding
        standard = {**standard, "finding": exhausted, "kind": "crash", "exc_type": exhausted,
                    "detail": standard["reason"][:600]}
    emit("standard", standard)
    if standard["reason"].startswith("compile"):
        # the solution does not build or import here: nothing for the gates to judge
        emit("unbuilt", {"error": standard["reason"][:1000]})
        return
    emit("phase", {"phase": "gates"})
    start = time.monotonic()
    try:
        target = as_target(pair, device, weights="seed", solution=False)
    except Exception as e:
        emit("adapter", {"error": f"{type(e).__name__}: {e}"[:1000], "exc_type": error_kind(e)})
        return
    bench = target.options["bench"]
    # the reference has float weights the case does not set: G07 is n/a (kfuzz.kernelbench.float_weights)
    params = bool(target.options.get("no_exact_answers"))
    with kept(Sandboxed(target, device, timeout, confined,
                        resolve={"weights": "seed", "device": device, "prebuilt": True}, preload=KERNEL_PRELOAD)) as ex:
        try:
            w = ex.run(Program("weights", Case(target.name, "float32", 0, tuple(sorted(bench.contract.dims.items())))))
            status = w.facts.get("status") if w.verdict is None else None
            if not isinstance(status, str):
                raise RuntimeError(w.verdict.detail if w.verdict is not None else "no weights status came back")
            # the kernel process's word (it ran ModelNew to load the weights)
            flags = w.facts.get("flags")
            # "n/a": no ModelNew to load into (it does not construct; its standard test says why)
            kind = "fail" if status.startswith("seed only") else "n/a" if status.startswith("n/a") else status
            record_weights = {"status": kind, "detail": status,
                              "flags": [str(f)[:100] for f in flags[:10]] if isinstance(flags, list) else [],
                              "dims": dict(bench.contract.dims), "fixed": list(bench.contract.fixed),
                              "params": params, "seconds": round(time.monotonic() - start, 3)}
            emit("weights", record_weights)
        except Exception as e:
            emit("weights", {"status": "error", "detail": f"{type(e).__name__}: {e}"[:1000], "params": params,
                             "exc_type": error_kind(e)})
            status = None
        stack = contextlib.ExitStack()
        gate_ex = ex

        def executor(weights: str, on=target):
            """A sandboxed worker whose solution has ``weights``, open until the gates end."""
            return stack.enter_context(kept(Sandboxed(on, device, timeout, confined, preload=KERNEL_PRELOAD,
                                                      resolve={"weights": weights, "device": device,
                                                               "prebuilt": True})))
        if status in ("exact", "by position") and "G01" in gates:
            # which weights the gates judge with, and whether the solution keeps up with a checkpoint
            checks, gate_ex = weights_checks(pair, target, device, seed, ex, executor)
            emit("weights", {**record_weights, "checks": checks})
        elif isinstance(status, str) and status.startswith("seed only") and "G01" in gates:
            # whether the numbers follow Model's checkpoint loaded with strict=False
            emit("weights", {**record_weights, "checks": {"lenient": lenient_check(pair, device, seed, executor)}})
        budget = {"minimize": MINIMIZE_SECONDS}     # shared by the kernel's failing gates
        with stack:
            for gid in gates:
                run_one_gate(gid, target, seed, device, gate_ex, emit, cases, budget)


def error_kind(e: Exception) -> str:
    """An error's ``exc_type`` in a record: the resource it says ran out or is taken (a GPU's
    memory, a GPU busy: ``ended_by_gpu_state`` reads them), else its type."""
    from kfuzz.sandbox import resource_kind
    return resource_kind(type(e).__name__, str(e)) or type(e).__name__


def run_one_gate(gid: str, target, seed: int, device: str, executor, emit, cases: str | None = None,
                 budget: dict | None = None) -> None:
    """One gate on the audited kernel, its result emitted as a ``gate`` record (``error`` when
    the gate itself could not run; ``kind`` its first failing case's, ``failing_kinds`` how
    many failing cases of each kind); a failure's first case saved beneath ``cases``
    (``save_gate_case``), named in the record's ``case_file``. ``budget["minimize"]``: the
    seconds left for minimizing (spent here)."""
    from kfuzz.gates import GATES, run_gate
    excused: dict[str, int] = {}
    failing: dict[str, int] = {}

    def tally(_gid, _index, _seconds, verdict) -> None:
        cls = excused_class(verdict)
        if cls is not None:
            excused[cls] = excused.get(cls, 0) + 1
        if not verdict.passed:
            failing[verdict.kind] = failing.get(verdict.kind, 0) + 1
    try:
        r = run_gate(GATES[gid], target, seed=seed, out=None, device=device, executor=executor, on_case=tally)
        d = r.to_json()
        if excused:
            d["excused"] = excused
        if failing:
            d["failing_kinds"] = failing
        d.pop("saved", None)
        d["kind"] = r.first_failure[1].kind if r.first_failure else None
        d["exc_type"] = r.first_failure[1].exc_type if r.first_failure else None
        d["reason"] = d["reason"][:600]
    except Exception as e:    # the gate itself could not run (the reference failed, say)
        d = {"gate": gid, "status": "error", "reason": f"{type(e).__name__}: {e}"[:600],
             "where": traceback.format_exc(limit=-3)[-800:],
             "exc_type": error_kind(e)}
        r = None
    if r is not None and r.first_failure is not None and cases:
        try:
            start = time.monotonic()
            left = (budget or {}).get("minimize", MINIMIZE_SECONDS)
            d.update(save_gate_case(cases, target, gid, *r.first_failure, device, seed, executor, left))
            d["minimize_seconds"] = round(time.monotonic() - start, 3)
            if budget is not None:
                budget["minimize"] = left - (time.monotonic() - start)
        except Exception as e:     # the verdict stands; only its replayable copy is missing
            d["case_error"] = f"{type(e).__name__}: {e}"[:300]
    emit("gate", d)


CASES = "cases"               # beneath the results folder: each failing gate's case, one file a kernel and gate
MINIMIZE_SECONDS = 20.0       # what minimizing a kernel's failing cases may take, all its gates together
MINIMIZE_EXECUTIONS = 60


def case_path(cases: str | Path, target_name: str, gid: str) -> Path:
    """Where the audit keeps a kernel's failing case of gate ``gid``: ``<cases>/<target folder>/<gid>.case.zst``."""
    from kfuzz.corpus import target_folder
    return Path(cases) / target_folder(target_name) / f"{gid}.case.zst"


def save_gate_case(cases: str | Path, target, gid: str, case, verdict, device: str, seed: int, executor,
                   max_seconds: float = MINIMIZE_SECONDS) -> dict:
    """Save a gate's failing ``case`` so that ``kfuzz verify --replay`` runs it alone through the
    gate again, minimized first (``kfuzz.minimize.minimize_failure``, at most ``max_seconds``, the
    kernel in ``executor``; kept as found with under 2 s, or for a crash or a timeout). The
    minimizer's predicate is the gate's own verdict on each candidate (``kfuzz.gates.gate_check``,
    as the replay judges it, with the gate's rules: a layout's failure that the same values
    contiguous share is G02's, an injection outside the reference's domain passes, a NaN that
    only an exact zero spreads is allowed), so the case kept fails that gate as the one found did;
    where judging a candidate raises, the case is kept as found and the record says why.
    Returns the record's ``case_file`` and ``minimized``."""
    from kfuzz.case import encode
    from kfuzz.corpus import make_record, write_atomic
    from kfuzz.gates import gate_check
    note: dict = {"minimize": {"skipped": f"a {verdict.kind} is kept as found"}}
    if max_seconds < 2:
        note = {"minimize": {"skipped": "the kernel's minimizing time is spent; kept as found"}}
    elif verdict.kind not in ("crash", "timeout"):
        from kfuzz.minimize import minimize_failure
        try:
            case, verdict, note = minimize_failure(case, target, verdict, device, max_executions=MINIMIZE_EXECUTIONS,
                                                   max_seconds=max_seconds, executor=executor,
                                                   check=gate_check(gid, target, device, executor))
        except Exception as e:     # noqa: BLE001 - judging a candidate failed: the case found still replays
            note = {"minimize": {"error": f"{type(e).__name__}: {e}"[:300] + "; kept as found"}}
    path = case_path(cases, target.name, gid)
    resolve = judged_resolve(executor, target)
    write_atomic(path, encode(case, make_record(verdict, "fail", device, gate=gid, gate_seed=seed, **note,
                                                **({"resolve": resolve} if resolve else {}))))
    return {"case_file": str(path), "minimized": "error" not in note.get("minimize", {}) and "skipped" not in
            note.get("minimize", {})}


def judged_resolve(executor, target) -> dict | None:
    """The weights the gates judged the solution with (the gate executor's: ``seed``, or ``none``
    where the weights contract found a derived parameter) and the pair's hash, as a case record's
    ``resolve``, so that ``kfuzz verify --replay`` builds that solution again, and no other."""
    resolve = getattr(executor, "resolve", None) or getattr(executor, "target", target).options.get("resolve")
    sha = (target.options.get("resolve") or {}).get("sha")
    return ({"weights": resolve["weights"], **({"sha": sha} if sha else {})}
            if resolve and "weights" in resolve else None)


def _first_reference_case(target, seed: int, device: str, executor):
    """G01's first case (a fresh seed at the nominal shape) on ``executor``: (case, verdict)."""
    from kfuzz.gates import GATES
    gate = type(GATES["G01"])()
    case = next(iter(gate.cases(target, seed)))
    v = gate.judge_case(target, case, device, executor=executor)
    return v if isinstance(v, tuple) else (case, v)


def weights_checks(pair, target, device: str, seed: int, loaded, executor: Callable) -> tuple[dict, object]:
    """Two checks of a solution whose ``Model`` weights loaded (``exact`` or ``by position``),
    each on G01's first case; returns them (``status`` pass/fail, ``detail``) and the executor the
    gates then judge with. ``loaded``: the executor whose solution has ``Model``'s weights;
    ``executor(weights, target)``: a new one whose solution's weights are ``weights``
    (``kfuzz.kernelbench.as_target``).

    - ``derived``: the case fails with the loaded weights and passes with the solution's own
      same-seed weights (``weights="none"``): a parameter the solution derives in ``__init__`` (a
      bias minus a constant, a pre-transposed weight) does not follow a loaded checkpoint. The
      finding is the weights contract's (``W``), and the gates judge the same-seed solution, so
      the one cause does not fail G01-G04 together.
    - ``reload``: where the case passes with the loaded weights: one forward, then ``Model``'s
      checkpoint of another seed (``RELOAD_SEED``) loaded into the solution and the reference
      alike, and the case again (``weights="reload"``). A solution that copied its weights in
      ``__init__`` or on its first forward answers with the old ones: stale.

    Each executor but the one returned is closed when its check ends (``loaded`` too, where the
    gates judge another): on a GPU shared by several kernels, a worker left idle through the
    gates keeps a CUDA context and its cached memory from the others."""
    from kfuzz.kernelbench import as_target
    checks: dict = {}
    case, first = _first_reference_case(target, seed, device, loaded)
    gate_ex = loaded
    if not first.passed:
        own = executor("none")
        _, same = _first_reference_case(target, seed, device, own)
        (loaded if same.passed else own).close()
        if same.passed:
            gate_ex = own
            checks["derived"] = {"status": "fail", "detail": (
                f"G01 case {case.seed}: fails with Model's weights loaded ({first.kind}: {first.detail[:200]}) and "
                f"passes with the solution's own same-seed weights: a parameter derived from the weights in "
                f"__init__ does not follow a loaded checkpoint (the gates judge the same-seed solution)")[:800]}
        else:
            checks["derived"] = {"status": "pass", "detail": "G01's first case fails with the same-seed weights too: "
                                                             "the kernel's own failure, judged by the gates"}
        checks["reload"] = {"status": "n/a", "detail": "G01's first case fails with the loaded weights"}
        return checks, gate_ex
    checks["derived"] = {"status": "pass", "detail": "G01's first case passes with Model's weights loaded"}
    other = as_target(pair, device, weights="reload", solution=False)
    with executor("reload", other) as reloaded:
        case, again = _first_reference_case(other, seed, device, reloaded)
    checks["reload"] = ({"status": "pass", "detail": "after a first forward, Model's checkpoint of another seed "
                                                     "loaded: G01's first case passes"} if again.passed else
                        {"status": "fail", "detail": (
                            f"after a first forward, Model's checkpoint of another seed loaded into the solution "
                            f"and the reference: G01 case {case.seed} fails ({again.kind}: {again.detail[:200]}); "
                            f"the solution answers with weights copied before the load (stale)")[:800]})
    return checks, gate_ex


def lenient_check(pair, device: str, seed: int, executor: Callable) -> dict:
    """For a solution whose state_dict does not take ``Model``'s strictly (``seed only``): where
    it holds every one of ``Model``'s names at its shape and names of its own besides, the
    ``reload`` check of ``weights_checks`` with each load ``strict=False`` (``weights="lenient"``,
    ``kfuzz.kernelbench.weights.load_shared``): ``Model``'s checkpoint loaded, one forward, then
    ``Model``'s checkpoint of another seed (``RELOAD_SEED``) loaded, and G01's first case against
    that checkpoint's reference. ``pass``: the numbers follow the checkpoint, only the strict load
    fails (the own names hold constants); ``fail``: the solution answers with copies of the
    weights made in ``__init__`` or on its first forward (a transposed or pre-scaled weight under
    a name of its own), stale after the load; ``n/a`` where a name of ``Model``'s is missing
    (renamed weights do not load by name at all)."""
    from kfuzz.kernelbench import as_target
    other = as_target(pair, device, weights="lenient", solution=False)
    with executor("lenient", other) as lenient:     # closed once its one case is judged
        case, verdict = _first_reference_case(other, seed, device, lenient)
    if verdict.kind == "exception" and verdict.exc_type == "WeightsContractError":
        return {"status": "n/a", "detail": verdict.detail[:300]}
    if verdict.passed:
        return {"status": "pass", "detail": (
            "after a first forward, Model's checkpoint of another seed loaded with strict=False: G01's first "
            "case passes; the solution keeps no copy of the weights, only a strict load fails")}
    return {"status": "fail", "detail": (
        f"after a first forward, Model's checkpoint of another seed loaded with strict=False: G01 case "
        f"{case.seed} fails ({verdict.kind}: {verdict.detail[:200]}); the solution answers with copies of "
        f"the weights made before the load (stale)")[:800]}
