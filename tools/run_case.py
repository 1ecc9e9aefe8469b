"""Run one case, given as the JSON that `kfuzz show` and the gates print, once through its
target's kernel, and print the outputs' largest magnitudes or the traceback.

    CUDA_LAUNCH_BLOCKING=1 python tools/run_case.py '{"target": "gdn_bwd", "dtype": "bfloat16",
        "seed": 4234763551, "dims": {"B": 4, "H": 16, "K": 33, "T": 16, "V": 64}}' --device cuda

For a GPU fault: with launches synchronous the traceback names the launch that faulted, and
under compute-sanitizer the address.  It judges nothing (`kfuzz replay` and the gates do);
it runs the kernel in this process, not in a sandboxed worker, so that the fault's traceback
and the sanitizer's report reach the terminal.  Exit 0 when the call returned, 1 when it
raised.
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", help="the case as JSON (target, dtype, seed, dims; args optional)")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    import torch
    from kfuzz import target as targets
    from kfuzz.case import SCHEMA, Case
    from kfuzz.errors import KfuzzError
    from kfuzz.tensors import materialize
    try:
        d = json.loads(a.case)
        case = Case.from_json({"args": {}, "payload": None, "kfuzz": SCHEMA, **d})
        target = targets.get_target(case.target)
        inputs = materialize(case, target, a.device)
    except (ValueError, KfuzzError) as e:   # bad JSON, a bad case, an unknown target, a refused shape
        ap.error(f"case {a.case!r}: {e}")
    targets.prepare_triton()
    try:
        out = target.kernel(**inputs)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
    except Exception:  # noqa: BLE001  (the point is to show it)
        traceback.print_exc()
        print("CASE RAISED")
        return 1
    outs = out if isinstance(out, (tuple, list)) else (out,)
    print("CASE RETURNED", [None if o is None else float(o.float().abs().max()) for o in outs])
    return 0


if __name__ == "__main__":
    sys.exit(main())
