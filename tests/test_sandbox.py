"""The worker sandbox: each adversarial kernel of ``harnesses/escapes.py`` gets its verdict, the
campaign goes on, nothing outside the worker's directory changes, and the operating system's
layers hold against a kernel that bypasses Python (raw system calls)."""
import ast
import ctypes
import json
import math
import os
import platform
import re
import signal
import socket
import time

import pytest

from harnesses.escapes import ORPHAN, REPO, probe_paths
from kfuzz import sandbox
from kfuzz.campaign import run_campaign
from kfuzz.corpus import Corpus, iter_case_files, load
from kfuzz.engines import RandomEngine
from kfuzz.target import get_target

X86_64 = platform.machine() == "x86_64"
LANDLOCK = sandbox.landlock_abi()
# small limits keep the test fast: the memory hog touches ~1 GiB (the limit is headroom over
# what the worker maps), the spinner burns 1 s a case
POLICY = sandbox.Policy(memory=1 * sandbox.GiB, cpu_seconds=1)
# the memory hog's CPU time is near the spinner's limit: its two cases took 1.8 to 4.4 CPU
# seconds in all here, worker starts included, and in a fresh-clone CI run one of
# them ended as resource-cpu at one second; so it gets CPU headroom and the memory limit alone
# decides its verdict
HOG_POLICY = sandbox.Policy(memory=1 * sandbox.GiB, cpu_seconds=10)


def _corpus_files() -> dict:
    """The repository's saved corpus, file by file (what a write escape would aim at)."""
    return {p: p.read_bytes() for d in ("crashes", "seeds") for p in sorted((REPO / d).rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name, exc_type", [
    ("escapes.memory", sandbox.MEMORY), ("escapes.fork", sandbox.FORK), ("escapes.write", sandbox.WRITE),
    ("escapes.network", sandbox.NETWORK), ("escapes.spin", sandbox.CPU), ("escapes.forge", "malformed-answer")])
def test_each_escape_is_a_crash_verdict_and_the_campaign_goes_on(tmp_path, name, exc_type):
    before = _corpus_files()
    stats = run_campaign(get_target(name), RandomEngine(get_target(name), seed=0), Corpus(tmp_path), runs=2,
                         jobs=1, timeout=30.0, policy=HOG_POLICY if name == "escapes.memory" else POLICY,
                         minimize_seconds=5.0)
    assert stats.executions == 2
    assert {f"{s.kind}/{s.exc_type}": n for s, n in stats.failures.items()} == {f"crash/{exc_type}": 2}
    assert stats.worker_restarts >= 1
    # the campaign's own corpus holds exactly what kfuzz saved; the repository's is untouched
    assert sorted(iter_case_files([tmp_path])) == sorted(stats.saved)
    assert load(stats.saved[0])[1]["verdict"]["exc_type"] == exc_type
    after = _corpus_files()
    assert {p: after.get(p) for p in before} == before
    for probe in probe_paths():
        assert not probe.exists(), f"{probe} was written from inside the sandbox"


def test_minimizing_a_failure_runs_confined_too(tmp_path):
    """``escapes.shrink`` fails plainly on any input and writes outside only on the tiny inputs
    that shrinking reaches: the campaign's minimizer must not run it unconfined."""
    target = get_target("escapes.shrink")
    stats = run_campaign(target, RandomEngine(target, seed=0), Corpus(tmp_path), runs=1, jobs=1, policy=POLICY)
    assert [s.kind for s in stats.failures] == ["bound"] and len(stats.saved) == 1
    case, record = load(stats.saved[0])
    # each execution of the minimizer runs in a confined worker: a shrunk case that reaches the
    # write ends as crash/sandbox-write, another signature, so no such reduction is kept
    assert record["verdict"]["kind"] == "bound" and "error" not in record["minimize"], record
    assert math.prod(dict(case.dims).values()) > 2, case.dims
    for probe in probe_paths():
        assert not probe.exists(), f"{probe} was written by the minimizer"


