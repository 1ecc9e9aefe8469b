"""The call contract's tripwires: what a kernel could do, besides returning the wrong
numbers, to fool a comparison made after it returns (docs/sandbox.md, the reward hacks).

- ``NamespaceSnapshot``: the identities of the names a comparison relies on (torch,
  torch.nn.functional, torch.testing, torch.Tensor, torch.cuda, numpy, numpy.testing,
  builtins, math, kfuzz's own modules) and the code of their Python functions; ``undo``
  names what a call replaced and puts it back.
- ``current_hooks`` / ``restore_hooks``: trace and profile functions, gc callbacks and timer
  or user signal handlers, which run code later without a thread.
- ``threads_left``: Python threads a call started that are still running.
- ``overlapping``: an output whose elements alias each other (an expanded constant).

``kfuzz.execute.call_kernel`` applies them on every call. They are tripwires, not a
sandbox: a kernel in the same process can always reach further (audit hooks, C code);
workers (``kfuzz.workers``) keep the oracle out of its process altogether.
"""
from __future__ import annotations

import builtins
import gc
import math
import os
import signal
import sys
import threading
import types
from typing import Any

import numpy as np
import torch

_MISSING = object()


def _watched_namespaces() -> tuple[list, list]:
    """What a kernel could patch to fool a comparison made in its process: torch's and
    numpy's comparisons, builtins, kfuzz's own judging code. (torch._C.TensorBase and
    numpy.ndarray are immutable types.) Second: the namespaces whose functions' code is
    watched too (torch's top level has hundreds, each cheap to check but not free)."""
    kfuzz_modules = [m for n, m in list(sys.modules.items())
                     if isinstance(m, types.ModuleType) and (n == "kfuzz" or n.startswith("kfuzz."))]
    spaces = [torch, torch.nn.functional, torch.testing, torch.Tensor, torch.cuda, np, np.testing,
              builtins, math] + kfuzz_modules
    return spaces, [torch.nn.functional, torch.testing, np.testing] + kfuzz_modules


def _dict_of(space: Any) -> dict:
    """The dict behind a namespace (a class's ``__dict__`` is a read-only proxy of one)."""
    d = vars(space)
    if type(d) is dict:
        return d
    inner = [r for r in gc.get_referents(d) if type(r) is dict]
    return inner[0] if inner else dict(d)


_cache: list = []    # [len(sys.modules), namespaces, their dicts, ids of watched functions, tag views]

# Every assignment to a function's ``__code__`` raises the audit event "object.__setattr__"
# before it happens: the hook records the function and the code it still has, so a snapshot
# costs a list length. Reading ~700 functions' ``__code__`` on every call instead (one
# audit event each) cost a sandboxed worker ~0.7 ms a call in its escape-naming audit hook.
# A swap written into the function object through ctypes raises no event: like C code, out
# of a tripwire's reach.
_code_swaps: list = []


def _record_code_swap(event: str, args: tuple) -> None:
    if event == "object.__setattr__" and len(args) > 1 and args[1] == "__code__" \
            and type(args[0]) is types.FunctionType:
        _code_swaps.append((args[0], args[0].__code__))


sys.addaudithook(_record_code_swap)


def _watched() -> tuple[list, list, set, list | None]:
    """The namespaces, their dicts, the watched Python functions and the dicts' version-tag
    views (None without them; the cache keeps the dicts alive, so their views stay valid);
    recomputed when a module is imported."""
    if not _cache or _cache[0] != len(sys.modules):
        spaces, code_spaces = _watched_namespaces()
        funcs = {id(f) for s in code_spaces for f in list(vars(s).values()) if type(f) is types.FunctionType}
        dicts = [_dict_of(s) for s in spaces]
        _cache[:] = [len(sys.modules), spaces, dicts, funcs, None if _version is None else [_version(d) for d in dicts]]
    return _cache[1], _cache[2], _cache[3], _cache[4]


def _dict_version_reader():
    """CPython's version tag of a dict (PEP 509: every change to the dict moves it) through
    ctypes: a function that gives a dict's tag as a view whose ``value`` reads it (valid while
    the dict lives), or None where a probe does not see it move as it should (another
    interpreter or layout); the snapshot then compares every value on every call."""
    if sys.implementation.name != "cpython":
        return None
    try:
        import ctypes
        offset = 3 * ctypes.sizeof(ctypes.c_ssize_t)        # after ob_refcnt, ob_type, ma_used

        def view(d: dict):
            return ctypes.c_uint64.from_address(id(d) + offset)

        def read(d: dict) -> int:
            return view(d).value
        probe = {"a": 1}
        tags = [read(probe)]
        probe["a"] = 2
        tags.append(read(probe))
        probe["b"] = 3
        tags.append(read(probe))
        del probe["b"]
        tags.append(read(probe))
        if len(set(tags)) == 4 and read(probe) == tags[-1] and read({}) != tags[-1]:
            return view
    except Exception:
        pass
    return None


