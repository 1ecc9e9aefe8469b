"""The audit: accepted KernelBench kernels through the standard test and the gates, one record each.

A corpus is a file or folder of KernelBench pairs, read by ``kfuzz.kernelbench.read_corpus``
(its formats are described there).

Every kernel gets its own process, forked from a forkserver that never touches
CUDA: the oracle's side, which never runs the solution's source. A solution that builds
an extension (``load_inline``) is built first in a confined step of its own (new
processes allowed, no network, writes only beneath its build folder:
``kfuzz.kernelbench.build``). Then the standard test runs in a sandboxed worker
(reference and solution in one process, as the accepting harness ran them), then the
weights contract and each gate with their kernel programs in a second worker
(``kfuzz.executor.Sandboxed``: the oracle and its outputs stay in the oracle's process);
both load the built extension and may not start processes. Each result is streamed as
it ends. A worker that dies in a gate is that case's ``crash`` and the gates go on; a
standard test or build that ends in a sandbox violation, a crash or a timeout is a
finding of that kind. The kernel's processes are one process group, killed after
``timeout`` seconds (the build gets its own limit, ``build_timeout``; what finished is kept) or once
its record is written. CUDA extensions built by ``load_inline`` go to
``TORCH_EXTENSIONS_DIR`` = ``<cache>/<hash of the solution's source>``, so a rerun never
rebuilds one and kernels with the same extension name never collide; ``jobs`` processes
build at once, each with ``MAX_JOBS`` ninja jobs.

Untrusted code runs only under an operating-system sandbox layer: ``run_audit`` probes
what ``kfuzz.sandbox.confine`` gets here for the kernels' policy (``confinement``) and
refuses (``KfuzzError``) when network, writes or processes would not be blocked, unless
``allow_unconfined``.

Results are appended to ``<out>/results.jsonl`` by the supervising process only, one
line a kernel, written with one ``write`` on an ``O_APPEND`` descriptor. Each line
carries an HMAC-SHA256 (``hmac``) under a key kept outside the results folder
(``results_key``: ``$KFUZZ_AUDIT_KEY``, else ``~/.config/kfuzz/audit.key``, made on
first use, mode 0600) that no kernel process is handed; ``read_results`` refuses a line
whose HMAC fails (or that has none, unless ``trust_unsigned``) and says which
(``Results.refused``). A rerun skips the keys already there (a torn last line is ignored
and redone).

Kernels that misbehave are never errors: they are records.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import multiprocessing
import os
import resource
import shutil
import signal
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from kfuzz.errors import KfuzzError

if TYPE_CHECKING:
    from kfuzz import sandbox
    from kfuzz.kernelbench.corpus import CorpusEntry

RESULTS = "results.jsonl"
# error/bound beyond which no plausible tolerance explains a bound failure
BROKEN_RATIO = 1e3
# failure kinds that no threshold explains away, whatever gate met them
TOLERANCE_FREE_KINDS = ("exception", "crash", "timeout", "contract", "nonfinite", "nondeterminism",
                        "mutation", "stale")


# one kernel, in its own process ------------------------------------------------------------------

# the kernel side's processes: forked from a forkserver of their own (started by the kernel's
# oracle process, never touching CUDA) with what every kernel needs imported once
KERNEL_PRELOAD = ("kfuzz.programs", "kfuzz.kernelbench", "kfuzz.kernelbench.build")
KERNEL_MEMORY = 16 << 30    # on the CPU: address space a kernel's worker may add (a level-3 network's models)
# what the kernels' workers must have blocked by an OS layer (``confinement``)
OS_LAYERS = ("network", "writes", "processes")


def kernel_policy(device: str, **overrides) -> "sandbox.Policy":
    """The confinement of the workers that run an audited kernel (its standard test, weights
    contract and gates): ``Policy.for_device``, with memory as a network's models need on the CPU
    (``KERNEL_MEMORY``; none on CUDA, whose driver reserves more). No new processes: an extension
    was built beforehand (``build_policy``). ``overrides``: Policy fields to change; ``readable``
    adds to the device's readable paths."""
    from kfuzz import sandbox
    memory = None if str(device).startswith("cuda") else KERNEL_MEMORY
    base = sandbox.Policy.for_device(device, memory=memory)
    if "readable" in overrides:     # more paths beside the device's (CUDA: the toolchain)
        overrides["readable"] = base.readable + tuple(overrides["readable"])
    return dataclasses.replace(base, **overrides)


def build_policy(device: str, folder: str | None, pch: str | None = None, **overrides) -> "sandbox.Policy":
    """The confinement of a solution's build step: new processes (ninja, the compiler), no
    network, writes only beneath its extension ``folder`` (and its private directory), reads of
    the toolchain (``sandbox.toolchain``: a compiler under a prefix of its own, such as
    the H200 machine's ``/opt/gcc/bin/g++`` script, is read by its shell) and of the folder of
    precompiled headers ``pch`` (the compiler finds torch's header there first: unreadable, every
    build that uses it fails), memory as a compiler needs, on every device (the build touches no
    driver)."""
    from kfuzz import sandbox
    return sandbox.Policy(**{"memory": None, "processes": True, "network": False, "confine_writes": True,
                             "writable": (folder,) if folder else (),
                             "readable": sandbox.toolchain() + ((pch,) if pch else ()), **overrides})


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
    from kfuzz.gates import GATES, run_gate
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
        emit("adapter", {"error": f"{type(e).__name__}: {e}"[:1000]})
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
                             "exc_type": _error_kind(e)})
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