def _in_confined_child(attempt, workdir, policy=sandbox.Policy(memory=None)) -> str:
    """Run ``attempt(report)`` in a forked child confined to ``workdir``; the repr of its
    result (or the exception's text) comes back."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: never returns into pytest
        try:
            os.close(r)
            signal.alarm(30)    # a child stuck past its limits dies: the parent reads nothing
            out = repr(attempt(sandbox.confine(policy, str(workdir))))
        except BaseException as e:  # noqa: BLE001 - everything must come back to the parent
            out = f"{type(e).__name__}: {e}"
        os.write(w, out.encode()[:4000])
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        got = f.read()
    os.waitpid(pid, 0)
    return got


_SYSCALL = ctypes.CDLL(None, use_errno=True).syscall   # looked up here: a lookup in a confined process is named


def _raw(nr, *args) -> tuple[int, int]:
    """A system call made directly, past Python and its audit hook: (result, errno)."""
    res = _SYSCALL(nr, *args)
    if nr == 57 and res == 0:   # a fork that got through: the grandchild leaves at once
        os._exit(0)
    return res, ctypes.get_errno()


def _killed_in_confined_child(attempt, workdir, policy=sandbox.Policy(memory=None)) -> int:
    """Run ``attempt()`` in a forked, confined child; its wait status's signal (0: none)."""
    pid = os.fork()
    if pid == 0:
        try:
            signal.alarm(30)
            sandbox.confine(policy, str(workdir))
            attempt()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0


@pytest.mark.skipif(not X86_64, reason="the seccomp filter and these syscall numbers are x86-64's")
@pytest.mark.parametrize("what, nr, args", [
    ("fork", 57, ()),
    ("socket(AF_INET)", 41, (socket.AF_INET, socket.SOCK_STREAM, 0)),
    ("socket(AF_UNIX)", 41, (socket.AF_UNIX, socket.SOCK_STREAM, 0)),
    ("unshare(CLONE_NEWUSER)", 272, (0x10000000,)),
    ("kill(1, 0)", 62, (1, 0)),
    ("ptrace(PTRACE_ATTACH, 1)", 101, (16, 1, 0, 0)),
])
def test_raw_system_calls_kill_the_process(tmp_path, what, nr, args):
    """Past the audit hook, the system-call filter kills the process: its parent sees SIGSYS,
    which kfuzz names ``sandbox-syscall``; the kernel gets no error to catch."""
    assert _killed_in_confined_child(lambda: _raw(nr, *args), tmp_path) == signal.SIGSYS, what
    assert sandbox.death_name(-signal.SIGSYS) == sandbox.SYSCALL


@pytest.mark.skipif(not X86_64, reason="the seccomp filter and these syscall numbers are x86-64's")
def test_a_thread_and_a_signal_to_itself_are_allowed(tmp_path):
    import threading

    def fine():
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
        signal.signal(signal.SIGUSR1, lambda *_: None)
        os.kill(os.getpid(), signal.SIGUSR1)
        return "ok"
    assert _in_confined_child(lambda _: fine(), tmp_path) == repr("ok")


@pytest.mark.skipif(not LANDLOCK, reason="this kernel has no Landlock: writes are detected, not blocked")
def test_a_raw_write_outside_the_private_directory_is_refused(tmp_path):
    victim = tmp_path / "victim.txt"        # outside the child's private directory (its cwd, below)
    victim.write_text("kept")
    private = tmp_path / "private"
    private.mkdir()
    # open(victim, O_WRONLY | O_TRUNC) by number: EACCES from Landlock
    got = _in_confined_child(lambda _: _raw(2, str(victim).encode(), os.O_WRONLY | os.O_TRUNC, 0), private)
    assert got == repr((-1, 13))
    assert _in_confined_child(lambda _: open("inside.txt", "w").write("ok"), private) == "2"
    assert victim.read_text() == "kept" and (private / "inside.txt").read_text() == "ok"


