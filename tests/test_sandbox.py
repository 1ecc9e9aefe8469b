"""The worker sandbox: each adversarial kernel of ``harnesses/escapes.py`` gets its verdict, the
campaign goes on, nothing outside the worker's directory changes, and the operating system's
layers hold against a kernel that bypasses Python (raw system calls)."""
import ast
import ctypes
import json
import os
import platform
import re
import signal
import socket

import pytest

from harnesses.escapes import REPO, probe_paths
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
# seconds in all here, worker starts included, and in a fresh-clone CI run (session 25) one of
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
                         jobs=1, timeout=30.0, policy=HOG_POLICY if name == "escapes.memory" else POLICY)
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
    note = load(stats.saved[0])[1]["minimize"]
    assert "sandbox-write" in note.get("error", ""), note
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


def _raw(nr, *args) -> tuple[int, int]:
    """A system call made directly, past Python and its audit hook: (result, errno)."""
    libc = ctypes.CDLL(None, use_errno=True)
    res = libc.syscall(nr, *args)
    if nr == 57 and res == 0:   # a fork that got through: the grandchild leaves at once
        os._exit(0)
    return res, ctypes.get_errno()


@pytest.mark.skipif(not X86_64, reason="the seccomp filter and these syscall numbers are x86-64's")
@pytest.mark.parametrize("what, nr, args, errno_", [
    ("fork", 57, (), 1),                                                          # EPERM
    ("socket(AF_INET)", 41, (socket.AF_INET, socket.SOCK_STREAM, 0), 1),
])
def test_raw_system_calls_are_refused(tmp_path, what, nr, args, errno_):
    assert _in_confined_child(lambda _: _raw(nr, *args), tmp_path) == repr((-1, errno_)), what


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
        assert report["processes"] == "blocked (seccomp) and named"
        assert "seccomp" in report["network"]
    if LANDLOCK:
        assert report["writes"] == f"blocked (landlock-{LANDLOCK}) and named"


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