_version = _dict_version_reader()
_seen: dict[int, tuple[int, list, list]] = {}    # id(dict) -> (version, keys, values) when last read
_last: list = []    # the last snapshot's [tags, dicts, keys, values]: reused while no tag moved

_TORCH_DIR = os.path.dirname(torch.__file__)


def _torch_wraps(new: Any, old: Any) -> bool:
    """Whether ``new`` is torch's own wrapper around ``old``: importing torch._dynamo (lazily,
    perhaps inside a kernel's first call) replaces torch.manual_seed with one. A wrapper
    whose code lives in torch's files and that wraps the very original is harmless."""
    code = getattr(new, "__code__", None)
    return (getattr(new, "__wrapped__", None) is old and code is not None
            and os.path.abspath(code.co_filename).startswith(_TORCH_DIR + os.sep))


def _private_state(name: str, value: Any) -> bool:
    """A module's private flag or cache (``kfuzz.target._LOADED``), which a kernel that calls
    a library function may legitimately rebind; private functions and classes stay watched."""
    return name.startswith("_") and not callable(value) and not isinstance(value, types.ModuleType)


def _cuda_lazy_init(space: Any, name: str, value: Any) -> bool:
    """Whether ``name`` is state torch's own CUDA initialization sets: the first CUDA call in a
    process (perhaps the kernel's) fills ``torch.cuda.default_generators``, empty until then.
    Putting the empty tuple back would break every later ``torch.cuda.manual_seed``."""
    return space is torch.cuda and name == "default_generators" and value == ()


class NamespaceSnapshot:
    """The identities of the watched namespaces' attributes and of their functions' code,
    taken before a kernel call; ``undo`` names and reverts what the call replaced.

    Cheap enough for every call: where CPython's dict version tags can be read, a namespace
    whose tag did not move during the call is unchanged, and its values are listed only when
    its tag moved since they were last listed; elsewhere every value is compared (identity
    first, in C). A replaced attribute keeps its place in its dict, so listing keys and values
    is enough to say which one it was."""

    __slots__ = ("spaces", "dicts", "views", "tags", "keys", "values", "funcs", "codes")

    def __init__(self):
        self.spaces, self.dicts, self.funcs, self.views = _watched()
        self.tags = None if self.views is None else [v.value for v in self.views]
        if self.tags is None:
            self.keys = [list(d) for d in self.dicts]
            self.values = [list(d.values()) for d in self.dicts]
        elif _last and _last[0] == self.tags and _last[1] is self.dicts:    # nothing moved since
            self.keys, self.values = _last[2], _last[3]
        else:
            self.keys, self.values = [], []
            for d, tag in zip(self.dicts, self.tags):
                seen = _seen.get(id(d))
                if seen is None or seen[0] != tag:
                    seen = _seen[id(d)] = (tag, list(d), list(d.values()))
                self.keys.append(seen[1])
                self.values.append(seen[2])
            _last[:] = [self.tags, self.dicts, self.keys, self.values]
        self.codes = len(_code_swaps)

    def _changed_keys(self, i: int) -> tuple[list[str], dict]:
        now = self.dicts[i]
        if self.tags is not None:
            if self.views[i].value == self.tags[i]:
                return [], {}
        else:
            try:
                if len(now) == len(self.values[i]) and list(now.values()) == self.values[i]:
                    return [], {}
            except Exception:                    # a replacement whose __eq__ raises
                pass
        before = dict(zip(self.keys[i], self.values[i]))
        # names added are not counted (a lazy import of a submodule during the call adds one
        # legitimately) unless they shadow an inherited one: torch.Tensor.__eq__ is TensorBase's
        space = self.spaces[i]
        inherited = [vars(b) for b in space.__mro__[1:]] if isinstance(space, type) else []
        changed = [k for k in before if now.get(k, _MISSING) is not before[k]
                   and not _torch_wraps(now.get(k, _MISSING), before[k]) and not _private_state(k, before[k])
                   and not _cuda_lazy_init(space, k, before[k])]
        shadowing = [k for k in now if k not in before and any(k in d for d in inherited)]
        return changed + shadowing, before

    def undo(self) -> list[str]:
        """What the call replaced or removed, as ``namespace.name``; restores each."""
        if self.tags is not None and len(_code_swaps) == self.codes and [v.value for v in self.views] == self.tags:
            return []
        changed = []
        for i, space in enumerate(self.spaces):
            keys, before = self._changed_keys(i)
            for key in keys:
                changed.append(f"{getattr(space, '__name__', space)}.{key}")
                try:
                    if key in before:
                        setattr(space, key, before[key])
                    else:
                        delattr(space, key)
                except (AttributeError, TypeError):
                    pass
        swaps = _code_swaps[self.codes:]
        for f, code in reversed(swaps):          # the oldest code last: it is what f had
            if id(f) in self.funcs:
                name = f"{f.__module__}.{f.__qualname__}.__code__"
                if name not in changed:
                    changed.append(name)
                f.__code__ = code
        del _code_swaps[self.codes:]             # the restores above were recorded too
        return changed