def test_torch_compiles_cache_lands_beneath_the_workers_own_directory(tmp_path, monkeypatch):
    """A kernel that uses torch.compile writes inductor's cache beneath the worker's compile
    cache, not where the parent's environment points (/tmp/torchinductor_<user> by default),
    which a confined worker may not write."""
    outside = tmp_path / "host-inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(outside))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    private = tmp_path / "private"
    private.mkdir()

    def inductor_cache(_):
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        return cache_dir()
    got = _in_confined_child(inductor_cache, private)
    assert got == repr(str(private / "triton-cache" / "torchinductor")), got
    assert not outside.exists()


@pytest.mark.skipif(not LANDLOCK, reason="this kernel has no Landlock: reads are named, not blocked")
def test_a_raw_read_of_a_host_file_is_refused(tmp_path):
    secret = tmp_path / "secret.txt"        # outside the child's directory and the Python environment
    secret.write_text("secret")
    private = tmp_path / "private"
    private.mkdir()
    assert _in_confined_child(lambda _: _raw(2, str(secret).encode(), os.O_RDONLY, 0), private) == repr((-1, 13))
    # what a worker needs stays readable: the Python environment, its own /proc entry
    assert _in_confined_child(lambda _: len(open(os.__file__).read()) > 0 and
                              "VmSize" in open("/proc/self/status").read(), private) == "True"


def test_a_caught_violation_still_counts(tmp_path):
    """A kernel that catches the violation (``except BaseException``) cannot hide it."""
    def sneaky(_):
        try:
            open(os.path.expanduser("~/" + "kfuzz-sneaky-probe.txt"), "w")
        except BaseException:   # noqa: BLE001 - what an adversarial kernel does
            pass
        return sandbox.violation()[0]
    assert _in_confined_child(sneaky, tmp_path) == repr(sandbox.WRITE)


def test_the_confinement_report_names_each_layer(tmp_path):
    report = json.loads(ast.literal_eval(_in_confined_child(json.dumps, tmp_path, sandbox.Policy())))
    assert re.fullmatch(r"RLIMIT_AS \d+\.\d\d GiB mapped \+ 4 GiB", report["memory"]) and report["files"].startswith("RLIMIT_NOFILE 512")
    assert report["directory"] == str(tmp_path)
    if X86_64:
        assert "seccomp-kill" in report["processes"] and report["processes"].endswith("and named")
        assert "seccomp-kill" in report["network"] and "seccomp-kill" in report["namespaces"]
    if LANDLOCK:
        assert report["writes"] == f"blocked (landlock-{LANDLOCK}) and named"
        assert report["reads"] == f"blocked (landlock-{LANDLOCK}) and named"


def _thread_then_allocations(report):
    import threading
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
    # plain Python buffers: a torch fill may start OpenMP threads, whose stacks and arenas
    # would eat the small headroom depending on what ran before in this process
    small = bytearray(64 << 20)                          # inside the headroom
    try:
        bytearray(512 << 20)                             # past it
    except MemoryError:
        return f"ok {len(small)}"
    return "the limit did not bite"


def test_the_memory_limit_is_headroom_over_what_the_worker_maps(tmp_path):
    """A 256 MiB limit in a process that already maps more (torch: ~0.6 GiB here, several GiB
    where torch loads its CUDA libraries): the kernel still gets 256 MiB of its own (a thread,
    a 64 MiB tensor), and no more. An absolute limit left no room at all: on the H200 host a
    CPU worker could not start a thread."""
    assert sandbox.address_space() > 256 << 20
    got = _in_confined_child(_thread_then_allocations, tmp_path, sandbox.Policy(memory=256 << 20))
    assert got == repr(f"ok {64 << 20}"), got


@pytest.mark.parametrize("text, want", [("4G", 4 << 30), ("512M", 512 << 20), ("1.5GiB", 3 << 29), ("none", None)])
def test_sizes(text, want):
    assert sandbox.parse_size(text) == want


