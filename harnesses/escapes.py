"""Adversarial controls for the sandbox: kernels that try to leave their worker.

``escapes`` is a correct row sum; each variant returns the same sum after trying one
escape on every call. Run them only in sandboxed workers (``kfuzz run --jobs 1``,
the default); ``kfuzz run --target escapes.X --runs 3`` must report the verdict below
for every case and keep running:

- ``escapes.memory``: allocates (and touches) 64 MiB blocks until an allocation fails:
  ``crash``/``resource-memory``;
- ``escapes.fork``: ``os.fork`` and ``subprocess``: ``crash``/``sandbox-fork``;
- ``escapes.write``: writes a file into ``$HOME`` and into the repository's ``crashes/``:
  ``crash``/``sandbox-write``;
- ``escapes.network``: opens a TCP socket to a public address: ``crash``/``sandbox-network``;
- ``escapes.spin``: spins the CPU: ``crash``/``resource-cpu`` when the CPU-time limit is
  below the timeout (``--cpu-limit 2``), else ``timeout``;
- ``escapes.forge``: finds its worker's pipe through the garbage collector and sends kfuzz a
  forged answer that says ``pass``, then returns zeros: ``crash``/``malformed-answer``;
- ``escapes.shrink``: a plain wrong answer (``bound``) that tries ``escapes.write``'s writes
  only on inputs of at most two elements, which the minimizer reaches while shrinking the
  failure: minimizing must run confined too.

Kernels that fight back: each tries its attack, catches whatever stops it and returns the
correct sum, so that only a verdict kfuzz itself sees can fail it:

- ``escapes.launcher``: connects to every Unix socket with a path that it can find (kfuzz's
  worker launcher, a multiprocessing forkserver's listener): ``crash``/``sandbox-network``;
- ``escapes.bookkeeping``: tries the network, catches the violation and clears the sandbox's
  record of it (``kfuzz.sandbox.audit_hook``): ``crash``/``sandbox-network``;
- ``escapes.forkbomb``: forks 100 short-lived children: ``crash``/``sandbox-fork``;
- ``escapes.orphan``: a ``setsid`` grandchild (``ORPHAN``) that outlives the call and writes a
  probe file seconds later: ``crash``/``sandbox-fork``, and it dies with its worker;
- ``escapes.reserve``: reserves 20 GiB of address space (``MAP_NORESERVE``): ``crash``/
  ``resource-memory``;
- ``escapes.cache``: writes a probe file into ``~/.triton``: ``crash``/``sandbox-write``;
- ``escapes.secrets``: reads ``/etc/shadow``: ``crash``/``sandbox-read``;
- ``escapes.userns``: ``unshare(CLONE_NEWUSER)`` through libc: ``crash``/``sandbox-namespace``;
- ``escapes.shell``: ``sh -c`` that writes a probe file: ``crash``/``sandbox-fork``;
- ``escapes.rawfork``: the ``fork`` system call by number (past any Python-level hook): the
  system-call filter kills the worker, ``crash``/``sandbox-syscall``.

Not an escape, a control for the process count: ``escapes.toolchain`` runs the C compiler
(``cc --version``) 80 times in one call, as a JIT's autotuning runs a compiler per candidate
kernel: it passes where processes are allowed (the toolchain's are not counted against
``max_processes``), and is ``crash``/``sandbox-fork`` where none are.

A control for the count itself: ``escapes.spawns`` runs ``true`` ``SPAWN_RUNS`` times with
``subprocess.run(close_fds=False)``, which Python starts through ``os.posix_spawn`` (two audit
events a process): it passes where ``max_processes`` is ``SPAWN_RUNS`` and is
``crash``/``sandbox-fork`` below it; ``escapes.popen_inside`` starts as many by calling
subprocess's own ``_posix_spawn`` directly, which no ``subprocess.Popen`` event counted before:
``crash``/``sandbox-fork`` one below.

Each is bounded so that, run unconfined by mistake, it cannot harm the machine: at most
8 GiB touched (20 GiB reserved, never touched), 100 children living 0.2 s, one grandchild
living 3 s, one small probe file per place (``PROBE``), one connection attempt per socket
(nothing sent), a one-byte read, two minutes of spinning. Unconfined, each then returns the correct sum (a ``pass``): a
sandbox that lets one through shows as a missing verdict, not as damage.
"""
import ctypes
import glob
import mmap
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from kfuzz.target import Arg, Dim, Output, target, variant

