"""The audited kernels' confinement: the sandbox policies of a kernel's workers
(``kernel_policy``) and of its build step (``build_policy``), and what this machine's OS layers
enforce of them (``confinement``).

The probe confines a throwaway process started as the kernels' processes are, from the
forkserver every process of the audit comes from (``forkserver_context``, whose server never
touches CUDA), so that its report is what the kernels would get. ``OS_LAYERS`` are what an OS
layer must block for the kernels (network, writes, processes); ``unconfined_layers`` names
those a report leaves open, on which ``kfuzz.audit.run.run_audit`` refuses to run untrusted
code unless told to.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kfuzz import sandbox


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


def forkserver_context():
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
    ctx = forkserver_context()
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
