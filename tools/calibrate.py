"""Calibrate the bound: at which multiple of the bound does each tolerance-based verdict change?

    python tools/calibrate.py [--seeds 0,1,2] [--targets softmax,rowsum,...]
    python tools/calibrate.py --family gdn [--seeds 0,1,2] [--targets gdn_fwd,...]

Runs the tolerance-based gates (G01 reference, G02 distributions, G03 shapes,
G04 layouts, G12 gradients) on every operator target and its planted-bug
variants, and reads each gate's worst error/bound ratio r at the current
``BOUND_C``. The bound is linear in C (its only other term, 4 x the smallest
normal, is below any error that matters), so with the bound multiplied by a
factor f the gate passes iff r <= f: r is the factor at which its verdict
changes. ``--check`` re-runs the gates with C = BOUND_C x f at the grid factors
on either side of r and asserts the verdicts flip there, so the reading is
measured, not assumed.

Writes reports/calibration.md (the table, per target and gate, over the grid of factors
1/16 ... 1024) and reports/calibration.png (each gate's needed C, correct kernels against
planted bugs, with the chosen C).

``--family gdn`` measures the GDN targets instead (harnesses/gdn.py), whose bound
in force is C x the target's ``bound_scale`` (``BOUND_SCALE``): the ratios, the
grid factors and ``--check`` are all relative to that bound. They have no planted
variants; the evidence on the other side is the real bugs the bound caught, read
from the ``bound-*`` records under crashes/gdn_* (each verdict's ratio as it was
when found). Writes reports/calibration_gdn.md and reports/calibration_gdn.png. It refuses a
target list whose members have different ``bound_scale`` (one table, one bound).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from kfuzz.compare import BOUND_C, error_scale
from kfuzz.corpus import iter_case_files, load
from kfuzz.gates import GATES, run_gate
from kfuzz.target import load_targets
from kfuzz.dtypes import unit_roundoff

os.environ.setdefault("KFUZZ_FIXTURES", "1")   # the gates' positive controls are test-suite targets (kfuzz.fixtures)

TOLERANCE_GATES = ("G01", "G02", "G03", "G04", "G12")
FACTORS = [2.0 ** k for k in range(-4, 11)]          # 1/16 ... 1024
OPERATORS = ("softmax", "rowsum", "layernorm", "rmsnorm", "matmul", "cumsum")
# GDN default: ~20 CPU-minutes at 3 seeds on a 2-core CPU (the five gates a seed: gdn_fwd and
# gdn_fwd_kda ~90 s, gdn_bwd ~3 min): the scalar gate with delta both ways, and the vector gate (KDA);
# the other members (--targets) are not in the default for time
GDN_DEFAULT = ("gdn_fwd", "gdn_bwd", "gdn_fwd_kda")
GDN_CRASHES = ("crashes/gdn_fwd", "crashes/gdn_bwd")
# bound-* records there of failures that were not the kernels' (docs/findings.md), kept as
# regression cases of kfuzz's judging and of its patch of Triton's interpreter: no evidence
# about the bound's power on kernel bugs
NOT_THE_KERNEL = {
    "72a5ce842e0465fd": "the trusted reference's gate gradient turned NaN before the NaN's tokens",
    "7313fe281a49ee36": "the trusted reference's overflow NaN beside a NaN the inputs carry",
    "81b43ef0502e9468": "Triton's interpreter rounded fp32 to bf16 by truncation",
    "ce947f63521eb8af": "the trusted reference's gate gradient saw the chunk-entry state in fp32, not as stored (bf16)",
    "be37e7ee416bc34e": "the trusted reference's gate gradient saw the chunk-entry state in fp32, not as stored (bf16)",
    "43bbc00756014bd7": "the trusted reference's bf16 rounding of v_new cancelled its bf16 rounding of u "
                        "(the kernel's ht is that one rounding of u from the oracle's)",
    "f8979a50785b0285": "the trusted reference's bf16 roundings cancelled (the kernel's dg is the oracle's "
                        "with h0 and v_new rounded to bf16, as it stores them)",
}


def _fmt(f: float) -> str:
    return f"1/{int(1 / f)}" if f < 1 else f"{int(f)}"


def measure(names, seeds, log):
    targets = load_targets()
    rows = {}
    for name in names:
        t = targets[name]
        rows[name] = {}
        for gid in TOLERANCE_GATES:
            worst, kinds, status = 0.0, set(), "n/a"
            for seed in seeds:
                r = run_gate(GATES[gid], t, seed)
                if r.status == "n/a":
                    break
                status = "fail" if r.status == "fail" or status == "fail" else "pass"
                worst = max(worst, r.worst_ratio)
                if r.first_failure is not None:
                    kinds.add(r.first_failure[1].kind)
            rows[name][gid] = {"status": status, "ratio": worst, "kinds": sorted(kinds)}
            log(f"{name} {gid}: {status} worst error/bound {worst:.3g} {sorted(kinds) or ''}")
    return rows


def changes_at(cell) -> str:
    """The smallest grid factor at which the gate passes ('-' if n/a)."""
    if cell["status"] == "n/a":
        return "n/a"
    if set(cell["kinds"]) - {"bound"}:
        return "never (" + ",".join(sorted(set(cell["kinds"]) - {"bound"})) + ")"
    for f in FACTORS:
        if cell["ratio"] <= f:
            return _fmt(f)
    return f">{_fmt(FACTORS[-1])}"


def check_flip(names, rows, seed, log, mismatches):
    """Re-run each bound-only verdict at the grid factors around its ratio: they must differ."""
    targets = load_targets()
    checked = 0
    for name in names:
        for gid, cell in rows[name].items():
            r = cell["ratio"]
            if cell["status"] == "n/a" or set(cell["kinds"]) - {"bound"} or not (FACTORS[0] < r <= FACTORS[-1]):
                continue
            above = min(f for f in FACTORS if f >= r)
            below = max(f for f in FACTORS if f < r)
            hi = run_gate(GATES[gid], targets[name], seed, c=BOUND_C * above)
            lo = run_gate(GATES[gid], targets[name], seed, c=BOUND_C * below)
            log(f"check {name} {gid}: x{_fmt(below)} {lo.status}, x{_fmt(above)} {hi.status}")
            checked += 1
            if hi.status != "pass" or lo.status != "fail":
                mismatches.append(f"`{name}` {gid}: x{_fmt(below)} {lo.status}, x{_fmt(above)} {hi.status}")
    return checked


def bound_when_found(case, metrics: dict, targets) -> float | None:
    """The C x scale in force when a verdict was recorded, from its metrics: each output's
    bound_norm / max(trusted_err_norm, FLOOR_ULPS u ||o||) (||o|| = err_norm / rel_err), the least
    over the outputs (the smallest-normal term, left out, only adds to it). None if unreadable."""
    implied = []
    for out in {k.rsplit(".", 1)[0] for k in metrics}:
        m = {k: metrics.get(f"{out}.{k}") for k in ("bound_norm", "err_norm", "rel_err", "trusted_err_norm")}
        if None in m.values() or not m["rel_err"] or case.target not in targets:
            continue
        u = unit_roundoff(targets[case.target].output_dtype(out, case.dtype))
        den = error_scale(m["trusted_err_norm"], u, m["err_norm"] / m["rel_err"])
        if den > 0:
            implied.append(m["bound_norm"] / den)
    return min(implied, default=None)


def real_bugs(folders) -> list[dict]:
    """The ``bound-*`` records under ``folders``: the kernel bugs the bound caught (not those
    in ``NOT_THE_KERNEL``), with the ratio each verdict had when found (None where the record
    lacks it) and the bound then."""
    bugs, targets = [], load_targets()
    for path in iter_case_files(f for f in folders if Path(f).is_dir()):
        if not path.parent.name.startswith("bound-") or path.name.split(".")[0] in NOT_THE_KERNEL:
            continue
        case, record = load(path)
        verdict = (record or {}).get("verdict") or {}
        bugs.append({"path": str(path), "target": case.target, "output": verdict.get("output"),
                     "gate": (record or {}).get("gate"), "ratio": verdict.get("ratio"),
                     "c_found": bound_when_found(case, verdict.get("metrics") or {}, targets),
                     "time": (record or {}).get("time"), "expect": (record or {}).get("expect"),
                     "detail": verdict.get("detail")})
    return bugs


def render(rows, seeds, chosen, checked, mismatches=(), scale=None, bugs=()) -> str:
    """The calibration document. ``scale``: the targets' ``bound_scale`` when it is not 1 (the GDN
    family): the bound in force is then C x scale and the readings are against it (``chosen`` is
    not used then: the constant discussed is the scale); ``bugs``: ``real_bugs`` records, the
    evidence that the bound catches real bugs."""
    correct = {n: r for n, r in rows.items() if "." not in n}
    planted = {n: r for n, r in rows.items() if "." in n}
    need_ok = max((c["ratio"] for r in correct.values() for c in r.values() if c["status"] != "n/a"), default=0)
    bound_bugs = [(n, g, c["ratio"]) for n, r in planted.items() for g, c in r.items()
                  if c["status"] == "fail" and c["kinds"] == ["bound"]]
    if scale is None:
        head = ["# Calibration of the error bound", "",
                f"Generated by `python tools/calibrate.py` (seeds {', '.join(map(str, seeds))}, CPU). "
                f"The bound in force: C = `BOUND_C` = {BOUND_C:g} (kfuzz/compare.py)."]
    else:
        head = ["# Calibration of the error bound: GDN targets", "",
                f"Generated by `python tools/calibrate.py --family gdn --seeds {','.join(map(str, seeds))} "
                f"--targets {','.join(rows)}` (CPU, Triton interpreter, the `cpu_hi` sizes). "
                f"The bound in force: C x `BOUND_SCALE` = {BOUND_C:g} x {scale:g} = {BOUND_C * scale:g} "
                "(`BOUND_C` in kfuzz/compare.py, `BOUND_SCALE` in harnesses/gdn.py, the targets' "
                "`bound_scale`). Every reading and factor below is relative to that bound, not to C alone."]
    lines = head + ["",
             "Each cell: the smallest factor f of the grid 1/16, 1/8, ..., 1024 at which the gate passes "
             "with the bound multiplied by f (the verdict changes there); in brackets the measured worst "
             "error/bound at f = 1. `never (kind)`: the failure is tolerance-free (nonfinite, stale, ...) "
             "and no factor changes it.", "",
             "| target | " + " | ".join(TOLERANCE_GATES) + " |", "| --- | " + " | ".join("---" for _ in TOLERANCE_GATES) + " |"]
    for name, r in list(correct.items()) + list(planted.items()):
        cells = [changes_at(c) + ("" if c["status"] == "n/a" else f" ({c['ratio']:.3g})") for c in r.values()]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    if scale is not None:
        return "\n".join(lines + _gdn_constants(need_ok, scale, checked, mismatches, bugs)) + "\n"
    lines += ["", "## The constants", "",
              f"- Correct kernels need at most {need_ok:.3g} x the bound at C = {BOUND_C:g}, i.e. C >= "
              f"{need_ok * BOUND_C:.3g}.",
              "- Planted bugs that only the bound sees need the bound multiplied by: " +
              (", ".join(f"`{n}` {g} {ratio:.3g}" for n, g, ratio in sorted(bound_bugs, key=lambda x: x[2])) or "none") + ".",
              f"- Chosen: C = {chosen:g}. " + (
                  f"It leaves a margin of {chosen / max(need_ok * BOUND_C, 1e-300):.3g}x above the worst correct kernel "
                  f"and {min((b[2] * BOUND_C for b in bound_bugs), default=math.inf) / chosen:.3g}x below the "
                  "weakest bound-only planted bug." if bound_bugs else ""),
              f"- FLOOR_ULPS = 4 stays: the floor only matters where the trusted implementation is exact "
              "(ones, small integers), and no correct kernel came near it.",
              f"- {checked} verdicts were re-run at the grid factors on either side of their reading "
              "and flipped where the table says (`--check`)." if checked else
              "- The readings were not re-run (`--check` not given)."]
    if mismatches:
        lines += ["- Re-runs that did not flip where the reading says (a nondeterministic kernel's error "
                  "changes from run to run): " + "; ".join(mismatches) + "."]
    return "\n".join(lines) + "\n"


def _gdn_constants(need_ok, scale, checked, mismatches, bugs) -> list[str]:
    caught = [b["ratio"] for b in bugs if b["ratio"] is not None]
    weakest = min(caught, default=None)
    lines = ["", "## The constant", "",
             f"- Correct kernels reach at most {need_ok:.3g} x the bound in force, i.e. they need "
             f"`BOUND_SCALE` >= {need_ok * scale:.3g} (C x scale >= {need_ok * scale * BOUND_C:.3g}).",
             (f"- In force: `BOUND_SCALE` = {scale:g}, a margin of {1 / max(need_ok, 1e-300):.3g}x above the "
              "worst correct kernel measured here" if need_ok <= 1 else
              f"- In force: `BOUND_SCALE` = {scale:g}, {need_ok:.3g}x too tight for the worst correct kernel "
              "measured here (its gate fails: a false alarm at this bound, or a kernel bug to look into)") + (
                 f"; the weakest real bug in the records reads {weakest:.3g} (a bound that much wider "
                 "would have passed it)." if weakest is not None else "."),
             f"- {checked} verdicts were re-run at the grid factors on either side of their reading "
             "and flipped where the table says (`--check`)." if checked else
             "- The readings were not re-run (`--check` not given)."]
    if mismatches:
        lines += ["- Re-runs that did not flip where the reading says: " + "; ".join(mismatches) + "."]
    lines += ["", "## Real bugs the bound caught", "",
              "The `bound-*` records under " + ", ".join(f"`{f}/`" for f in GDN_CRASHES) + ": kernel bugs "
              "found by a gate or a campaign (expect now: pass once the kernel was fixed; the records of "
              "failures that were kfuzz's own or its interpreter's are left out, `NOT_THE_KERNEL` in "
              "tools/calibrate.py). The ratio is the "
              "verdict's error/bound when the bug was found, as stored in the record. The record does not "
              "store the C in force; the column C x scale reads it back from the record's metrics "
              "(bound_norm / max(trusted_err_norm, FLOOR_ULPS u ||o||), the least over the outputs; a "
              "little over where the smallest-normal term counts, as in fp16). A ratio r means the bug "
              "would have passed with the bound r times wider.", "",
              "| record | target | output | gate | ratio when found | C x scale then | found (UTC) | expect now |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for b in sorted(bugs, key=lambda b: (b["ratio"] is None, b["ratio"] or 0)):
        lines.append(f"| `{b['path']}` | `{b['target']}` | `{b['output']}` | "
                     f"{b['gate'] or 'not in the record'} | "
                     f"{'not in the record' if b['ratio'] is None else format(b['ratio'], '.3g')} | "
                     f"{'not readable' if b['c_found'] is None else format(b['c_found'], '.3g')} | "
                     f"{b['time'] or 'not in the record'} | {b['expect'] or 'not in the record'} |")
    if not bugs:
        lines.append("| (no bound-* records found) | | | | | | | |")
    return lines


def plot(rows, chosen, path, scale=1.0, bugs=()):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 5.5))
    names = list(rows)
    for i, name in enumerate(names):
        for j, (gid, c) in enumerate(rows[name].items()):
            if c["status"] == "n/a":
                continue
            need = c["ratio"] * BOUND_C * scale
            tf = bool(set(c["kinds"]) - {"bound"})
            y = 1e5 if tf or not math.isfinite(need) else max(need, 1e-3)
            color = "tab:green" if "." not in name else ("tab:red" if c["status"] == "fail" else "tab:gray")
            ax.scatter(i + (j - 2) * 0.12, y, color=color, marker="x" if tf else "o", s=22)
    for b in bugs:      # real bugs: the C x scale at which each would have passed
        if b["ratio"] is not None:
            ax.axhline(b["ratio"] * BOUND_C * scale, color="tab:red", lw=0.8, ls="--")
            ax.text(len(names) - 0.5, b["ratio"] * BOUND_C * scale, Path(b["path"]).parent.name,
                    color="tab:red", fontsize=7, ha="right", va="bottom")
    label = f"chosen C = {chosen:g}" if scale == 1.0 else f"in force: C x BOUND_SCALE = {BOUND_C * scale:g}"
    ax.axhline(chosen, color="black", lw=1, label=label)
    ax.axhspan(BOUND_C * scale / 16, BOUND_C * scale * 1024, color="tab:blue", alpha=0.06,
               label="swept: C x 1/16 ... x 1024" if scale == 1.0 else "swept: bound in force x 1/16 ... x 1024")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("C at which the gate's verdict changes")
    ax.set_title("Tolerance gates G01-G04, G12: needed C per target (green correct, red planted bug; x = tolerance-free, never)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=("operators", "gdn"), default="operators",
                    help="operators (reports/calibration.md) or gdn (reports/calibration_gdn.md, bound C x BOUND_SCALE)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--targets", default=None,
                    help="comma-separated; default: operator targets and variants, or " + ",".join(GDN_DEFAULT))
    ap.add_argument("--check", action="store_true", help="re-run at the grid factors around each reading")
    ap.add_argument("--md", default=None, help="default reports/calibration.md (gdn: reports/calibration_gdn.md)")
    ap.add_argument("--png", default=None, help="default reports/calibration.png (gdn: reports/calibration_gdn.png)")
    a = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    gdn = a.family == "gdn"
    md = a.md or ("reports/calibration_gdn.md" if gdn else "reports/calibration.md")
    png = a.png or ("reports/calibration_gdn.png" if gdn else "reports/calibration.png")
    targets = load_targets()
    if a.targets:
        names = a.targets.split(",")
    elif gdn:
        names = list(GDN_DEFAULT)
    else:
        names = sorted(n for n in targets if n.split(".")[0] in OPERATORS)
    unknown = [n for n in names if n not in targets]
    if unknown:
        ap.error(f"unknown target(s) {', '.join(unknown)}")
    scales = {targets[n].bound_scale for n in names}
    if gdn and len(scales) != 1:
        ap.error(f"--family gdn: the targets have different bound_scale ({sorted(scales)}); one table, one bound")
    seeds = [int(s) for s in a.seeds.split(",")]
    rows = measure(names, seeds, log)
    mismatches: list[str] = []
    checked = check_flip(names, rows, seeds[0], log, mismatches) if a.check and seeds == [seeds[0]] else 0
    if gdn:
        scale = scales.pop()
        bugs = real_bugs(GDN_CRASHES)
        Path(md).write_text(render(rows, seeds, BOUND_C, checked, mismatches, scale=scale, bugs=bugs))
        plot(rows, BOUND_C * scale, png, scale=scale, bugs=bugs)
    else:
        Path(md).write_text(render(rows, seeds, BOUND_C, checked, mismatches))
        plot(rows, BOUND_C, png)
    print(f"wrote {md} and {png}")


if __name__ == "__main__":
    main()