@pytest.mark.parametrize("text", ["lots", "12", "-1G"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError):
        sandbox.parse_size(text)


def test_deaths_by_limit_are_named():
    assert sandbox.death_name(-signal.SIGXCPU) == sandbox.CPU
    assert sandbox.death_name(-signal.SIGXFSZ) == sandbox.FILE_SIZE
    assert sandbox.death_name(-signal.SIGSEGV) == "SIGSEGV" and sandbox.death_name(3) == "exit-3"


def test_cli_refuses_a_bad_memory_limit(tmp_path):
    from click.testing import CliRunner

    from kfuzz.cli import cli
    from kfuzz.cli import run as _run  # noqa: F401  (registers the verb)
    r = CliRunner().invoke(cli, ["run", "--target", "escapes", "--runs", "1", "--memory-limit", "lots",
                                 "--root", str(tmp_path)])
    assert r.exit_code == 2 and "--memory-limit" in r.output and "lots" in r.output


# kernels that fight back: each catches what stops it and returns the right sum ------------------

# processes allowed (as on CUDA, or for a build), but no program to run and at most 16 of them
PROCS = sandbox.Policy(memory=1 * sandbox.GiB, cpu_seconds=5, processes=True, max_processes=16, executable=())


def _one_verdict(name: str, policy: sandbox.Policy):
    from kfuzz.case import Case
    from kfuzz.executor import WorkerPool
    pool = WorkerPool(get_target(name), jobs=1, timeout=30.0, policy=policy)
    try:
        pool.submit(Case.make(name, "float32", 1, {"N": 2, "D": 8}))
        got = []
        while pool.busy:
            got.extend(pool.results())
    finally:
        pool.close()
    (result,) = got
    return result.verdict


def _named(comm: str) -> list[int]:
    """Live processes whose name (comm) is ``comm``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.find("(") + 1:stat.rfind(")")] == comm and stat[stat.rfind(")") + 2] != "Z":
            found.append(int(pid))
    return found


@pytest.mark.parametrize("name, policy, exc_type", [
    ("escapes.launcher", POLICY, sandbox.NETWORK),
    ("escapes.bookkeeping", POLICY, sandbox.NETWORK),
    ("escapes.forkbomb", POLICY, sandbox.FORK),
    ("escapes.forkbomb", PROCS, sandbox.FORK),
    ("escapes.orphan", POLICY, sandbox.FORK),
    ("escapes.orphan", PROCS, sandbox.FORK),
    ("escapes.reserve", POLICY, sandbox.MEMORY),
    ("escapes.cache", POLICY, sandbox.WRITE),
    ("escapes.secrets", POLICY, sandbox.READ),
    ("escapes.userns", POLICY, sandbox.NAMESPACE),
    ("escapes.userns", PROCS, sandbox.NAMESPACE),
    ("escapes.shell", POLICY, sandbox.FORK),
    ("escapes.shell", PROCS, sandbox.FORK),
    # without the audit hook, only the operating system's layers: the filter kills the worker
    ("escapes.rawfork", sandbox.Policy(memory=1 * sandbox.GiB, cpu_seconds=5, name_escapes=False), sandbox.SYSCALL),
    ("escapes.userns", sandbox.Policy(memory=1 * sandbox.GiB, cpu_seconds=5, name_escapes=False), sandbox.SYSCALL),
], ids=lambda v: v if isinstance(v, str) and "." in v else None)
def test_a_kernel_that_fights_back_gets_the_verdict_and_the_host_is_unharmed(name, policy, exc_type):
    if name == "escapes.secrets" and not os.path.exists("/etc/shadow"):
        pytest.skip("no /etc/shadow here")
    before = _corpus_files()
    verdict = _one_verdict(name, policy)
    assert verdict is not None and (verdict.kind, verdict.exc_type) == ("crash", exc_type), verdict
    deadline = time.monotonic() + 5
    while _named(ORPHAN) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _named(ORPHAN), "a process the kernel started outlived its worker"
    for probe in probe_paths():
        assert not probe.exists(), f"{probe} was written from inside the sandbox"
    after = _corpus_files()
    assert {p: after.get(p) for p in before} == before


def test_a_detached_grandchild_stays_below_a_worker_without_a_pid_namespace(monkeypatch):
    """Where a worker gets no PID namespace (``none``: a GPU whose driver does not start inside
    one), a ``setsid`` grandchild whose parent has exited is still below the worker, which
    adopts orphans: the process that outlived its call is found, then ended with the worker."""
    import kfuzz.workers
    if os.geteuid() != 0:
        pytest.skip("without a user namespace the process limit counts all of a non-root user's processes")
    monkeypatch.setitem(kfuzz.workers._levels, "cpu", ["none"])
    verdict = _one_verdict("escapes.orphan", PROCS)
    assert verdict is not None and (verdict.kind, verdict.exc_type) == ("crash", sandbox.FORK), verdict
    deadline = time.monotonic() + 5
    while _named(ORPHAN) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _named(ORPHAN), "a process the kernel started outlived its worker"


def test_the_toolchains_processes_are_not_counted_against_a_calls_number():
    """A call that runs the C compiler 80 times (as a JIT's autotuning runs one per candidate)
    passes where processes are allowed, past ``max_processes`` (16 here); a fork is still
    counted (``escapes.forkbomb``), and where no process is allowed the compiler is refused."""
    import shutil
    if shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    tools = sandbox.Policy(memory=1 * sandbox.GiB, cpu_seconds=30, processes=True, max_processes=16)
    assert _one_verdict("escapes.toolchain", tools) is None
    verdict = _one_verdict("escapes.forkbomb", tools)
    assert (verdict.kind, verdict.exc_type) == ("crash", sandbox.FORK) and "more than 16" in verdict.detail
    assert "(most: a fork x" in verdict.detail, verdict.detail     # names what it started
    verdict = _one_verdict("escapes.toolchain", POLICY)
    assert verdict is not None and (verdict.kind, verdict.exc_type) == ("crash", sandbox.FORK), verdict


def test_a_process_python_starts_through_posix_spawn_counts_once():
    """``subprocess.run(close_fds=False)`` raises two audit events a process (``subprocess.Popen``
    and ``os.posix_spawn``): ``escapes.spawns`` starts ``SPAWN_RUNS`` processes so and passes at
    a ``max_processes`` of exactly that; one fewer allowed, it is ``sandbox-fork``, the program named."""
    from harnesses.escapes import SPAWN_RUNS
    at = sandbox.Policy(memory=1 * sandbox.GiB, cpu_seconds=30, processes=True, max_processes=SPAWN_RUNS)
    assert _one_verdict("escapes.spawns", at) is None
    below = sandbox.Policy(memory=1 * sandbox.GiB, cpu_seconds=30, processes=True, max_processes=SPAWN_RUNS - 1)
    verdict = _one_verdict("escapes.spawns", below)
    assert verdict is not None and (verdict.kind, verdict.exc_type) == ("crash", sandbox.FORK), verdict
    assert f"more than {SPAWN_RUNS - 1}" in verdict.detail and "true x" in verdict.detail, verdict.detail
    # subprocess's helper called directly, with no Popen event before it: every process counts
    verdict = _one_verdict("escapes.popen_inside", below)
    assert verdict is not None and (verdict.kind, verdict.exc_type) == ("crash", sandbox.FORK), verdict


def test_kfuzz_control_sockets_have_no_name():
    """A kernel can reach no control channel of kfuzz's by a path or an abstract name: every
    Unix socket that the zygote (the one process that starts workers) holds is unnamed."""
    from kfuzz import launcher
    verdict = _one_verdict("escapes", POLICY)     # starts the zygote, runs one case
    assert verdict is None
    inodes = set()
    for pid in [launcher._shared[0].pid]:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f.read().splitlines()[1:]]
    named = [row for row in rows if row[6] in inodes and len(row) > 7]
    assert inodes and not named, named


def test_a_kernel_that_closes_its_violation_channel_is_caught(tmp_path):
    """The channel is the worker's one way to name an attempt; a kernel that closes it (so that
    later attempts go unnamed) gets ``sandbox-channel``."""
    import textwrap
    module = tmp_path / "closechannel.py"
    module.write_text(textwrap.dedent('''
        import os, socket
        from kfuzz.target import Arg, Dim, Output, target

        @target("closechannel", reference=lambda x: x.sum(dim=-1), args={"x": Arg(("N", "D"))},
                outputs={"out": Output(("N",))}, dims={"N": Dim(1, 8), "D": Dim(1, 64)})
        def closechannel(x):
            import gc, stat
            from multiprocessing.connection import Connection
            keep = {o.fileno() for o in gc.get_objects() if isinstance(o, Connection) and not o.closed}
            for fd in range(3, 64):
                try:
                    if fd not in keep and stat.S_ISSOCK(os.fstat(fd).st_mode):
                        os.close(fd)    # every socket but the pipe to kfuzz: the violation channel
                except OSError:
                    pass
            return x.double().sum(dim=-1).to(x.dtype)
    '''))
    import sys
    sys.path.insert(0, str(tmp_path))
    try:
        import closechannel  # noqa: F401  (registers the target)
        verdict = _one_verdict("closechannel", POLICY)
    finally:
        sys.path.remove(str(tmp_path))
    assert verdict is not None and verdict.exc_type == sandbox.CHANNEL, verdict


def test_a_process_seen_while_the_next_case_runs_is_judged_at_the_next_answer(monkeypatch):
    """With a case queued behind the one that answered, the worker may already run it, and a
    process seen then may be that call's (a JIT compiler): a verdict only if the same process
    still runs at the next answer; with nothing queued, at once."""
    from types import SimpleNamespace

    from kfuzz import processes
    from kfuzz.workers import Worker
    w = object.__new__(Worker)
    w.channel = SimpleNamespace(verdict=lambda answered: None, read=lambda: [], eof=False)
    w.watch_tree, w.answers, w.suspects, w.own_tree = True, 0, {}, 0
    running: dict[int, int] = {}
    monkeypatch.setattr(w, "started_processes", lambda scan=False: list(running))
    monkeypatch.setattr(processes, "started_at", lambda pid: running.get(pid))
    monkeypatch.setattr(processes, "command", lambda pid: f"ptxas-{pid}")
    w.queue = ["next"]
    running.update({101: 7})                     # the next case's compiler, as case 1 answers
    assert w.escape() is None
    running.clear()
    running.update({102: 9})                     # case 2's compiler has ended; case 3's runs
    assert w.escape() is None
    running.update({103: 11})                    # case 3 answers: 102 still runs, the same process
    kind, detail = w.escape()
    assert kind == sandbox.FORK and "102" in detail and "103" not in detail
    w.suspects, w.queue = {}, []
    running.clear()
    running.update({104: 12})                    # nothing queued: only the answered call can own it
    assert w.escape()[0] == sandbox.FORK
    running.clear()
    running.update({105: 13})                    # a pid reused by a later process is not the same one
    w.queue = ["next"]
    w.suspects = {105: 3}
    assert w.escape() is None


# a plugin kernel doing, inside its call, what torch.compile does on a GPU (start inductor's
# pool of compile processes, kept for later compiles) and what libraries do with temporary files
COMPILE_POOL = '''
import tempfile

import torch
from torch._inductor.async_compile import AsyncCompile

from kfuzz.target import Arg, Dim, Output, target


@target("probe.compilepool", reference=lambda x: x * 2, args={"x": Arg(("N",))},
        outputs={"out": Output(("N",))}, dims={"N": Dim(1, 16)})
def doubled(x):
    AsyncCompile.warm_pool()
    with tempfile.NamedTemporaryFile() as f:
        f.write(b"scratch")
    return x * 2
'''


def test_torch_compiles_pool_and_temporary_files_stay_inside_a_worker(install_plugin, tmp_path):
    """A correct kernel that uses torch.compile and temporary files passes in a confined worker:
    inductor compiles in the worker (no pool of compile processes that would outlive the call:
    ``sandbox-fork``), and ``tempfile`` writes beneath the worker's own directory (not /tmp:
    ``sandbox-write``)."""
    install_plugin("probe_compile", {"probe_compilepool.py": COMPILE_POOL},
                   {"kfuzz.targets": {"compilepool": "probe_compilepool"}})
    _runs_clean("probe.compilepool", tmp_path / "out")


def _runs_clean(target: str, root) -> None:
    """``kfuzz run`` of a correct plugin kernel in one confined worker: 3 cases, no failure."""
    from click.testing import CliRunner

    import kfuzz.cli.run  # noqa: F401  (registers the verbs)
    from kfuzz.cli import cli
    r = CliRunner().invoke(cli, ["run", "--target", target, "--runs", "3", "--jobs", "1", "--device", "cpu",
                                 "--root", str(root)])
    assert r.exit_code == 0, r.output
    assert "3 executions" in r.stdout and "0 failure signature(s)" in r.stdout


# a plugin kernel that keeps what it compiled as CuPy does: in $CUPY_CACHE_DIR, else in the home
LIBRARY_CACHE = '''
import os

from kfuzz.target import Arg, Dim, Output, target


@target("probe.librarycache", reference=lambda x: x * 2, args={"x": Arg(("N",))},
        outputs={"out": Output(("N",))}, dims={"N": Dim(1, 16)})
def doubled(x):
    folder = os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "kernel.cubin"), "wb") as f:
        f.write(b"compiled")
    return x * 2
'''


def test_a_library_that_caches_its_compiles_writes_beneath_the_workers_cache(install_plugin, tmp_path, monkeypatch):
    """A correct kernel whose library keeps its compiled kernels on disk (CuPy, Numba, the CUDA
    driver's JIT, torch's runtime-compiled kernels) passes in a confined worker: the variable
    that names the library's cache points beneath the worker's compile cache, whatever the
    user's environment says, so the write is no ``sandbox-write``."""
    from kfuzz.sandbox.caches import LIBRARY_CACHES
    assert "CUPY_CACHE_DIR" in LIBRARY_CACHES
    host = tmp_path / "host-cupy"
    monkeypatch.setenv("CUPY_CACHE_DIR", str(host))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    install_plugin("probe_librarycache", {"probe_librarycache.py": LIBRARY_CACHE},
                   {"kfuzz.targets": {"librarycache": "probe_librarycache"}})
    _runs_clean("probe.librarycache", tmp_path / "out")
    assert not host.exists() and not (tmp_path / "home").exists()