try:     # the handler as set, without signal.getsignal's conversion to an enum (read twice a call)
    from _signal import getsignal as _getsignal
except ImportError:     # pragma: no cover - another interpreter
    _getsignal = signal.getsignal
_SIGNALS = tuple(getattr(signal, n) for n in ("SIGALRM", "SIGVTALRM", "SIGPROF", "SIGUSR1", "SIGUSR2")
                 if hasattr(signal, n))


def current_hooks() -> tuple:
    """The ways to run code later without a thread: trace and profile functions (this
    thread's and new threads'), garbage-collection callbacks, timer and user signal handlers."""
    return (sys.gettrace(), sys.getprofile(), getattr(threading, "_trace_hook", None),
            getattr(threading, "_profile_hook", None), tuple(gc.callbacks),
            tuple(_getsignal(s) for s in _SIGNALS))


def restore_hooks(hooks: tuple) -> list[str]:
    """Put back the hooks of ``current_hooks()``; returns the names of those that had changed."""
    trace, profile, thread_trace, thread_profile, callbacks, handlers = hooks
    now = current_hooks()
    names = ["sys.settrace", "sys.setprofile", "threading.settrace", "threading.setprofile", "gc.callbacks",
             "signal handlers"]
    changed = [n for n, a, b in zip(names, hooks, now) if a != b]
    if changed:
        sys.settrace(trace)
        sys.setprofile(profile)
        threading._trace_hook, threading._profile_hook = thread_trace, thread_profile
        gc.callbacks[:] = callbacks
        if threading.current_thread() is threading.main_thread():
            for s, h in zip(_SIGNALS, handlers):
                if h is not None:
                    signal.signal(s, h)
    return changed


def _idle_pool_worker(frame) -> bool:
    """A thread pool's worker waiting for work with none queued (torch.compile leaves one
    behind after compiling): started by the call, but no work of the call is pending in it."""
    code = frame.f_code
    if code.co_name != "_worker" or not code.co_filename.endswith(os.path.join("concurrent", "futures", "thread.py")):
        return False
    queue = frame.f_locals.get("work_queue")
    return queue is not None and queue.empty()


def _monitor_asleep(frame) -> bool:
    """tqdm's monitor thread (the first progress bar starts it, torch.compile's autotuning bar
    among them) asleep between its checks of the bars: it refreshes progress bars, nothing of
    the call's."""
    if frame.f_code.co_name != "wait":
        return False
    monitor = os.path.join("tqdm", "_monitor.py")
    while frame is not None:
        if frame.f_code.co_name == "run" and frame.f_code.co_filename.endswith(monitor):
            return True
        frame = frame.f_back
    return False


def threads_left(before: set[int]) -> list[str]:
    """Python threads started during the call and still running: ``name in function``."""
    left = []
    for ident, frame in sys._current_frames().items():
        if ident in before or _idle_pool_worker(frame) or _monitor_asleep(frame):
            continue
        thread = threading._active.get(ident)
        name = thread.name if thread is not None else f"thread {ident}"
        left.append(f"{name} in {frame.f_code.co_name}")
    return left


def overlapping(t: torch.Tensor) -> bool:
    """Whether two indices of ``t`` address the same element (a stride-0 or overlapping view)."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1)
    span = 1
    for stride, n in dims:
        if stride < span:
            return True
        span = stride * n
    return False