def _error_kind(e: Exception) -> str:
    """An error's ``exc_type`` in a record: the resource it says ran out (a GPU's memory, which
    ``out_of_device_memory`` reads), else its type."""
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
             "exc_type": _error_kind(e)}
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


# cases a gate passes though the kernel differs from the oracle, because the reference itself
# cannot do better or the inputs leave its domain (the detail's start -> the class): arguable
EXCUSED = (("outside the contract", "shared-exception"), ("outside the reference's domain", "outside-domain"),
           ("reference-limited", "reference-limited"))


def excused_class(verdict) -> str | None:
    """The class of a passing verdict that excuses a difference (``EXCUSED``; a NaN the reference
    spreads through exact zeros is ``zero-spread``), else None."""
    if not verdict.passed or not verdict.detail:
        return None
    if "do not depend on the injected value" in verdict.detail:
        return "zero-spread"
    return next((cls for start, cls in EXCUSED if verdict.detail.startswith(start)), None)


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
    gate again. A failure of a bound gate (G01-G04: one call judged against the bound, the
    minimizer's own predicate) is minimized first (``kfuzz.minimize.minimize_failure``, at most
    ``max_seconds``, the kernel in ``executor``; kept as found with under 2 s); others are kept as
    found. Returns the record's ``case_file`` and ``minimized``."""
    from kfuzz.case import encode
    from kfuzz.corpus import make_record, write_atomic
    from kfuzz.gates import GATES
    note: dict = {"minimize": {"skipped": "the gate judges more than one call; kept as found"}}
    if max_seconds < 2:
        note = {"minimize": {"skipped": "the kernel's minimizing time is spent; kept as found"}}
    elif not GATES[gid].tolerance_free and verdict.kind not in ("crash", "timeout"):
        from kfuzz.minimize import minimize_failure
        case, verdict, note = minimize_failure(case, target, verdict, device, max_executions=MINIMIZE_EXECUTIONS,
                                               max_seconds=max_seconds, executor=executor)
    path = case_path(cases, target.name, gid)
    resolve = judged_resolve(executor, target)
    write_atomic(path, encode(case, make_record(verdict, "fail", device, gate=gid, gate_seed=seed, **note,
                                                **({"resolve": resolve} if resolve else {}))))
    return {"case_file": str(path), "minimized": "error" not in note.get("minimize", {}) and "skipped" not in
            note.get("minimize", {})}


def judged_resolve(executor, target) -> dict | None:
    """The weights the gates judged the solution with (the gate executor's: ``seed``, or ``none``
    where the weights contract found a derived parameter), as a case record's ``resolve``, so
    that ``kfuzz verify --replay`` builds that solution again."""
    resolve = getattr(executor, "resolve", None) or getattr(executor, "target", target).options.get("resolve")
    return {"weights": resolve["weights"]} if resolve and "weights" in resolve else None


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
    ``kfuzz.kernelbench.target.load_shared``): ``Model``'s checkpoint loaded, one forward, then
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


def _ends_with(pid: int, started: int | None) -> None:
    """From now on, this process's group (the kernel's oracle process, its zygote and workers)
    is killed within a second of process ``pid`` (the audit's, started at ``started``) ending,
    however it ends (SIGKILL included): no kernel runs on unsupervised."""
    import threading
    from kfuzz.launcher import running

    def watch() -> None:
        while running(pid, started):
            time.sleep(1.0)
        os.killpg(0, signal.SIGKILL)
    threading.Thread(target=watch, daemon=True, name="kfuzz-audit-supervisor").start()


def _child(conn, entry: CorpusEntry, device: str, gates: list[str], seed: int, cache: str | None,
           threads: int, max_jobs: int, timeout: float, policy: dict | None, pch: str | None = None,
           cases: str | None = None, build_timeout: float | None = None, stubs: str | None = None,
           slim: bool = True, build_only: bool = False, supervisor: tuple[int, int | None] | None = None,
           built: dict | None = None) -> None:
    """The kernel's oracle process (``audit_kernel``), sending what it finds through ``conn``;
    ``supervisor``: the audit's process (pid, start), which it does not outlive (unless its start
    could not be read: then it is not watched)."""
    os.setsid()     # one process group a kernel: its workers and their forkserver end with it
    from kfuzz.kernelbench.build import PCH_ENV, SLIM_ENV
    if pch:
        os.environ[PCH_ENV] = pch
    os.environ[SLIM_ENV] = "1" if slim else "0"
    if stubs:       # Triton's driver stubs, built once by the audit: each worker copies them
        from kfuzz.sandbox import STUBS_ENV
        os.environ[STUBS_ENV] = stubs
    if cache and entry.pair is not None:
        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(cache, entry.pair.custom_sha)
        # made now: a worker may write only beneath directories that exist when it is confined
        os.makedirs(os.environ["TORCH_EXTENSIONS_DIR"], exist_ok=True)
    os.environ["MAX_JOBS"] = str(max_jobs)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import warnings
    import torch
    import torch._dynamo  # noqa: F401  (model code and G10 import it: once here, not in each worker)
    import kfuzz.kernelbench, kfuzz.kernelbench.build, kfuzz.programs  # noqa: F401,E401  (preloaded)
    from kfuzz.workers import fork_server_here
    torch.set_num_threads(threads)
    warnings.simplefilter("ignore")     # the kernels' own warnings are not the audit's output
    # the kernel's workers are forked from a copy of this process as it is now (all of the above
    # set): everything imported, no CUDA yet, nothing of the oracle's, no pipe to the audit's parent
    fork_server_here(close=(conn.fileno(),))
    if supervisor is not None and supervisor[1] is not None:    # a thread, started after the zygote's fork
        _ends_with(*supervisor)
    try:
        audit_kernel(entry, device, gates, seed, lambda kind, d: conn.send((kind, d)), timeout,
                     os.environ.get("TORCH_EXTENSIONS_DIR"), policy, build_only, cases, pch, build_timeout, built)
    except BaseException as e:   # what audit_kernel did not catch still reaches the record
        conn.send(("error", {"error": f"{type(e).__name__}: {e}"[:1000], "exc_type": _error_kind(e)}))
    conn.send(("done", {}))
    conn.close()
    os._exit(0)     # skip interpreter teardown: a broken extension may crash it


