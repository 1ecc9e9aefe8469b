"""The audit's builds apart from judging: the extension cache (``default_cache``), torch's
precompiled extension header (``precompile_headers``), Triton's driver stubs
(``driver_stubs``), and the confined build step alone (``build_kernels``).

``build_kernels`` runs only the build step that a kernel's process runs before judging, for
each solution that compiles, ``jobs`` at once, each with ``default_max_jobs`` ninja jobs; it
writes no record. ``check_build_step`` builds kfuzz's probe solution that way
before any solution's build is taken to say something about the solution.

Refuses (``KfuzzError``, ``check_build_step``) a machine where the probe does not build: the
toolchain, or the sandbox's rules for it, would fail every solution alike.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from kfuzz.audit.policy import forkserver_context
from kfuzz.audit.process import KernelProcess
from kfuzz.errors import KfuzzError

if TYPE_CHECKING:
    from kfuzz.kernelbench.corpus import CorpusEntry


def default_cache() -> Path:
    """Compiled extensions, one folder per solution hash, outside any results folder:
    ``$XDG_CACHE_HOME/kfuzz/extensions`` (``~/.cache/kfuzz/extensions``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kfuzz" / "extensions"


PCH_FOLDER = "pch"      # beneath the extension cache: torch's extension header, precompiled


def default_max_jobs(jobs: int) -> int:
    """Ninja's jobs in each build: ``$MAX_JOBS``, else this machine's cores shared among the
    ``jobs`` kernels at once, and at least 2 (a ``load_inline`` build has a host file and a CUDA
    file, which then compile side by side; the judging of the kernels already built leaves cores
    idle)."""
    return int(os.environ.get("MAX_JOBS") or 0) or max(2, (os.cpu_count() or 1) // max(1, jobs))


def precompile_headers(entries: Iterable[CorpusEntry], root: str | Path) -> dict[tuple[str, ...], str | None]:
    """torch's extension header precompiled beneath ``root`` for each distinct set of host-file
    flags among ``entries``' ``load_inline`` calls (read statically; none given: the default
    flags), most used first (``kfuzz.kernelbench.pch.ensure_pch``), each marked pending first
    (``mark_pending``: the builds that need one wait for it). Runs in kfuzz's process:
    the compiler sees torch's header and the flags, never a solution's code. Returns each flag
    set's folder (None: could not be made)."""
    from collections import Counter
    from kfuzz.kernelbench.pch import cflag_sets, ensure_pch, mark_pending
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
    from kfuzz.kernelbench.pch import ensure_pch
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
    ctx = forkserver_context()
    args = ("cpu" if device is None else device, [], 0, str(Path(cache).resolve()), 1,
            max_jobs or default_max_jobs(jobs), timeout, dict(policy or {}), str(pch_root) if pch_root else None, None,
            timeout, None, slim)
    queue = [e for e in entries if e.pair is not None and e.compiles]
    running: list[KernelProcess] = []
    try:
        while queue or running:
            while queue and len(running) < jobs:
                running.append(KernelProcess(ctx, queue.pop(0), args, timeout, build_only=True))
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