def test_a_workers_own_triton_cache_starts_with_the_driver_stubs_kfuzz_built(tmp_path, monkeypatch):
    """A worker whose Triton cache is its own gets a copy of the driver stubs kfuzz built once
    (``STUBS_ENV``), so it does not compile them as it starts; a shared cache (a campaign's) is
    left as it is."""
    import tempfile
    from pathlib import Path
    stubs = tmp_path / "stubs"
    (stubs / "0123abcd").mkdir(parents=True)
    (stubs / "0123abcd" / "cuda_utils.so").write_bytes(b"\x7fELF stub")
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_COMPILE_THREADS", "TMPDIR"):
        monkeypatch.setenv(name, "")      # compile_cache sets them: each put back as it was after the test
        monkeypatch.delenv(name)
    monkeypatch.setattr(tempfile, "tempdir", tempfile.tempdir)
    inductor = __import__("sys").modules.get("torch._inductor.config")
    if inductor is not None:
        monkeypatch.setattr(inductor, "compile_threads", inductor.compile_threads)
    monkeypatch.setenv(sandbox.STUBS_ENV, str(stubs))
    (tmp_path / "w").mkdir()
    own = Path(sandbox.compile_cache(str(tmp_path / "w")))
    assert own.is_relative_to(tmp_path / "w") and (own / "0123abcd" / "cuda_utils.so").read_bytes() == b"\x7fELF stub"
    shared = tmp_path / "campaign-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(shared))
    (tmp_path / "w2").mkdir()
    assert sandbox.compile_cache(str(tmp_path / "w2")) == str(shared) and not (shared / "0123abcd").exists()


def test_the_driver_stubs_build_where_cuda_and_triton_are(tmp_path):
    """``build_driver_stubs`` builds Triton's CUDA stub in a process of its own where there is
    a GPU, and says it did not on a machine without one."""
    import glob
    import torch
    built = sandbox.build_driver_stubs(str(tmp_path / "stubs"), timeout=600)
    assert built == torch.cuda.is_available()
    assert bool(glob.glob(str(tmp_path / "stubs" / "**" / "*.so"), recursive=True)) == built