def base_record(entry: CorpusEntry) -> dict:
    p = entry.pair
    rec = {"key": entry.key, "expect": entry.expect}
    if p is not None:
        rec.update(name=p.name, model=p.model, level=p.level, problem=p.problem, sha=p.sha,
                   target=p.target_name, compiles=entry.compiles, cpu_runnable=entry.cpu_runnable,
                   mode="eval" if p.eval_mode else "train")
    if entry.skip:
        rec["skip"] = entry.skip
    return rec


def shares_memory(device: str) -> bool:
    """Whether kernels audited at once share ``device``'s memory: a GPU's, where one kernel's
    allocation can fail for what the others hold (on the CPU each worker has a limit of its own)."""
    return str(device).startswith("cuda")


def out_of_device_memory(record: dict) -> bool:
    """Whether the kernel's standard test, weights contract, a gate or its whole run (``error``)
    ended for want of memory (``resource-memory``)."""
    from kfuzz import sandbox
    parts = [record.get("standard"), record.get("weights"), record.get("error"), *record.get("gates", {}).values()]
    return any(isinstance(p, dict) and sandbox.MEMORY in (p.get("exc_type"), p.get("finding")) for p in parts)


class _Running:
    def __init__(self, ctx, entry, args, timeout: float, build_only: bool = False, alone: bool = False,
                 build_timeout: float | None = None, built: dict | None = None):
        """``timeout``: the kernel's limit; ``build_timeout``: its build's (default ``timeout``),
        from the start of a solution that compiles until its next step begins; ``built``: the
        facts of its build run ahead (``audit_kernel``'s ``built``)."""
        self.entry, self.start, self.timeout, self.alone = entry, time.monotonic(), timeout, alone
        builds = entry.compiles and built is None
        self.deadline = self.start + ((build_timeout or timeout) if builds else timeout)
        # kernel_side: where the solution ran (records before it ran it beside the oracle);
        # trusted_on: where the gates ran the reference in float32, the trusted implementation
        # that scales the bound (where the kernel ran; a record without it ran it on the CPU)
        self.record = {**base_record(entry), "gates": {}, "device": args[0], "kernel_side": "sandboxed workers",
                       "trusted_on": args[0], "timeout": timeout}
        self.conn, child = ctx.Pipe(duplex=False)
        # not a daemon: it starts the kernel's workers (run_audit kills it, whatever happens)
        from kfuzz.launcher import started_at
        supervisor = (os.getpid(), started_at(os.getpid()))
        self.proc = ctx.Process(target=_child, args=(child, entry, *args),
                                kwargs={"build_only": build_only, "supervisor": supervisor, "built": built},
                                daemon=False,
                                name=f"kfuzz-{'build' if build_only else 'audit'}-{entry.key}")
        self.proc.start()
        child.close()

    def take(self, kind: str, d: dict) -> None:
        if kind == "gate":
            self.record["gates"][d["gate"]] = d
        elif kind == "phase":
            if self.record.get("phase") == "build":    # the build had its own limit
                self.deadline = time.monotonic() + self.timeout
            self.record["phase"] = str(d.get("phase"))
        elif kind in ("build", "standard", "weights", "adapter", "unbuilt", "error", "starts", "cpu"):
            self.record[kind] = d

    def ended(self) -> str | None:
        """How the kernel's process has ended, taking what it sent: "done" (its record handed
        up), "crash" (the process or its pipe gone first) or "timeout" (past its deadline); None
        while it runs."""
        try:
            while self.conn.poll():
                kind, d = self.conn.recv()
                if kind == "done":
                    return "done"
                self.take(kind, d)
        except (EOFError, OSError):
            return "crash"
        if not self.proc.is_alive() and not self.conn.poll():
            return "crash"
        if time.monotonic() >= self.deadline:
            return "timeout"
        return None

    def kill(self) -> None:
        """End the kernel's process group: its oracle process, the workers and their forkserver."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.kill()

    def end(self, how: str | None) -> dict:
        if how is not None:
            self.record["ended"] = how
        self.record["seconds"] = round(time.monotonic() - self.start, 3)
        return self.record


# the results file: signed by the supervising process -------------------------------------------

KEY_ENV = "KFUZZ_AUDIT_KEY"


def key_path() -> Path:
    """Where the results' key lives: ``$KFUZZ_AUDIT_KEY``, else ``$XDG_CONFIG_HOME/kfuzz/audit.key``
    (``~/.config/kfuzz/audit.key``)."""
    if os.environ.get(KEY_ENV):
        return Path(os.environ[KEY_ENV])
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "kfuzz" / "audit.key"


def results_key(path: str | Path | None = None, create: bool = True) -> bytes:
    """The key that signs results (``key_path`` unless ``path``): made on first use (32 random
    bytes in hex, mode 0600, in a folder of mode 0700) if ``create``. Refuses (``KfuzzError``) a
    missing key when not ``create``, and a file that is not a key."""
    p = Path(path) if path is not None else key_path()
    if not p.exists():
        if not create:
            raise KfuzzError(f"{p}: no audit key (results are verified with the key that signed them)")
        p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:     # another audit made it first
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(os.urandom(32).hex() + "\n")
    for _ in range(50):             # another audit may be writing it this instant
        try:
            text = p.read_text().strip()
        except OSError as e:
            raise KfuzzError(f"{p}: cannot read the audit key ({e.strerror})") from None
        if text:
            break
        time.sleep(0.01)
    if len(text) < 32:
        raise KfuzzError(f"{p}: not an audit key (want at least 32 characters of secret, got {len(text)})")
    return text.encode()


def _mac(key: bytes, record: dict) -> str:
    body = json.dumps({k: v for k, v in record.items() if k != "hmac"}, sort_keys=True, default=str)
    return hmac.new(key, b"kfuzz-audit-record\0" + body.encode(), hashlib.sha256).hexdigest()


class Results(dict):
    """Records by key, the last valid line of a key winning (a retried kernel appends a new one);
    ``refused``: (line number, why) for each line that is not a valid signed record (a torn line,
    no HMAC, an HMAC that fails); ``unsigned``: lines taken without an HMAC (``trust_unsigned``);
    ``unsigned_keys``: the keys whose record taken is such a line."""

    def __init__(self):
        super().__init__()
        self.refused: list[tuple[int, str]] = []
        self.unsigned = 0
        self.unsigned_keys: set[str] = set()


def read_results(path: str | Path, key: bytes | None = None, trust_unsigned: bool = False) -> Results:
    """The records of a results file by key (``Results``), each checked against its HMAC under
    ``key`` (by default ``results_key()``; with no key, every signed line is refused). Lines
    without an HMAC are refused unless ``trust_unsigned`` (records made before results were
    signed); a line whose HMAC fails is always refused."""
    if key is None:
        try:
            key = results_key(create=False)
        except KfuzzError:
            key = None
    out = Results()
    path = Path(path)
    if not path.is_file():
        return out
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            name = rec["key"]
            if not isinstance(name, str):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            out.refused.append((n, "not a record (a torn or foreign line)"))
            continue
        mac = rec.pop("hmac", None)
        if mac is None:
            if not trust_unsigned:
                out.refused.append((n, f"{name}: no HMAC (not written by kfuzz audit under a key)"))
                continue
            out.unsigned += 1
        elif key is None or not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(key, rec)):
            out.refused.append((n, f"{name}: the HMAC does not match (forged or altered, or another key's)"))
            continue
        if mac is None:
            out.unsigned_keys.add(name)
        else:
            out.unsigned_keys.discard(name)
        out[name] = rec
    return out


def needs_retry(record: dict, entry: CorpusEntry | None = None) -> bool:
    """A record of a run that did not finish (``judge_record``'s ``incomplete``: killed for time,
    or out of a shared GPU's memory; a gate that could not run, or an error that ended the
    kernel's run), or one made before the audit kept the accepting harness's train/eval mode, of
    a reference that the mode changes."""
    return judge_record(record)["incomplete"] or "error" in record or any(
        g.get("status") == "error" for g in record.get("gates", {}).values()) or (
        "mode" not in record and entry is not None and entry.mode_sensitive)


def done_keys(out: str | Path, retry: bool = False, entries: Iterable[CorpusEntry] = (), key: bytes | None = None,
              trust_unsigned: bool = False, redo_unsigned: bool = False) -> set[str]:
    """Keys validly recorded in ``out``'s results; with ``retry``, less those ``needs_retry``; with
    ``redo_unsigned``, less those whose record carries no HMAC."""
    by_key = {e.key: e for e in entries}
    results = read_results(Path(out) / RESULTS, key, trust_unsigned)
    return {k for k, r in results.items() if not (retry and needs_retry(r, by_key.get(k)))
            and not (redo_unsigned and k in results.unsigned_keys)}


def _signed_lines(path: Path) -> int:
    """How many lines of a results file carry an HMAC (read as text: a torn line counts if it does)."""
    if not path.is_file():
        return 0
    with open(path, errors="replace") as f:
        return sum('"hmac":' in line for line in f)


def append_record(out: str | Path, record: dict, key: bytes | None = None) -> None:
    """Append ``record`` to ``out``'s results, signed with ``key`` (by default ``results_key()``)."""
    key = key if key is not None else results_key()
    Path(out).mkdir(parents=True, exist_ok=True)
    line = (json.dumps({**record, "hmac": _mac(key, record)}, sort_keys=True, default=str) + "\n").encode()
    path = Path(out) / RESULTS
    if path.is_file() and path.stat().st_size:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                line = b"\n" + line      # a write cut short before: end its torn line first
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


# the machine's sandbox --------------------------------------------------------------------------

def _context():
    """The forkserver context the audit's processes come from (its server never touches CUDA)."""
    ctx = multiprocessing.get_context("forkserver")
    # torch._dynamo: G10 and model code import it on first use, 4 s in every kernel process
    ctx.set_forkserver_preload(["kfuzz.audit", "kfuzz.kernelbench", "kfuzz.gates", "kfuzz.programs", "torch._dynamo"])
    return ctx


def _probe(conn, policy: "sandbox.Policy", workdir: str) -> None:
    from kfuzz import sandbox
    try:
        conn.send(sandbox.confine(policy, workdir))
    finally:
        conn.close()


def confinement(device: str = "cpu", policy: dict | None = None) -> dict[str, str]:
    """What ``kfuzz.sandbox.confine`` gets on this machine for the audited kernels' policy
    (``kernel_policy``), in its own words: a throwaway process confines itself and reports."""
    import shutil
    import tempfile
    ctx = _context()
    workdir = tempfile.mkdtemp(prefix="kfuzz-probe-")
    conn, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_probe, args=(child, kernel_policy(device, **(policy or {})), workdir), daemon=True,
                       name="kfuzz-audit-probe")
    proc.start()
    child.close()
    try:
        report = conn.recv() if conn.poll(120) else {}
    except (EOFError, OSError):
        report = {}
    finally:
        conn.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    return report if isinstance(report, dict) else {}


