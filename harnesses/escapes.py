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

Each is bounded so that, run unconfined by mistake, it cannot harm the machine: at most
8 GiB, three short-lived children, one small probe file per place (``PROBE``), one socket,
two minutes of spinning. Unconfined, each then returns the correct sum (a ``pass``): a
sandbox that lets one through shows as a missing verdict, not as damage.
"""
import os
import socket
import subprocess
import time
from pathlib import Path

import torch

from kfuzz.target import Arg, Dim, Output, target, variant

PROBE = "kfuzz-escape-probe.txt"
MEMORY_CAP = 8 << 30
REPO = Path(__file__).resolve().parents[1]


def probe_paths() -> list[Path]:
    """Where ``escapes.write`` tries to write: the user's home and the repository's corpus."""
    return [Path.home() / PROBE, REPO / "crashes" / PROBE]


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


variant("escapes", "escapes.memory", memory, planted_bug="allocates 64 MiB blocks until it dies (capped at 8 GiB)")
variant("escapes", "escapes.fork", fork, planted_bug="forks three children and runs a subprocess")
variant("escapes", "escapes.write", write, planted_bug="writes a probe file into $HOME and the repository's crashes/")
variant("escapes", "escapes.network", network, planted_bug="opens a TCP connection to 1.1.1.1:53")
variant("escapes", "escapes.spin", spin, planted_bug="spins the CPU for two minutes")
variant("escapes", "escapes.forge", forge, planted_bug="sends kfuzz a forged 'pass' through its worker's pipe")
variant("escapes", "escapes.shrink", shrink,
        planted_bug="doubles every sum; on inputs of at most two elements also writes escapes.write's files")
