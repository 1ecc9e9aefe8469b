"""How worker processes start: a zygote that only kfuzz can ask for one.

The zygote is a fresh interpreter (exec'd, never a fork of kfuzz's process) that imports
torch and kfuzz's own modules once, then forks a worker for each request. It talks to kfuzz
over one inherited socket pair: no path in the filesystem, no abstract name, nothing another
process can connect to. Each request names the function the child runs and hands over,
through the socket, the descriptors the child keeps (its pipe to kfuzz, its violation
channel); the child closes every other descriptor before it runs anything, sends its
standard input and output to /dev/null, and dies with its zygote (``PR_SET_PDEATHSIG``).

What the zygote never does: import a target's module (a worker imports its target itself,
after the fork, so a library that touches CUDA or starts threads at import cannot poison the
workers forked after it), touch CUDA, or run a kernel. If what it preloads leaves it unsafe
to fork (CUDA initialised, threads beyond those of importing torch), kfuzz stops it and
starts a fresh zygote for each worker instead (a spawn: a torch import a worker).

The zygote is the workers' parent, and so the one that sees how each ended (its exit code
or signal, ``SIGSYS`` for a system call the sandbox's filter forbids); it reports it to kfuzz.
It is a child subreaper: a process that a worker's tree orphans (a ``setsid`` grandchild
whose parent died) becomes its child, and it kills every child that is not a worker (the
process tree is read from /proc by ``kfuzz.processes``).
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback

from kfuzz import processes

_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER = 1, 4, 36
STARTUP_TIMEOUT = 600.0     # importing torch on a loaded machine is slow
PRELOAD = ("torch", "triton", "triton.language", "kfuzz.workers", "kfuzz.sandbox")   # those installed
_MAX_FDS = 8


@contextlib.contextmanager
def helpers_ignore_ctrl_c():
    """Start kfuzz's helper processes (the zygote, judges, fuzzers, the gates' pool) inside
    this block: a process started here begins with SIGINT ignored, a disposition kept through
    fork and exec. A terminal's Ctrl-C reaches the whole process group, and kfuzz's process
    ends its helpers itself; a helper still starting its interpreter, before it ignores SIGINT
    itself, would otherwise end with a KeyboardInterrupt traceback of its own. kfuzz's process
    ignores a Ctrl-C that comes during the block (the moment of a start). Only the main thread
    may change a disposition: elsewhere the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _prctl(option: int, value: int) -> bool:
    return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0


