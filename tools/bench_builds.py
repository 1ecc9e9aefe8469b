"""Build time of corpus kernels' ``load_inline`` extensions, cold, with and without torch's
precompiled extension header: the audit's own confined build step, one kernel at a time.

    python tools/bench_builds.py CORPUS... [--limit 4] [--max-jobs N] [--jobs 1] [--json FILE]

Takes the first ``--limit`` compiling solutions of the corpora with distinct sources. Each
mode builds into a fresh, empty extension cache: ``none`` (no precompiled header) and ``pch``
(the headers made first by ``kfuzz.audit.precompile_headers``; that one-time cost is its own
row). Prints a table: per kernel the build step's seconds (as the build step measured them: the
solution's module, ``ModelNew``, the compile) and the wall seconds of its process, whether the
host file found a precompiled header, and the total.

``--host-only`` (the default where torch has no CUDA): the host file alone (``main.cpp``, the
part a precompiled header speeds up), for solutions whose ``load_inline`` call names its
``cpp_sources``, ``functions`` and ``extra_cflags`` as literals or module-level string
constants (read with ``ast``: no solution code runs). Each is built here by torch's
``load_inline`` without its CUDA file; the link leaves the CUDA functions undefined, so the
import that follows fails, after the compile that is timed.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from kfuzz.audit import build_kernels, precompile_headers, read_corpus


def pick(corpora: list[str], limit: int, host_only: bool) -> list:
    out, seen = [], set()
    for path in corpora:
        for e in read_corpus(path):
            if e.pair is None or not e.compiles or e.pair.custom_sha in seen:
                continue
            if host_only and host_sources(e.pair.custom_code) is None:
                continue
            seen.add(e.pair.custom_sha)
            out.append(e)
            if len(out) >= limit:
                return out
    return out


def host_sources(code: str) -> dict | None:
    """The first ``load_inline`` call's ``cpp_sources``, ``functions`` and ``extra_cflags`` where
    they are literals or module-level constants, and it has a separate ``cuda_sources``."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    consts = {}
    for n in tree.body:
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            try:
                consts[n.targets[0].id] = ast.literal_eval(n.value)
            except ValueError:
                pass

    def value(v):
        if v is None or isinstance(v, ast.Name):
            return consts.get(v.id) if v is not None else None
        try:
            return ast.literal_eval(v)
        except ValueError:
            return None
    for node in ast.walk(tree):
        f = node.func if isinstance(node, ast.Call) else None
        if (f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "") != "load_inline":
            continue
        kw = {k.arg: k.value for k in node.keywords}
        cpp, cuda, fns = value(kw.get("cpp_sources")), value(kw.get("cuda_sources")), value(kw.get("functions"))
        flags = value(kw.get("extra_cflags")) if "extra_cflags" in kw else []
        names = [fns] if isinstance(fns, str) else list(fns or [])
        text = cpp if isinstance(cpp, str) else "\n".join(map(str, cpp)) if isinstance(cpp, list) else ""
        host = (text and cuda is not None and flags is not None and "__global__" not in text and names
                and "PYBIND11_MODULE" not in text and not re.search(r"#include\s*[<\"](c10/cuda|ATen/cuda|cuda)", text)
                and all(isinstance(n, str) and re.search(rf"\b{re.escape(n)}\s*\(", text) for n in names))
        if host:
            return {"cpp_sources": cpp, "functions": fns, "extra_cflags": list(flags)}
        return None
    return None


def run_host(entries, modes, pch_root: Path | None = None) -> list[dict]:
    """Each entry's host file compiled by torch's ``load_inline`` here, cold, per mode; the
    precompiled headers beneath ``pch_root`` where given (kept, and reused by a later run)."""
    import torch.utils.cpp_extension as ext
    from kfuzz.kernelbench.build import cflag_sets, ensure_pch, use_pch
    rows = []
    for mode in modes:
        root = Path(tempfile.mkdtemp(prefix=f"kfuzz-bench-host-{mode}-"))
        try:
            pch = pch_root or root / "pch"
            if mode == "pch":
                t = time.monotonic()
                flags = list(dict.fromkeys(f for e in entries for f in cflag_sets(e.pair.custom_code) or [()]))
                made = [ensure_pch(pch, f) for f in flags]
                ready = sum(m is not None for m in made)
                rows.append({"mode": mode, "key": "(precompiled headers, once)", "status": f"{ready} of {len(made)} made",
                             "build_s": None,
                    "wall_s": round(time.monotonic() - t, 1), "pch": f"{len(made)} flag set(s)"})
                use_pch(pch)
            total = 0.0
            for i, e in enumerate(entries):
                src = host_sources(e.pair.custom_code)
                t = time.monotonic()
                status = "built"
                (root / str(i)).mkdir(parents=True)
                try:
                    ext.load_inline(f"kfuzz_bench_host_{i}", src["cpp_sources"], functions=src["functions"],
                                    extra_cflags=src["extra_cflags"], build_directory=str(root / str(i)))
                except ImportError:
                    status = "compiled (import fails: CUDA functions undefined)"
                except Exception as err:
                    status = f"failed: {type(err).__name__}: {str(err)[-200:]}"
                took = time.monotonic() - t
                total += took
                ninja = root / str(i) / "build.ninja"
                used = ninja.is_file() and f"-I{pch}" in ninja.read_text()
                rows.append({"mode": mode, "key": e.key, "status": status, "build_s": round(took, 1),
                             "wall_s": round(took, 1), "pch": "yes" if used else "no"})
            rows.append({"mode": mode, "key": "(all kernels)", "status": "", "build_s": round(total, 1),
                         "wall_s": round(total, 1), "pch": ""})
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return rows


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
    ap.add_argument("--pch-root", type=Path, help="--host-only: keep the precompiled headers here (reused if there)")
    ap.add_argument("--host-only", action=argparse.BooleanOptionalAction, default=not torch.cuda.is_available(),
                    help="the host file alone, built here (default where torch has no CUDA)")
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if not modes or set(modes) - {"none", "pch"}:
        ap.error(f"--modes {a.modes!r}: want none and/or pch")
    entries = pick(a.corpora, a.limit, a.host_only)
    if not entries:
        ap.error("no compiling solution to build here")
    rows = run_host(entries, modes, a.pch_root) if a.host_only else run(entries, modes, a.jobs, a.max_jobs, a.device, a.timeout)
    print(table(rows))
    for r in rows:
        if r.get("error"):
            print(f"{r['mode']} {r['key']}: {r['error']}", file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