def unconfined_layers(report: dict[str, str]) -> list[str]:
    """What an OS layer does not block for the kernels (``OS_LAYERS`` not reported ``blocked``)."""
    return [k for k in OS_LAYERS if not str(report.get(k, "")).startswith("blocked")]


def default_cache() -> Path:
    """Compiled extensions, one folder per solution hash, outside any results folder:
    ``$XDG_CACHE_HOME/kfuzz/extensions`` (``~/.cache/kfuzz/extensions``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kfuzz" / "extensions"


PCH_FOLDER = "pch"      # beneath the extension cache: torch's extension header, precompiled


GPU_JOBS = 16       # kernels at once on a GPU by default, at most: the configuration measured (docs/audit.md)


def default_jobs(device: str, jobs: int | None = None) -> tuple[int, int]:
    """Kernels audited at once (``jobs`` where given) and builds run ahead, by default: on a GPU,
    one kernel a core of this machine (at most ``GPU_JOBS``) and half as many builds ahead (the
    cores compile while the GPU judges the kernels already built); on the CPU, one kernel and no
    build ahead (a kernel's workers, its oracle and the compilers there all share the cores)."""
    gpu = str(device).startswith("cuda")
    if jobs is None:
        jobs = max(1, min(GPU_JOBS, os.cpu_count() or 1)) if gpu else 1
    return jobs, jobs // 2 if gpu else 0


def default_max_jobs(jobs: int) -> int:
    """Ninja's jobs in each build: ``$MAX_JOBS``, else this machine's cores shared among the
    ``jobs`` kernels at once, and at least 2 (a ``load_inline`` build has a host file and a CUDA
    file, which then compile side by side; the judging of the kernels already built leaves cores
    idle)."""
    return int(os.environ.get("MAX_JOBS") or 0) or max(2, (os.cpu_count() or 1) // max(1, jobs))


def precompile_headers(entries: Iterable[CorpusEntry], root: str | Path) -> dict[tuple[str, ...], str | None]:
    """torch's extension header precompiled beneath ``root`` for each distinct set of host-file
    flags among ``entries``' ``load_inline`` calls (read statically; none given: the default
    flags), most used first (``kfuzz.kernelbench.build.ensure_pch``), each marked pending first
    (``mark_pending``: the builds that need one wait for it). Runs in kfuzz's process:
    the compiler sees torch's header and the flags, never a solution's code. Returns each flag
    set's folder (None: could not be made)."""
    from collections import Counter
    from kfuzz.kernelbench.build import cflag_sets, ensure_pch, mark_pending
    counts = Counter(f for e in entries if e.pair is not None and e.compiles
                     for f in (cflag_sets(e.pair.custom_code) or [()]))
    order = [f for f, _ in counts.most_common()]
    markers = {f: mark_pending(root, f) for f in order}
    made = {}
    try:
        for f in order:
            made[f] = ensure_pch(root, f)
            os.remove(markers.pop(f))
    finally:
        for marker in markers.values():     # left by an error: no build waits for them
            os.remove(marker)
    return made


def check_build_step(device: str, cache: str | Path, policy: dict | None = None, timeout: float = 600.0,
                     pch_root: str | Path | None = None) -> None:
    """kfuzz's probe solution (``kfuzz.kernelbench.probe``) built in the audit's confined build
    step (``build_kernels``) into ``cache``; raises ``KfuzzError`` with the compiler's message
    where it does not build, since then no solution's build failure here says anything about the
    solution (the toolchain, or the sandbox's rules for it, are at fault). With ``pch_root``,
    torch's header is precompiled there first for the probe's flags (``ensure_pch``) and the probe
    builds with it, as solutions do. Once it has built in ``cache`` (a marker per device kind,
    torch version, compiler and precompiled header), it is not built again."""
    import torch
    import torch.utils.cpp_extension as ext
    from kfuzz.kernelbench.build import ensure_pch
    from kfuzz.kernelbench.probe import probe_entry
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    header = ensure_pch(pch_root) if pch_root else None
    stamp = hashlib.sha256("\0".join([kind, torch.__version__, ext.get_cxx_compiler(), str(header)]).encode()
                           ).hexdigest()[:16]
    marker = Path(cache) / f"probe-built-{stamp}"
    if marker.is_file():
        return
    (rec,) = build_kernels([probe_entry(Path(cache) / "probe")], cache, device, jobs=1, timeout=timeout,
                           policy=policy, pch_root=pch_root if header else None)
    built = rec.get("build") or {}
    if rec.get("ended") or built.get("status") != "built" or built.get("caught"):
        said = built.get("error") or "; ".join(built.get("caught") or []) or built.get("detail") or rec.get("ended")
        raise KfuzzError(f"the audit's build step cannot build kfuzz's probe extension on this machine "
                         f"({device}): {said}. Every solution's build would fail here for the same reason: "
                         f"fix the toolchain (the compiler torch picks: $CXX, else c++; nvcc on CUDA) or the "
                         f"build step's sandbox rules for it")
    marker.write_text(json.dumps(built) + "\n")


def _beneath(a: Path, b: Path) -> bool:
    return a == b or b in a.parents


def run_audit(entries: Iterable[CorpusEntry], out: str | Path, gates: list[str], jobs: int = 1,
              device: str = "cpu", seed: int = 0, timeout: float = 300.0, cache: str | Path | None = None,
              threads: int = 1, max_jobs: int | None = None, retry: bool = False, key: str | Path | None = None,
              trust_unsigned: bool = False, allow_unconfined: bool = False, policy: dict | None = None,
              build_jobs: int = 0, pch: bool = True, redo: Iterable[str] = (),
              build_timeout: float | None = None, slim: bool = True, redo_unsigned: bool = False) -> Iterator[dict]:
    """Audit ``entries`` not yet validly recorded in ``out`` (with ``retry``, also those whose run
    did not finish; and those whose key is in ``redo``, whatever their record says; with
    ``redo_unsigned``, those whose record carries no HMAC: an older kfuzz's, made before results
    were signed, each redone once, since its new record is signed); yields each
    record once appended, signed with the key at ``key`` (by default ``key_path()``). A kernel
    that ran out of a GPU's memory beside other kernels (``shares_memory``) is run again at the
    end, alone, and only that record is kept (``alone``; at ``jobs`` 1 every record is alone).
    Refuses (``KfuzzError``) a key or an extension ``cache`` inside ``out`` (or ``out`` inside the
    cache), a key file that does not exist where ``out``'s results hold signed records (the key
    that signed them is elsewhere or lost: a new one would verify none of them), and, unless
    ``allow_unconfined``, a machine where an OS layer would not block the kernels' network,
    writes or processes (``confinement``). ``policy``: overrides of the
    kernels' sandbox Policy fields. ``max_jobs``: ninja's jobs in each build (default:
    ``$MAX_JOBS``, else this machine's cores shared among the ``jobs`` kernels at once).
    ``build_jobs``: builds of solutions further down the queue that run ahead of their judging (a
    compile phase beside the judging); a kernel built ahead starts once its build has ended, with
    that build's facts (``ahead`` in its record's ``build``) and no build step of its own.
    ``pch``: precompile torch's extension header for the builds (``precompile_headers``, beside the
    first kernels; a build whose header is still being made waits for it). ``slim``: compile a
    ``load_inline`` CUDA file with its torch frontend includes slimmed where it compiles so
    (``kfuzz.kernelbench.build.use_slim_cuda``). ``build_timeout``: the seconds a solution's build
    may take, apart from ``timeout`` (default ``timeout``). Before the first solution that
    compiles, kfuzz's probe solution is built in the same confined build step
    (``check_build_step``: a ``KfuzzError`` where it does not build)."""
    entries = list(entries)
    out_dir = Path(out).resolve()
    key_file = Path(key).resolve() if key is not None else key_path().resolve()
    if _beneath(key_file, out_dir):
        raise KfuzzError(f"{key_file}: the audit key must be kept outside the results folder {out_dir}")
    cache_dir = Path(cache).resolve() if cache else default_cache().resolve()
    if _beneath(out_dir, cache_dir) or _beneath(cache_dir, out_dir):
        raise KfuzzError(f"{cache_dir}: the extension cache (where builds write) and the results folder "
                         f"{out_dir} must not contain one another")
    if not key_file.exists() and _signed_lines(out_dir / RESULTS):
        raise KfuzzError(f"{key_file}: no audit key, and {out_dir / RESULTS} holds records signed under one: give "
                         f"the key that signed them (--key FILE, $KFUZZ_AUDIT_KEY); a new key would verify none "
                         f"of them and audit every kernel again")
    secret = results_key(key_file)
    done = done_keys(out, retry, entries, secret, trust_unsigned, redo_unsigned) - set(redo)
    todo = [e for e in entries if e.key not in done]
    if any(e.pair is not None for e in todo) and not allow_unconfined:
        report = confinement(device, policy)
        missing = unconfined_layers(report)
        if missing:
            raise KfuzzError("this machine's sandbox would not block the kernels' " + ", ".join(
                f"{k} ({report.get(k, 'unknown')})" for k in missing) + "; the audit runs untrusted code only "
                "under an OS layer (pass allow_unconfined, --allow-unconfined in the CLI, to run it with what is here)")
    ctx = _context()
    if max_jobs is None:
        max_jobs = default_max_jobs(jobs)
    compiling = [e for e in todo if e.compiles]
    pch_root = str(cache_dir / PCH_FOLDER) if pch and compiling else None
    if compiling:
        check_build_step(device, cache_dir, policy, pch_root=pch_root)
    if pch_root:
        import threading
        threading.Thread(target=precompile_headers, args=(compiling, pch_root), daemon=True,
                         name="kfuzz-audit-pch").start()
    stubs = driver_stubs(device) if any(e.pair is not None for e in todo) else None
    args = (device, gates, seed, str(cache_dir), threads, max_jobs, timeout, dict(policy or {}), pch_root,
            str(out_dir / CASES), build_timeout, stubs, slim)
    running: list[_Running] = []
    builders: list[_Running] = []     # builds ahead of judging: no record of their own
    ahead_builds: dict[str, dict] = {}  # their build facts, their kernel's build when it starts
    queue = list(todo)
    ahead = [e for e in queue if e.compiles]
    shared_gpu = shares_memory(device) and jobs > 1
    alone: list[CorpusEntry] = []     # out of GPU memory beside other kernels: run again, alone, at the end
    try:
        while queue or running or alone:
            if not queue and not running:
                running.append(_Running(ctx, alone.pop(0), args, timeout, alone=True, build_timeout=build_timeout))
            # a kernel whose build ahead still runs waits for it: it then starts with that build's
            # facts and builds nothing itself (two builds of one folder at once would race on
            # torch's lock: the second imports what the first failed to build)
            building = {b.entry.key for b in builders}
            while len(running) < jobs:
                entry = next((e for e in queue if e.key not in building), None)
                if entry is None:
                    break
                queue.remove(entry)
                if entry in ahead:
                    ahead.remove(entry)
                if entry.pair is None:
                    record = base_record(entry)
                    append_record(out, record, secret)
                    yield record
                    continue
                running.append(_Running(ctx, entry, args, timeout, build_timeout=build_timeout,
                                        built=ahead_builds.pop(entry.key, None)))
            if not running and not builders:
                continue
            while ahead and len(builders) < build_jobs:
                builders.append(_Running(ctx, ahead.pop(0), args, timeout, build_only=True,
                                         build_timeout=build_timeout))
            deadline = min(r.deadline for r in running + builders)
            wait([r.conn for r in running + builders] + [r.proc.sentinel for r in running + builders],
                 timeout=max(0.0, deadline - time.monotonic()))
            for b in list(builders):
                try:
                    while b.conn.poll():
                        kind, d = b.conn.recv()
                        if kind == "build" and isinstance(d, dict):
                            ahead_builds[b.entry.key] = d
                except (EOFError, OSError, ValueError, TypeError):
                    pass
                if not b.proc.is_alive() or time.monotonic() >= b.deadline:
                    b.kill()
                    b.proc.join(10)
                    b.conn.close()
                    builders.remove(b)
            for r in list(running):
                how = r.ended()
                if how is None:
                    continue
                r.kill()          # also after "done": nothing of the kernel outlives its record
                r.proc.join(10)
                if how == "crash":
                    how = f"crash (exit {r.proc.exitcode})"
                record = r.end(None if how == "done" else how)
                running.remove(r)
                r.conn.close()
                if shared_gpu and not r.alone and out_of_device_memory(record):
                    alone.append(r.entry)
                    continue
                if r.alone or (shares_memory(device) and jobs == 1):
                    record["alone"] = True
                append_record(out, record, secret)
                yield record
    finally:   # a caller that stops early (an interrupt): no kernel outlives the audit
        for r in running + builders:
            r.kill()
            r.proc.join(10)
        if stubs:
            shutil.rmtree(stubs, ignore_errors=True)


def driver_stubs(device: str) -> str | None:
    """On a GPU, a folder (made here, outside every folder a worker may write) holding Triton's
    driver stubs built once (``sandbox.build_driver_stubs``), which every kernel's workers copy
    into their own Triton caches instead of each compiling them as it starts; None on a CPU or
    where they did not build (each worker then builds its own)."""
    from kfuzz.sandbox import build_driver_stubs
    if not str(device).startswith("cuda"):
        return None
    folder = tempfile.mkdtemp(prefix="kfuzz-triton-stubs-")
    if build_driver_stubs(folder):
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    return None


def build_kernels(entries: Iterable[CorpusEntry], cache: str | Path, device: str = "cpu", jobs: int = 1,
                  max_jobs: int | None = None, timeout: float = 600.0, pch_root: str | Path | None = None,
                  policy: dict | None = None, slim: bool = True) -> Iterator[dict]:
    """Only the build step of each compiling entry (the audit's own, confined), ``jobs`` at once,
    extensions into ``cache``; yields per kernel its key, ``build`` (the build step's facts, or
    its finding) and ``seconds`` (wall time of its process). ``pch_root``: a folder of
    precompiled headers the builds may use (``precompile_headers``); ``slim`` as ``run_audit``'s.
    Nothing is recorded."""
    ctx = _context()
    args = ("cpu" if device is None else device, [], 0, str(Path(cache).resolve()), 1,
            max_jobs or default_max_jobs(jobs), timeout, dict(policy or {}), str(pch_root) if pch_root else None, None,
            timeout, None, slim)
    queue = [e for e in entries if e.pair is not None and e.compiles]
    running: list[_Running] = []
    try:
        while queue or running:
            while queue and len(running) < jobs:
                running.append(_Running(ctx, queue.pop(0), args, timeout, build_only=True))
            wait([r.conn for r in running] + [r.proc.sentinel for r in running],
                 timeout=max(0.0, min(r.deadline for r in running) - time.monotonic()))
            for r in list(running):
                how = r.ended()
                if how is None:
                    continue
                r.kill()
                r.proc.join(10)
                r.conn.close()
                running.remove(r)
                rec = r.end(None if how == "done" else how)
                yield {"key": rec["key"], "build": rec.get("build"), "seconds": rec["seconds"],
                       "ended": rec.get("ended")}
    finally:
        for r in running:
            r.kill()
            r.proc.join(10)


# judging a record -------------------------------------------------------------------------------

def _old_standard_end(record: dict) -> str | None:
    """Records made before the standard test's end was a finding: ``ended`` "<kind> (...) in the
    standard test"."""
    ended = record.get("ended") or ""
    return ended.split()[0] if "standard" not in record and ended.endswith("in the standard test") else None


WEIGHTS_CHECKS = ("contract", "derived", "reload", "lenient")


def weights_failures(record: dict) -> list[str]:
    """What of the weights contract (``W``) the record fails: ``contract`` (``Model``'s
    state_dict does not load, or the check could not run), ``derived`` (a parameter derived in
    ``__init__`` does not follow a loaded checkpoint), ``reload`` (weights copied before a
    checkpoint was loaded: stale), see ``weights_checks``; ``lenient`` (names of the solution's
    own hold copies of the weights that a ``strict=False`` load leaves stale), see ``lenient_check``."""
    w = record.get("weights") or {}
    out = ["contract"] if w.get("status") in ("fail", "error") else []
    return out + [k for k in WEIGHTS_CHECKS[1:] if ((w.get("checks") or {}).get(k) or {}).get("status") == "fail"]


def judge_record(record: dict) -> dict:
    """A record's verdicts: ``violations`` (gate ids failed, ``W`` for the weights contract, a
    finding's kind where the build or the standard test ended in a sandbox violation, a limit, a
    crash or a timeout, ``crash`` for a kernel process that died), ``broken`` (a tolerance-free
    failure, or an error over BROKEN_RATIO times the bound), ``standard`` (the standard test
    passed), ``incomplete`` (killed for time in the gates or the build: judged on what finished;
    or out of a GPU's memory beside other kernels, not ``alone``: judged without those findings).

    G07 counts only where it applies: not on a reference with float weights (the weights
    record's ``params``; records made before G07 was n/a there say ``params`` only if the
    report tool filled it in from the corpus), whose G07 result is ``g07_not_applicable``."""
    from kfuzz import sandbox
    from kfuzz.gates import GATES
    violations, broken = [], False
    # out of a shared GPU's memory: perhaps the others' memory, not the kernel's finding
    shared = shares_memory(record.get("device") or "") and not record.get("alone") and out_of_device_memory(record)
    memory = sandbox.MEMORY
    for where in ("build", "standard"):
        found = (record.get(where) or {}).get("finding")
        if found and not (shared and found == memory):
            violations.append(str(found))
            broken = True
    g07_na = record.get("weights", {}).get("params") is True and "G07" in record.get("gates", {})
    for gid, g in sorted(record.get("gates", {}).items()):
        if g.get("status") != "fail" or (gid == "G07" and g07_na) or (shared and g.get("exc_type") == memory):
            continue
        violations.append(gid)
        ratio = g.get("worst_ratio", 0)
        ratio = float("inf") if ratio == "inf" else float(ratio)
        if GATES[gid].tolerance_free or g.get("kind") in TOLERANCE_FREE_KINDS or ratio >= BROKEN_RATIO:
            broken = True
    if weights_failures(record):
        violations.append("W")
    ended = record.get("ended") or ""
    old = _old_standard_end(record)
    if ended.startswith("crash"):
        violations.append("crash")
        broken = True
    elif old == "timeout" or (ended.startswith("timeout") and record.get("phase") == "standard"
                              and "standard" not in record):
        violations.append("timeout")     # the standard test did not end in time: a finding
        broken = True
    std = record.get("standard")
    # a kernel process killed for time in the gates is incomplete, not judged: slow at the fixed
    # size on a CPU (or a slow oracle) looks the same as a hang from outside
    incomplete = ended.startswith("timeout") and "timeout" not in violations or shared
    return {"violations": violations, "broken": broken, "violation": bool(violations),
            "standard": None if std is None or (shared and std.get("finding") == memory) else bool(std.get("passed")),
            "incomplete": incomplete, "g07_not_applicable": g07_na,
            "audited": not {"adapter", "unbuilt", "skip"} & set(record) and ("standard" in record or bool(violations))}


def first_failure(record: dict) -> str | None:
    """The record's first failure in words: a build or standard-test finding, else the first
    failing gate (by id) with its kind, else the weights contract, else how the process ended."""
    for where in ("build", "standard"):
        r = record.get(where) or {}
        if r.get("finding"):
            return f"{where} {r['finding']}: {str(r.get('detail', ''))[:100]}"
    j = judge_record(record)
    for gid, g in sorted(record.get("gates", {}).items()):
        if gid in j["violations"]:
            kind = g.get("kind") or "fail"
            if g.get("exc_type"):
                kind += f" ({g['exc_type']})"
            return f"{gid} {kind}: {str(g.get('reason', ''))[:100]}"
    if "W" in j["violations"]:
        return f"W: {str(record['weights'].get('detail', ''))[:100]}"
    if record.get("ended"):
        return f"ended {record['ended']}" + (f" in the {record['phase']}" if record.get("phase") else "")
    return None


def outcome(record: dict) -> str:
    """How a record ends against what was expected of it: ``skipped`` (not audited: no pair, the
    adapter refused the reference, the solution did not build), ``incomplete`` (killed for time in
    the gates or build), ``expected`` (no violation in a corpus without expectations; a control
    ending as planted), or ``unexpected`` (a violation where none is expected, a planted bug
    missed, a correct control flagged)."""
    j = judge_record(record)
    if not j["audited"]:
        return "skipped"
    if j["incomplete"] and not j["violation"]:
        return "incomplete"
    want = record.get("expect")
    wanted_violation = want is not None and want != "none"
    return "expected" if j["violation"] == wanted_violation else "unexpected"