def _send(sock: socket.socket, obj, fds: tuple[int, ...] = ()) -> None:
    data = pickle.dumps(obj)
    msg = struct.pack("!I", len(data)) + data
    if fds:
        n = sock.sendmsg([msg[:4]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
        msg = msg[n:]
    sock.sendall(msg)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError("the other end closed the control socket")
        out += chunk
    return out


def _recv(sock: socket.socket):
    """One message and the descriptors sent with it; EOFError when the peer is gone."""
    head, fds = b"", []
    while len(head) < 4:
        data, ancdata, _, _ = sock.recvmsg(4 - len(head), socket.CMSG_SPACE(_MAX_FDS * 4))
        if not data:
            raise EOFError("the other end closed the control socket")
        head += data
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += struct.unpack(f"{len(payload) // 4}i", payload[:len(payload) // 4 * 4])
    (size,) = struct.unpack("!I", head)
    return pickle.loads(_recv_exact(sock, size)), fds


def fork_hazard(baseline_threads: int | None = None) -> str | None:
    """Why a fork of this process would give a broken child (CUDA initialised, more threads
    than ``baseline_threads``), or None."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised"
    if baseline_threads is not None:
        n = _threads()
        if n > baseline_threads:
            return f"{n} threads are running (importing torch leaves {baseline_threads})"
    return None


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


# the zygote's side ---------------------------------------------------------------------------------

class _Zygote:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.workers: set[int] = set()
        self.baseline = None
        self.swept = 0.0

    def preload(self, names) -> str | None:
        for name in names:
            importlib.import_module(name)
        return fork_hazard(self.baseline)

    def serve(self) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        try:
            while True:
                readable, _, _ = select.select([self.sock, wake_r], [], [], 0.2)
                if wake_r in readable:
                    os.read(wake_r, 512)
                self.reap()
                if self.sock in readable:
                    try:
                        msg, fds = _recv(self.sock)
                    except EOFError:
                        return
                    self.handle(msg, fds)
        finally:
            for pid in list(self.workers):
                processes.kill(pid)
            deadline = time.monotonic() + 5
            while (self.workers or processes.children_of(os.getpid())) and time.monotonic() < deadline:
                self.reap()
                time.sleep(0.01)

    def reap(self) -> None:
        reaped = False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            reaped = True
            if pid in self.workers:
                self.workers.discard(pid)
                _send(self.sock, ("exit", pid, os.waitstatus_to_exitcode(status)))
        if reaped or time.monotonic() - self.swept > 1.0:    # orphans of a worker's tree (a /proc scan)
            self.swept = time.monotonic()
            for pid in processes.children_of(os.getpid()):
                if pid not in self.workers:
                    processes.kill(pid)

    def handle(self, msg, fds: list[int]) -> None:
        kind = msg[0]
        if kind == "start":
            _, entry, args, path = msg
            pid = os.fork()
            if pid == 0:
                sys.path[:] = path      # kfuzz's, as it is now (a target's module may have been added)
                _child(entry, args, fds)
            for fd in fds:
                os.close(fd)
            self.workers.add(pid)
            _send(self.sock, ("started", pid))
        elif kind == "kill":
            if msg[1] in self.workers:
                processes.kill(msg[1])
        elif kind == "preload":
            sys.path[:] = msg[2]
            _send(self.sock, ("preloaded", self.preload(msg[1])))


def _close_all_but(keep) -> None:
    top = os.sysconf("SC_OPEN_MAX") if os.sysconf("SC_OPEN_MAX") > 0 else 1 << 20
    lo = 0
    for fd in sorted(set(keep)) + [top]:
        if fd > lo:     # os.closerange(a, b) with b <= a closes everything from a on
            os.closerange(lo, fd)
        lo = fd + 1


def _child(entry: tuple[str, str], args: tuple, keep: list[int]) -> None:
    """A worker, right after the fork: nothing of the zygote's but ``keep``, then ``entry``.
    Never returns (whatever happens, the zygote's loop must not run on in a child)."""
    code = 1
    try:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            parent = os.getppid()
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:
                os._exit(1)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)
            _close_all_but([0, 1, 2, *keep])
            module, name = entry
            getattr(importlib.import_module(module), name)(*keep, *args)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:   # noqa: BLE001 - a worker that cannot start says why on stderr
            traceback.print_exc()
    finally:
        os._exit(code)


def _zygote_main(fd: int) -> None:
    # a terminal's Ctrl-C reaches the whole process group: kfuzz's process ends the zygote and
    # its workers itself (they inherit this), without a KeyboardInterrupt traceback from each
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    hello, _ = _recv(sock)
    sys.path[:] = hello["path"]
    _prctl(_PR_SET_DUMPABLE, 0)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    z = _Zygote(sock)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    z.baseline = _threads()
    _send(sock, ("ready", os.getpid(), z.preload(hello["preload"])))
    z.serve()


def _zygote_here_main(sock: socket.socket, baseline: int) -> None:
    try:
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        _close_all_but([0, 1, 2, sock.fileno()])
        z = _Zygote(sock)
        z.baseline = baseline
        z.serve()
    finally:
        os._exit(0)


# kfuzz's side --------------------------------------------------------------------------------------

class LaunchError(RuntimeError):
    """The zygote could not start or answer."""


class Child:
    """A process the zygote forked: what ``multiprocessing.Process`` offers of one."""

    def __init__(self, launcher: "Launcher", pid: int):
        self.launcher, self.pid = launcher, pid

    @property
    def exitcode(self) -> int | None:
        self.launcher.poll()
        return self.launcher.exits.get(self.pid)

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        self.launcher.wait_exit(self.pid, timeout)

    def kill(self) -> None:
        if self.is_alive():
            self.launcher.request(("kill", self.pid))

    def release(self) -> None:
        """Forget this child (its exit status is no longer needed); a zygote of its own ends."""
        self.launcher.exits.pop(self.pid, None)
        if self.launcher.single:
            self.launcher.close()


class Launcher:
    """kfuzz's end of one zygote (see the module docstring)."""

    def __init__(self, preload: tuple[str, ...] = (), single: bool = False,
                 sock: socket.socket | None = None, pid: int | None = None):
        self.single, self.exits = single, {}
        self.lock = threading.RLock()
        self.preloaded: set[str] = set(preload)
        self.hazard: str | None = None
        if sock is not None:      # a zygote forked from this process (``zygote_here``)
            self.sock, self.pid, self.proc = sock, pid, None
            return
        _prctl(_PR_SET_DUMPABLE, 0)    # no worker may open this process's /proc/PID/mem or fd
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with helpers_ignore_ctrl_c():
            self.proc = subprocess.Popen([sys.executable, "-c", "import sys; from kfuzz.launcher import _zygote_main; "
                                          f"_zygote_main({theirs.fileno()})"],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, close_fds=True)
        theirs.close()
        _send(self.sock, {"path": list(sys.path), "preload": list(preload)})
        reply = self._reply(STARTUP_TIMEOUT, "ready")
        self.pid, self.hazard = reply[1], reply[2]

    def _reply(self, timeout: float | None, kind: str):
        """Messages until one of ``kind`` (exit reports are kept on the way)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.sock], [], [], left)[0]:
                raise LaunchError(f"the zygote gave no {kind!r} within {timeout:g} s")
            try:
                msg, fds = _recv(self.sock)
            except (EOFError, OSError) as e:
                raise LaunchError(f"the zygote ended ({e})") from None
            for fd in fds:
                os.close(fd)
            if msg[0] == "exit":
                self.exits[msg[1]] = msg[2]
            if msg[0] == kind:
                return msg

    def poll(self) -> None:
        """Take the exit reports waiting in the socket."""
        with self.lock:
            while self.sock.fileno() >= 0 and select.select([self.sock], [], [], 0)[0]:
                try:
                    msg, fds = _recv(self.sock)
                except (EOFError, OSError):
                    return
                for fd in fds:
                    os.close(fd)
                if msg[0] == "exit":
                    self.exits[msg[1]] = msg[2]

    def wait_exit(self, pid: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while pid not in self.exits and self.sock.fileno() >= 0:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                try:
                    self._reply(left, "exit")
                except LaunchError:
                    return

    def request(self, msg) -> None:
        with self.lock:
            try:
                _send(self.sock, msg)
            except OSError:
                pass

    def ensure(self, preload: tuple[str, ...]) -> str | None:
        """Preload ``preload`` in the zygote; why it is no longer safe to fork, if so."""
        missing = [m for m in preload if m not in self.preloaded]
        if missing and self.hazard is None:
            with self.lock:
                _send(self.sock, ("preload", missing, list(sys.path)))
                self.hazard = self._reply(STARTUP_TIMEOUT, "preloaded")[1]
            self.preloaded.update(missing)
        return self.hazard

    def start(self, entry: tuple[str, str], args: tuple, fds: tuple[int, ...]) -> Child:
        """Fork a child that runs ``entry`` (module, function) with ``fds`` (passed as the
        first arguments; the caller still holds and closes its copies) then ``args``."""
        with self.lock:
            _send(self.sock, ("start", entry, args, list(sys.path)), fds)
            return Child(self, self._reply(STARTUP_TIMEOUT, "started")[1])

    def close(self) -> None:
        with self.lock:
            if self.sock.fileno() >= 0:
                self.sock.close()
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        elif self.pid is not None:
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass


_shared: list[Launcher] = []
_shared_lock = threading.Lock()


def start(entry: tuple[str, str], args: tuple, fds: tuple[int, ...], preload: tuple[str, ...] = ()) -> Child:
    """A child of this process's zygote (started on first use); of a zygote of its own when
    the shared one is no longer safe to fork."""
    with _shared_lock:
        if not _shared or _shared[0].sock.fileno() < 0 or _shared[0].hazard is not None:
            if _shared and _shared[0].hazard is None:
                _shared.pop().close()
            if not _shared:
                _shared.append(Launcher(preload))
        zygote = _shared[0]
    if zygote.ensure(preload) is None:
        try:
            return zygote.start(entry, args, fds)
        except LaunchError:
            with _shared_lock:
                if _shared and _shared[0] is zygote:
                    _shared.pop()
            raise
    single = Launcher(preload, single=True)     # a spawn: this worker's own zygote
    return single.start(entry, args, fds)


def zygote_here() -> bool:
    """Make this process's zygote a fork of this process as it is now, instead of a fresh
    interpreter that imports torch again: for a short-lived process that starts workers and
    has imported what they need. The zygote keeps no descriptor but its socket to this
    process. False (nothing done) when a fork of this process now would be unsafe (CUDA, more
    threads than importing torch leaves) or a zygote already runs."""
    with _shared_lock:
        if _shared:
            return False
        torch = sys.modules.get("torch")
        baseline = 2 if torch is not None else 1
        if fork_hazard(baseline) is not None:
            return False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            ours.close()
            _zygote_here_main(theirs, baseline)
        theirs.close()
        _prctl(_PR_SET_DUMPABLE, 0)
        _shared.append(Launcher(tuple(m for m in sys.modules), sock=ours, pid=pid))
        return True


if __name__ == "__main__":
    _zygote_main(int(sys.argv[1]))
