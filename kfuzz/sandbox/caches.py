"""The compile caches of a worker: Triton's, torch.compile's and other libraries'
(``compile_cache``), in the worker's own directory or a campaign's shared folder, never the
user's; and the CUDA driver stubs that kfuzz builds once, in a process of its own
(``build_driver_stubs``), which seed a worker's own cache (``STUBS_ENV``).

Refuses nothing itself: the cache ``compile_cache`` returns is among what ``confine`` lets a
worker write (with its own directory and ``Policy.writable``); the stubs' folder is not, and a
worker copies it.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile

STUBS_ENV = "KFUZZ_TRITON_STUBS"    # a Triton cache holding only the driver stubs kfuzz built

# the on-disk caches of what a kernel may compile with, each found through the environment
# variable that its library or driver reads, by default beneath the user's home: CuPy's
# kernels (~/.cupy/kernel_cache), Numba's (__pycache__ beside the source), the CUDA driver's
# PTX JIT (~/.nv/ComputeCache), torch's runtime-compiled kernels (~/.cache/torch/kernels).
# Beneath the worker's cache, a library caching its compiles is no escape.
LIBRARY_CACHES = {"CUPY_CACHE_DIR": "cupy", "NUMBA_CACHE_DIR": "numba", "CUDA_CACHE_PATH": "cuda-jit",
                  "PYTORCH_KERNEL_CACHE_PATH": "torch-kernels"}


def build_driver_stubs(folder: str, timeout: float = 300.0) -> bool:
    """Build Triton's CUDA driver stub (``cuda_utils``, which Triton compiles with the C
    compiler the first time a process meets a GPU) once, into ``folder`` (a Triton cache), in
    a process of its own: kfuzz's code, so trusted, and CUDA starts there, never in the caller.
    Whether it was built (not on a machine without CUDA or Triton). A worker whose Triton cache
    is its own copies the folder (``compile_cache``, with ``STUBS_ENV`` naming it) instead of
    compiling the stub again as it starts; no worker can write the folder."""
    code = ("import torch; torch.zeros(1, device='cuda'); from triton.runtime import driver; "
            "driver.active.get_current_device(); driver.active.utils")
    try:
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_CACHE_DIR": folder},
                           timeout=timeout, capture_output=True)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and bool(glob.glob(os.path.join(folder, "**", "*.so"), recursive=True))


def compile_cache(workdir: str) -> str:
    """Triton's cache for this worker: ``TRITON_CACHE_DIR`` when kfuzz's process set one (a
    campaign's cache), else a directory inside the worker's own, seeded with the driver stubs
    of ``STUBS_ENV``'s folder where kfuzz built them (``build_driver_stubs``); never the
    user's ~/.triton.
    torch.compile's (``TORCHINDUCTOR_CACHE_DIR``) goes beneath it, whatever the parent's
    environment says: a kernel that uses ``torch.compile`` writes there, not to
    /tmp/torchinductor_<user>, which a confined worker may not write. Temporary files
    (``TMPDIR``, ``tempfile``) go to a folder inside the worker's own directory, and
    torch.compile compiles in the worker itself (``TORCHINDUCTOR_COMPILE_THREADS=1``): its
    default is a pool of compile processes kept for later compiles, which would outlive the
    call that started them. The caches of ``LIBRARY_CACHES`` go beneath it too."""
    shared = os.environ.get("TRITON_CACHE_DIR")
    cache = shared or os.path.join(workdir, "triton-cache")
    stubs = os.environ.get(STUBS_ENV)
    if not shared and stubs and os.path.isdir(stubs):
        shutil.copytree(stubs, cache, dirs_exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = cache
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "torchinductor")
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    for name, folder in LIBRARY_CACHES.items():
        os.environ[name] = os.path.join(cache, folder)
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:     # imported already (a preloaded module): its setting was read then
        inductor.compile_threads = 1
    tmp = os.path.join(workdir, "tmp")
    os.makedirs(tmp, exist_ok=True)
    os.environ["TMPDIR"] = tempfile.tempdir = tmp
    os.makedirs(cache, exist_ok=True)
    return cache
