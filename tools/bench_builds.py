"""Build time of corpus kernels' ``load_inline`` extensions, cold, with and without torch's
precompiled extension header: the audit's own confined build step, one kernel at a time.

    python tools/bench_builds.py CORPUS... [--limit 4] [--max-jobs N] [--jobs 1] [--json FILE]

Takes the first ``--limit`` compiling solutions of the corpora with distinct sources (on a
machine without CUDA, only those without ``cuda_sources``: their host file alone). Each mode
builds into a fresh, empty extension cache: ``none`` (no precompiled header) and ``pch`` (the
headers made first by ``kfuzz.audit.precompile_headers``; that one-time cost is its own row).
Prints a table: per kernel the build step's seconds (as the build step measured them: the
solution's module, ``ModelNew``, the compile) and the wall seconds of its process, whether the
host file found a precompiled header, and the total.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from kfuzz.audit import build_kernels, precompile_headers, read_corpus


def pick(corpora: list[str], limit: int, cuda: bool) -> list:
    out, seen = [], set()
    for path in corpora:
        for e in read_corpus(path):
            if e.pair is None or not e.compiles or e.pair.custom_sha in seen:
                continue
            if not cuda and "cuda_sources" in e.pair.custom_code:
                continue
            seen.add(e.pair.custom_sha)
            out.append(e)
            if len(out) >= limit:
                return out
    return out


def run(entries, modes, jobs, max_jobs, device, timeout) -> list[dict]:
    rows = []
    for mode in modes:
        cache = Path(tempfile.mkdtemp(prefix=f"kfuzz-bench-builds-{mode}-"))
        try:
            pch_root = None
            if mode == "pch":
                pch_root = cache / "pch"
                t = time.monotonic()
                made = precompile_headers(entries, pch_root)
                rows.append({"mode": mode, "key": "(precompiled headers, once)", "status": "made" if all(
                    made.values()) else f"{sum(v is None for v in made.values())} of {len(made)} failed",
                    "build_s": None, "wall_s": round(time.monotonic() - t, 1),
                    "pch": f"{len(made)} flag set(s)"})
            start = time.monotonic()
            for rec in build_kernels(entries, cache, device=device, jobs=jobs, max_jobs=max_jobs,
                                     timeout=timeout, pch_root=pch_root):
                b = rec["build"] or {}
                rows.append({"mode": mode, "key": rec["key"], "status": b.get("status") or rec.get("ended"),
                             "build_s": b.get("seconds"), "wall_s": round(rec["seconds"], 1),
                             "pch": "yes" if b.get("pch") else "no",
                             "error": (b.get("error") or b.get("detail") or "")[:120]})
            rows.append({"mode": mode, "key": "(all kernels)", "status": "", "build_s": round(sum(
                r["build_s"] or 0 for r in rows if r["mode"] == mode and r["build_s"] is not None), 1),
                "wall_s": round(time.monotonic() - start, 1), "pch": ""})
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| mode | kernel | status | build step s | wall s | precompiled header |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['mode']} | {r['key']} | {r['status']} | {'' if r['build_s'] is None else r['build_s']} | "
                   f"{r['wall_s']} | {r['pch']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpora", nargs="+")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=1, help="builds at once")
    ap.add_argument("--max-jobs", type=int, default=None, help="ninja's jobs per build (default as kfuzz audit's)")
    ap.add_argument("--modes", default="none,pch", help="comma-separated: none, pch")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if not modes or set(modes) - {"none", "pch"}:
        ap.error(f"--modes {a.modes!r}: want none and/or pch")
    entries = pick(a.corpora, a.limit, torch.cuda.is_available())
    if not entries:
        ap.error("no compiling solution to build here")
    rows = run(entries, modes, a.jobs, a.max_jobs, a.device, a.timeout)
    print(table(rows))
    for r in rows:
        if r.get("error"):
            print(f"{r['mode']} {r['key']}: {r['error']}", file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