PROBE = "kfuzz-escape-probe.txt"
ORPHAN = "kfuzz-orphan"     # the name (comm) of escapes.orphan's grandchild
MEMORY_CAP = 8 << 30
TOOLCHAIN_RUNS = 80         # escapes.toolchain's compiler runs in one call: past any max_processes the tests set
SPAWN_RUNS = 10             # escapes.spawns' processes in one call
REPO = Path(__file__).resolve().parents[1]


def probe_paths() -> list[Path]:
    """Where the escapes try to write: the user's home, the repository's corpus, Triton's
    default cache."""
    return [Path.home() / PROBE, REPO / "crashes" / PROBE, Path.home() / ".triton" / PROBE]


def _total(x):
    return x.double().sum(dim=-1).to(x.dtype)


@target("escapes", reference=lambda x: x.sum(dim=-1),
        args={"x": Arg(("N", "D"))}, outputs={"out": Output(("N",))},
        dims={"N": Dim(1, 8), "D": Dim(1, 64)},
        description="row sum with float64 totals, PyTorch; the base of the sandbox's adversarial controls")
def escapes(x):
    return _total(x)


def memory(x):
    blocks, held = [], 0
    while held < MEMORY_CAP:
        blocks.append(torch.ones(64 << 20, dtype=torch.uint8))   # touched: resident, not just reserved
        held += 64 << 20
    return _total(x)


def fork(x):
    for _ in range(3):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    subprocess.run(["true"], check=False)
    return _total(x)


def write(x):
    for path in probe_paths():
        with open(path, "w") as f:
            f.write("written by escapes.write from inside a kfuzz worker\n")
    return _total(x)


def network(x):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect_ex(("1.1.1.1", 53))
    finally:
        s.close()
    return _total(x)


def shrink(x):
    if x.numel() <= 2:
        write(x)
    return _total(x) * 2


def forge(x):
    import gc
    from multiprocessing.connection import Connection

    from kfuzz.wire import pack
    for obj in gc.get_objects():
        if isinstance(obj, Connection) and not obj.closed:
            obj.send_bytes(pack(["done", None, {"kind": "pass", "ratio": 0.0}, [], 0.0], []))
    return torch.zeros(x.shape[0], dtype=x.dtype)


def spin(x):
    end = time.monotonic() + 120.0
    n = 0
    while time.monotonic() < end:
        n += 1
    return _total(x)


def _quietly(attempt):
    """Run ``attempt``; whatever stops it (an error, the sandbox's exception) is swallowed."""
    try:
        attempt()
    except BaseException:   # noqa: BLE001 - what a kernel that fights back does
        pass


def _unix_socket_paths() -> list[str]:
    paths = glob.glob("/tmp/pymp-*/listener-*")
    try:
        with open("/proc/net/unix") as f:
            paths += [line.split()[-1] for line in f.read().splitlines()[1:] if line.split()[-1].startswith("/")]
    except OSError:
        pass
    return paths[:50]


def launcher(x):
    def connect(path):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(0.5)
            s.connect(path)
        finally:
            s.close()
    for path in _unix_socket_paths() or ["/tmp/kfuzz-no-such-socket"]:
        _quietly(lambda: connect(path))
    return _total(x)


def bookkeeping(x):
    _quietly(lambda: network(x))
    _quietly(lambda: sys.modules["kfuzz.sandbox.audit_hook"]._violations.clear())
    return _total(x)


def forkbomb(x):
    def one():
        pid = os.fork()
        if pid == 0:
            time.sleep(0.2)
            os._exit(0)
    for _ in range(100):
        _quietly(one)
    _quietly(lambda: [os.waitpid(-1, os.WNOHANG) for _ in range(100)])
    return _total(x)


def toolchain(x):
    cc = shutil.which("cc") or "cc"
    for _ in range(TOOLCHAIN_RUNS):
        _quietly(lambda: subprocess.run([cc, "--version"], capture_output=True, timeout=30))
    return _total(x)


def spawns(x):
    true = shutil.which("true") or "/bin/true"
    for _ in range(SPAWN_RUNS):
        _quietly(lambda: subprocess.run([true], close_fds=False, timeout=30))
    return _total(x)


