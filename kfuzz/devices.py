"""Devices: what ``--device`` names, checked against the machine, and how workers are spread
over the GPUs that are visible.

``resolve_device`` turns the text a user gave (``auto``, ``cpu``, ``cuda``, ``cuda:N``) into
the device kfuzz runs on: ``auto`` is ``cuda`` where torch sees a GPU, else ``cpu``.  A
device this machine does not have, or any other text, raises ``DeviceError`` (the CLI's exit
2), before anything runs or is saved.

``spread`` assigns a campaign's workers to devices: ``jobs`` workers over the GPUs visible,
round robin, so that each GPU gets one pool (its workers see only that GPU, through
``CUDA_VISIBLE_DEVICES``).  It is a pure function of the device list, so it is tested on a
machine without GPUs. ``shares_memory`` says whether a device's memory is shared by the
processes on it (a GPU's), where running out of it may be another process's doing.
"""
from __future__ import annotations

import os
import re
from typing import Sequence

from kfuzz.errors import KfuzzError

CHOICES = ("auto", "cpu", "cuda")


class DeviceError(KfuzzError):
    """A ``--device`` this machine cannot run on, or text that names no device."""


# what a Triton kernel compiled for the GPU raises when it is given CPU tensors
_COMPILED_TRITON_ON_CPU = "cannot be accessed from Triton (cpu tensor?)"


def compiled_triton_on_cpu(e: BaseException, device: str) -> DeviceError | None:
    """The error for ``e``, raised by a kernel called on ``device``, where it is a Triton
    kernel compiled for the GPU given CPU tensors: this process chose Triton's mode before the
    device was known (``kfuzz.target.prepare_triton``), so the kernel cannot run here; None
    for any other exception (the kernel's own)."""
    if not str(device).startswith("cpu") or os.environ.get("TRITON_INTERPRET") == "1" \
            or _COMPILED_TRITON_ON_CPU not in str(e):
        return None
    return DeviceError("a Triton kernel compiled for the GPU was called on CPU tensors: on the cpu device, "
                       "Triton kernels run under Triton's interpreter, which must be chosen before their "
                       "modules are imported (kfuzz's commands do; in Python, set TRITON_INTERPRET=1 first, "
                       f"or run on cuda): {type(e).__name__}: {e}")


def _cuda_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(text: str | None, cuda_count: int | None = None) -> str:
    """The device ``text`` names on this machine (``cuda_count``: the GPUs visible, by default
    torch's count): ``cpu``, ``cuda`` or ``cuda:N``.  Raises DeviceError naming what is wrong."""
    value = (text or "auto").strip().lower()
    count = _cuda_count() if cuda_count is None else cuda_count
    if value == "auto":
        return "cuda" if count else "cpu"
    if value == "cpu":
        return "cpu"
    m = re.fullmatch(r"cuda(?::(\d+))?", value)
    if m is None:
        raise DeviceError(f"--device {text!r} is not a device: give auto, cpu, cuda or cuda:N")
    if not count:
        raise DeviceError(f"--device {text}: this machine has no CUDA device that torch can use "
                          f"(torch.cuda.is_available() is False); use --device cpu or auto")
    if m.group(1) is not None and int(m.group(1)) >= count:
        raise DeviceError(f"--device {text}: only {count} CUDA device(s) are visible (cuda:0 to cuda:{count - 1})")
    return value


def visible_gpus(device: str, cuda_count: int | None = None) -> list[int]:
    """The GPU indices a campaign on ``device`` uses: all visible for ``cuda``, the one named
    for ``cuda:N``, none on the CPU."""
    if not device.startswith("cuda"):
        return []
    if ":" in device:
        return [int(device.split(":")[1])]
    count = _cuda_count() if cuda_count is None else cuda_count
    return list(range(count))


def spread(jobs: int, gpus: Sequence[int]) -> list[tuple[int | None, int]]:
    """Pools for ``jobs`` workers over ``gpus``: ``(gpu index, workers)`` for each GPU that gets
    at least one worker, round robin (the first GPUs get the extra ones); ``[(None, jobs)]``
    without GPUs (one pool on the CPU)."""
    if jobs < 1:
        raise ValueError("jobs must be >= 1")
    if not gpus:
        return [(None, jobs)]
    share = [jobs // len(gpus) + (i < jobs % len(gpus)) for i in range(len(gpus))]
    return [(g, n) for g, n in zip(gpus, share) if n]


def shares_memory(device: str) -> bool:
    """Whether the processes that run on ``device`` share its memory: a GPU's, where one
    process's allocation can fail for what the others hold (kernels audited at once, kfuzz's
    oracle and workers); on the CPU each worker has a limit of its own."""
    return str(device).startswith("cuda")
