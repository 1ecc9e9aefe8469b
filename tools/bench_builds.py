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

``--cuda-phases``: the CUDA file alone (``cuda.cu``, which no precompiled header reaches), for
solutions whose ``cuda_sources`` and ``extra_cuda_cflags`` are literals or module-level
constants, written as torch's ``load_inline`` writes it and compiled by ``nvcc`` with the flags
torch's ninja file gives it for ``--arch``, one at a time, with ``nvcc --time``. Prints a table
of the seconds of each of nvcc's phases (the host preprocessing, ``cudafe++``, ``cicc``, ``ptxas``,
the host compile), the wall seconds and the CPU seconds of nvcc's processes; with ``--slim``,
each file also as the audit's build step compiles it first (its torch frontend includes slimmed,
``kfuzz.kernelbench.cuda_compile.slim_cuda_source``). Needs nvcc and torch's headers, not a GPU:

    python tools/bench_builds.py CORPORA/kernelbench-leaderboard.json --limit 3 --cuda-phases --slim --arch 9.0
"""
from __future__ import annotations

import argparse
import ast
import csv
import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.utils.cpp_extension as ext

from kfuzz.audit import build_kernels, precompile_headers
from kfuzz.kernelbench.cuda_compile import slim_cuda_source
from kfuzz.kernelbench.corpus import read_corpus


def pick(corpora: list[str], limit: int, readable=None) -> list:
    """The first ``limit`` compiling solutions with distinct sources (``readable(code)``: only
    those it gives a value for)."""
    out, seen = [], set()
    for path in corpora:
        for e in read_corpus(path):
            if e.pair is None or not e.compiles or e.pair.custom_sha in seen:
                continue
            if readable is not None and readable(e.pair.custom_code) is None:
                continue
            seen.add(e.pair.custom_sha)
            out.append(e)
            if len(out) >= limit:
                return out
    return out


def inline_call(code: str) -> dict | None:
    """The first ``load_inline`` call's keyword arguments, each as its value where it is a literal
    or a module-level constant, else None (read with ``ast``: no solution code runs); None where
    the source has no such call."""
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
        if isinstance(v, ast.Name):
            return consts.get(v.id)
        try:
            return ast.literal_eval(v)
        except ValueError:
            return None
    for node in ast.walk(tree):
        f = node.func if isinstance(node, ast.Call) else None
        if (f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "") == "load_inline":
            return {k.arg: value(k.value) for k in node.keywords if k.arg}
    return None


def _text(sources) -> str | None:
    if isinstance(sources, str):
        return sources
    if isinstance(sources, list) and all(isinstance(x, str) for x in sources):
        return "\n".join(sources)
    return None


def host_sources(code: str) -> dict | None:
    """The first ``load_inline`` call's ``cpp_sources``, ``functions`` and ``extra_cflags`` where
    they are literals or module-level constants, and it has a separate ``cuda_sources``."""
    kw = inline_call(code)
    if kw is None:
        return None
    cpp, cuda, fns = kw.get("cpp_sources"), kw.get("cuda_sources"), kw.get("functions")
    flags = kw.get("extra_cflags") if "extra_cflags" in kw else []
    names = [fns] if isinstance(fns, str) else list(fns or [])
    text = _text(cpp) or ""
    host = (text and cuda is not None and flags is not None and "__global__" not in text and names
            and "PYBIND11_MODULE" not in text and not re.search(r"#include\s*[<\"](c10/cuda|ATen/cuda|cuda)", text)
            and all(isinstance(n, str) and re.search(rf"\b{re.escape(n)}\s*\(", text) for n in names))
    return {"cpp_sources": cpp, "functions": fns, "extra_cflags": list(flags)} if host else None


def cuda_sources(code: str) -> dict | None:
    """The first ``load_inline`` call's CUDA file as torch writes it (``cuda.cu``: torch's three
    includes, then ``cuda_sources``) and its ``extra_cuda_cflags``, where both are literals or
    module-level constants."""
    kw = inline_call(code)
    text = _text((kw or {}).get("cuda_sources"))
    flags = kw.get("extra_cuda_cflags") if kw and "extra_cuda_cflags" in kw else []
    if text is None or not isinstance(flags, (list, tuple)):
        return None
    return {"source": "\n".join([*TORCH_CUDA_PREFIX, text]), "extra_cuda_cflags": [str(f) for f in flags]}


# the lines torch's load_inline puts before a solution's cuda_sources in the CUDA file it builds
TORCH_CUDA_PREFIX = ("#include <torch/types.h>", "#include <cuda.h>", "#include <cuda_runtime.h>")

# nvcc's --time phases, by the start of their name, as the table's columns
NVCC_PHASES = (("gcc (preprocessing", "preprocess"), ("cudafe++", "cudafe++"), ("cicc", "cicc"),
               ("ptxas", "ptxas"), ("gcc (compiling)", "host compile"))


def nvcc_phases(csv_text: str) -> dict[str, float]:
    """Seconds per phase (``NVCC_PHASES``'s columns, and ``other``) from ``nvcc --time``'s CSV."""
    out = {name: 0.0 for _, name in NVCC_PHASES}
    out["other"] = 0.0
    rows = list(csv.reader(csv_text.splitlines()))
    for row in rows[1:]:
        if len(row) < 8 or row[7].strip() != "ms":
            continue
        phase = row[1].strip()
        if phase.startswith("nvcc (driver)"):     # the driver's own time, the phases' sum
            continue
        out[next((n for start, n in NVCC_PHASES if phase.startswith(start)), "other")] += float(row[6]) / 1000
    return out


def cuda_flags(extra_cuda_cflags, cuda_home: str, arch: str) -> tuple[str, list[str]]:
    """nvcc and the flags torch's ninja file gives a ``load_inline`` CUDA file for ``arch``
    (``TORCH_CUDA_ARCH_LIST``'s form, e.g. ``9.0``)."""
    ext.CUDA_HOME = cuda_home
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    with tempfile.TemporaryDirectory(prefix="kfuzz-bench-nvcc-") as d:
        path = Path(d) / "build.ninja"
        ext._write_ninja_file_to_build_library(
            path=str(path), name="kfuzz_bench_cuda", sources=[str(Path(d) / "cuda.cu")], extra_cflags=[],
            extra_cuda_cflags=list(extra_cuda_cflags), extra_sycl_cflags=[], extra_ldflags=[], extra_include_paths=[],
            with_cuda=True, with_sycl=False, is_standalone=False)
        lines = dict(line.split(" = ", 1) for line in path.read_text().splitlines() if " = " in line)
    flags = shlex.split(lines.get("cuda_cflags", "")) + shlex.split(lines.get("cuda_post_cflags", ""))
    return lines["nvcc"].strip(), flags


def run_cuda(entries, cuda_home: str, arch: str, slim: bool = False) -> list[dict]:
    """Each entry's CUDA file compiled by nvcc here, one at a time, with torch's flags and
    ``--time``: seconds per nvcc phase, wall seconds and the CPU seconds of nvcc's processes.
    With ``slim``, also the file as the audit's build step compiles it first
    (``kfuzz.kernelbench.cuda_compile.slim_cuda_source``), where slimming changes it."""
    rows = []
    root = Path(tempfile.mkdtemp(prefix="kfuzz-bench-cuda-"))
    try:
        files = []
        for e in entries:
            src = cuda_sources(e.pair.custom_code)
            files.append((e, "as written", src))
            slimmed = slim_cuda_source(src["source"]) if slim else None
            if slimmed is not None:
                files.append((e, "slimmed", {**src, "source": slimmed}))
        for i, (e, form, src) in enumerate(files):
            nvcc, flags = cuda_flags(src["extra_cuda_cflags"], cuda_home, arch)
            folder = root / str(i)
            folder.mkdir()
            (folder / "cuda.cu").write_text(src["source"])
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.monotonic()
            p = subprocess.run([nvcc, *flags, "-c", "cuda.cu", "-o", "cuda.o", "--time", "phases.csv"], cwd=folder,
                               capture_output=True, text=True)
            wall = time.monotonic() - t
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            phases = nvcc_phases((folder / "phases.csv").read_text()) if (folder / "phases.csv").is_file() else {}
            rows.append({"key": e.key, "source": form, "status": "compiled" if p.returncode == 0 else
                         f"failed: {(p.stderr or p.stdout).strip()[-160:]}", "phases": phases,
                         "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def cuda_table(rows: list[dict]) -> str:
    names = [n for _, n in NVCC_PHASES] + ["other"]
    out = ["| kernel | CUDA file | status | " + " | ".join(f"{n} s" for n in names) + " | wall s | CPU s |",
           "| --- | --- | --- |" + " ---: |" * (len(names) + 2)]
    for r in rows:
        out.append(f"| {r['key']} | {r['source']} | {r['status']} | " + " | ".join(f"{r['phases'].get(n, 0):.1f}" for n in names)
                   + f" | {r['wall_s']} | {r['cpu_s']} |")
    return "\n".join(out)


def run_host(entries, modes, pch_root: Path | None = None) -> list[dict]:
    """Each entry's host file compiled by torch's ``load_inline`` here, cold, per mode; the
    precompiled headers beneath ``pch_root`` where given (kept, and reused by a later run)."""
    from kfuzz.kernelbench.pch import cflag_sets, ensure_pch, use_pch
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
    ap.add_argument("--cuda-phases", action="store_true",
                    help="the CUDA file alone, compiled here by nvcc --time: seconds per phase (no GPU needed)")
    ap.add_argument("--slim", action="store_true",
                    help="--cuda-phases: also each file slimmed as the audit's build step compiles it first")
    ap.add_argument("--arch", default=None, help="--cuda-phases: TORCH_CUDA_ARCH_LIST's form (default: "
                    "$TORCH_CUDA_ARCH_LIST, else this GPU's, else 9.0)")
    ap.add_argument("--cuda-home", default=None, help="--cuda-phases: the CUDA toolkit (default: $CUDA_HOME, "
                    "torch's, else /usr/local/cuda)")
    a = ap.parse_args(argv)
    if a.cuda_phases:
        home = a.cuda_home or os.environ.get("CUDA_HOME") or ext.CUDA_HOME or "/usr/local/cuda"
        if not Path(home, "bin", "nvcc").is_file():
            ap.error(f"--cuda-phases: no nvcc in {home}/bin (give --cuda-home)")
        arch = a.arch or os.environ.get("TORCH_CUDA_ARCH_LIST") or (
            "{}.{}".format(*torch.cuda.get_device_capability()) if torch.cuda.is_available() else "9.0")
        entries = pick(a.corpora, a.limit, cuda_sources)
        if not entries:
            ap.error("no solution whose CUDA sources can be read without running it")
        rows = run_cuda(entries, home, arch, a.slim)
        print(f"nvcc {home}, arch {arch}, one file at a time\n")
        print(cuda_table(rows))
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))
        return 0
    modes = [m for m in a.modes.split(",") if m]
    if not modes or set(modes) - {"none", "pch"}:
        ap.error(f"--modes {a.modes!r}: want none and/or pch")
    entries = pick(a.corpora, a.limit, host_sources if a.host_only else None)
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