def popen_inside(x):
    """Starts processes by calling subprocess's own posix_spawn helper directly, as no Popen
    would: no ``subprocess.Popen`` event before its ``os.posix_spawn``."""
    import inspect
    true = shutil.which("true") or "/bin/true"
    helper = subprocess.Popen._posix_spawn
    names = list(inspect.signature(helper).parameters)[1:]

    class Shell:
        pid = None

        def _close_pipe_fds(self, *fds):
            pass

    def one():
        shell = Shell()
        helper(shell, **{**{n: -1 for n in names}, "args": [true], "executable": true, "env": None,
                         "restore_signals": False})
        os.waitpid(shell.pid, 0)
    for _ in range(SPAWN_RUNS):
        _quietly(one)
    return _total(x)


def _grandchild():
    ctypes.CDLL(None).prctl(15, ORPHAN.encode(), 0, 0, 0)    # PR_SET_NAME
    time.sleep(3.0)
    with open(Path.home() / PROBE, "w") as f:
        f.write("written by escapes.orphan's grandchild after its call returned\n")


def orphan(x):
    def start():
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                if os.fork() == 0:
                    _quietly(_grandchild)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
    _quietly(start)
    return _total(x)


def reserve(x):
    def take():
        m = mmap.mmap(-1, 20 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
        m.close()
    try:
        take()
    except OSError as e:
        raise MemoryError(f"mmap of 20 GiB: {e}") from None
    return _total(x)


def cache(x):
    def write():
        (Path.home() / ".triton").mkdir(exist_ok=True)
        with open(Path.home() / ".triton" / PROBE, "w") as f:
            f.write("written by escapes.cache from inside a kfuzz worker\n")
    _quietly(write)
    return _total(x)


def secrets(x):
    def read():
        with open("/etc/shadow", "rb") as f:
            f.read(1)
    _quietly(read)
    return _total(x)


def userns(x):
    _quietly(lambda: ctypes.CDLL(None, use_errno=True).unshare(0x10000000))
    return _total(x)


def shell(x):
    _quietly(lambda: subprocess.run(["sh", "-c", f"echo escaped > {Path.home() / PROBE}"], check=False, timeout=10))
    return _total(x)


def rawfork(x):
    pid = ctypes.CDLL(None, use_errno=True).syscall(57)    # fork, x86-64
    if pid == 0:
        os._exit(0)
    if pid > 0:
        os.waitpid(pid, 0)
    return _total(x)


variant("escapes", "escapes.memory", memory, planted_bug="allocates 64 MiB blocks until it dies (capped at 8 GiB)")
variant("escapes", "escapes.fork", fork, planted_bug="forks three children and runs a subprocess")
variant("escapes", "escapes.write", write, planted_bug="writes a probe file into $HOME and the repository's crashes/")
variant("escapes", "escapes.network", network, planted_bug="opens a TCP connection to 1.1.1.1:53")
variant("escapes", "escapes.spin", spin, planted_bug="spins the CPU for two minutes")
variant("escapes", "escapes.forge", forge, planted_bug="sends kfuzz a forged 'pass' through its worker's pipe")
variant("escapes", "escapes.shrink", shrink,
        planted_bug="doubles every sum; on inputs of at most two elements also writes escapes.write's files")
variant("escapes", "escapes.launcher", launcher, planted_bug="connects to kfuzz's control sockets (any Unix socket path)")
variant("escapes", "escapes.bookkeeping", bookkeeping,
        planted_bug="catches its network violation and clears kfuzz's record of it")
variant("escapes", "escapes.forkbomb", forkbomb, planted_bug="forks 100 children")
variant("escapes", "escapes.orphan", orphan,
        planted_bug="leaves a setsid grandchild that writes a file into $HOME three seconds later")
variant("escapes", "escapes.reserve", reserve, planted_bug="reserves 20 GiB of address space")
variant("escapes", "escapes.cache", cache, planted_bug="writes a file into ~/.triton")
variant("escapes", "escapes.secrets", secrets, planted_bug="reads /etc/shadow")
variant("escapes", "escapes.userns", userns, planted_bug="makes a user namespace")
variant("escapes", "escapes.shell", shell, planted_bug="runs sh -c, which writes a file into $HOME")
variant("escapes", "escapes.rawfork", rawfork, planted_bug="calls fork by its system-call number")
variant("escapes", "escapes.toolchain", toolchain)
variant("escapes", "escapes.spawns", spawns)
variant("escapes", "escapes.popen_inside", popen_inside,
        planted_bug="starts processes through subprocess's own posix_spawn helper, with no Popen before")
