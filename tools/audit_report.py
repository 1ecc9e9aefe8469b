"""The audit's report: markdown, a PNG and JSON from one or more ``results.jsonl`` files.

    python tools/audit_report.py reports/audit/results.jsonl [--out reports/audit] [--corpora DIR] [--key FILE] [--trust-unsigned]

writes ``report.md``, ``report.json`` (the totals and one row per kernel) and
``report.png`` (violations by gate, by generating model, and the calibration
sweep). A key recorded twice (a retried kernel) counts once, its last record.
Each line is checked against its HMAC under the audit's key (``--key``, default
``kfuzz.audit.key_path()``): a line that fails is left out and counted in the
report; lines without an HMAC (made before results were signed, or under a key
that is not kept) are taken only with ``--trust-unsigned``, and counted.

G07 is judged as the audit now runs it: n/a on a reference with float weights
(``kfuzz.kernelbench.float_weights``). Records made before say nothing of the
weights (no ``params`` in their weights record), so the fact is computed from
the corpus row (meta device, once per reference): the row is found by the
record's key in ``--corpora`` (default ``.corpora``, then ``../shared/corpora``)
or at the path in its target name, and must have the record's ``sha``. Where no
row is found, the record's G07 result counts as recorded and the report says
how many such records there are.
"""
from __future__ import annotations

import argparse
import json
import re
import warnings
from collections import Counter, defaultdict
from pathlib import Path

from kfuzz.audit import BROKEN_RATIO, judge_record, read_results, results_key, weights_failures
from kfuzz.kernelbench import read_corpus
from kfuzz.kernelbench.build import fell_back
from kfuzz.compare import BOUND_C
from kfuzz.gates import GATES

SWEEP = (0.5, 1, 2, 4, 8, 16, 64, 256, 1e3, 1e4, 1e6)
BOUND_GATES = [g for g, gate in GATES.items() if not gate.tolerance_free]


def _ratio(x) -> float:
    return float("inf") if x == "inf" else float(x or 0)


def worst_bound_ratio(rec: dict) -> float:
    """The largest error/bound over the kernel's bound-judged gates (G01-G04)."""
    return max((_ratio(g.get("worst_ratio")) for gid, g in rec.get("gates", {}).items()
                if gid in BOUND_GATES and g.get("status") in ("pass", "fail")), default=0.0)


DEFAULT_CORPORA = (Path(".corpora"), Path("../shared/corpora"))


class CorpusWeights:
    """Whether a record's reference has float weights, from its corpus row, for records that
    predate the weights record's ``params``. Each corpus file is read once."""

    def __init__(self, dirs):
        self.dirs = [Path(d) for d in dirs]
        self.corpora: dict[Path, dict] = {}

    def _row(self, rec: dict):
        name, _ = rec["key"].rsplit(":", 1)
        target = rec.get("target") or ""
        places = [Path(target[3:].rsplit(":", 1)[0])] if target.startswith("kb:") and ":" in target[3:] else []
        for path in places + [d / name for d in self.dirs]:
            if path.name != name or not path.exists():
                continue
            if path not in self.corpora:
                self.corpora[path] = {e.key: e for e in read_corpus(path)}
            entry = self.corpora[path].get(rec["key"])
            if entry is not None and entry.pair is not None and entry.pair.sha == rec.get("sha"):
                return entry.pair
        return None

    def params(self, rec: dict) -> bool | None:
        """True/False, or None where no corpus row with the record's sha is found or its
        reference does not build."""
        from kfuzz.kernelbench import float_weights
        pair = self._row(rec)
        if pair is None:
            return None
        try:
            with warnings.catch_warnings():      # the references' own warnings are not the report's
                warnings.simplefilter("ignore")
                return bool(float_weights(pair))
        except Exception:       # the reference does not build here (a module it imports is missing)
            return None


def fill_params(records: list[dict], weights: CorpusWeights) -> dict:
    """Give each record with a G07 result and no ``params`` the fact from its corpus row
    (``params_from: "corpus"``); returns the counts (filled, unknown)."""
    filled = unknown = 0
    for r in records:
        if "G07" not in r.get("gates", {}) or "params" in r.get("weights", {}):
            continue
        p = weights.params(r)
        if p is None:
            unknown += 1
            continue
        r["weights"] = {**r.get("weights", {}), "params": p, "params_from": "corpus"}
        filled += 1
    return {"filled_from_corpus": filled, "unknown": unknown}


# bands of a bound failure's relative error (its first failing case), in units of a format's
# unit roundoff: TF32 and fp16 keep 10 mantissa bits (u = 2^-11), bf16 7 (u = 2^-8)
PRECISION_BANDS = (("tf32/fp16-level", 4 * 2.0 ** -11), ("bf16-level", 4 * 2.0 ** -8))


def precision_class(rec: dict, violations: list[str]) -> str | None:
    """For a kernel whose every violation is a bound failure of G01-G04, the band of its worst
    relative error (``PRECISION_BANDS``, else ``beyond half precision``); None otherwise: also
    where a failing gate met another kind of failure after its first (the record's
    ``failing_kinds``; in records without them, a worst case infinitely over the bound, a
    non-finite output where the oracle is finite: an fp16 cast that overflows is not a rounding
    difference)."""
    def bound_only(g: dict) -> bool:
        if "failing_kinds" in g:            # every failing case's kind, in records that keep them
            return set(g["failing_kinds"]) == {"bound"}
        return g.get("kind") == "bound" and _ratio(g.get("worst_ratio")) != float("inf")
    if not violations or any(v not in BOUND_GATES or not bound_only(rec["gates"][v]) for v in violations):
        return None
    rel = 0.0
    for v in violations:
        m = (rec["gates"][v].get("verdict") or {}).get("metrics") or {}
        rel = max([rel] + [float(x) for k, x in m.items() if k.endswith("rel_err") and not k.endswith("trusted_rel_err")])
    return next((name for name, top in PRECISION_BANDS if rel <= top), "beyond half precision")


def g05_fact(rec: dict, fact: str) -> bool:
    """A fact of the kernel's G05 failure, in its failing case's metrics: ``kinds_only`` (it
    differs from the oracle only in the kind of non-finite value,
    ``kfuzz.gates.nonfinite.kinds_only``), ``where_ignored`` (only by non-finite values where the
    oracle's value ignores the injected specials, ``nonfinite_where_ignored``)."""
    m = ((rec.get("gates", {}).get("G05") or {}).get("verdict") or {}).get("metrics") or {}
    return bool(m.get(fact))


def failing_kinds(gate: dict) -> set[str]:
    """The kinds of a failing gate's failing cases (its first's, in records that keep no more)."""
    return set(gate.get("failing_kinds") or {gate.get("kind"): 1})


# a contract failure on the shape of an output of one element: [1] against a 0-d reference, or [1, 1]
ONE_ELEMENT_SHAPE = re.compile(r"has shape \[[1, ]*\], the contract says \[[1, ]*\]$")


def one_element_shape_only(rec: dict, violations: list[str]) -> bool:
    """Whether every violation is a gate whose every failing case broke the call contract on the
    shape of a one-element output alone (a loss returned with shape [1] where the reference
    returns a 0-d tensor): the values were not judged."""
    gates = rec.get("gates", {})
    if not violations or any(v not in gates for v in violations):
        return False
    for v in violations:
        g = gates[v]
        verdict = g.get("verdict") or {}
        if verdict.get("kind") != "contract" or not ONE_ELEMENT_SHAPE.search(str(verdict.get("detail", ""))):
            return False
        if failing_kinds(g) != {"contract"}:
            return False
    return True


def g03_refusals_only(rec: dict, violations: list[str]) -> bool:
    """Whether the kernel's only violation is G03 and every failing case of it raised an
    exception (at a size the reference takes: one it refuses too is excused): a loud refusal of
    the sizes varied, not a wrong number."""
    if violations != ["G03"]:
        return False
    return failing_kinds(rec.get("gates", {}).get("G03") or {}) == {"exception"}


# a write the sandbox refused, named by the audit hook ("<event> '<path>': ..."), beneath /tmp or a
# hidden folder of a home (where libraries keep their caches)
OWN_FILES_WRITE = re.compile(r"^[\w.]+ '(/tmp/|/root/\.|/home/[^/']+/\.)")


def own_files_write_only(rec: dict, violations: list[str]) -> bool:
    """Whether the kernel's only violation is a write outside its directory that the sandbox
    refused in its build or standard test, beneath /tmp or a hidden folder of a home: a
    solution keeping its own files (its sources, a library's cache) at a fixed path, which a
    drop-in user's run writes as well (and runs in parallel race on), not a wrong number."""
    if violations != ["sandbox-write"]:
        return False
    steps = [rec.get(k) or {} for k in ("build", "standard")]
    return any(st.get("finding") == "sandbox-write" and OWN_FILES_WRITE.match(str(st.get("detail", "")))
               for st in steps)


def lenient_pass(rec: dict) -> bool:
    """Whether the solution, whose state_dict fails ``Model``'s strict load, gives the numbers of
    ``Model``'s checkpoint loaded with ``strict=False`` (``kfuzz.audit.lenient_check``)."""
    return ((rec.get("weights") or {}).get("checks") or {}).get("lenient", {}).get("status") == "pass"


def summarize(records: list[dict], params: dict | None = None) -> dict:
    corpus = [r for r in records if r.get("expect") is None]
    controls = [r for r in records if r.get("expect") is not None]
    audited = [r for r in corpus if judge_record(r)["audited"]]
    j = {r["key"]: judge_record(r) for r in records}
    n = max(1, len(audited))
    # the standard test's verdict where it has one (none where it ran out of a GPU's memory
    # beside other kernels: incomplete, run again alone by --retry)
    judged_standard = [r for r in audited if j[r["key"]]["standard"] is not None]
    confusion = Counter((j[r["key"]]["standard"], j[r["key"]]["violation"]) for r in judged_standard)
    by_gate = Counter(v for r in audited for v in j[r["key"]]["violations"])
    by_model: dict[str, Counter] = defaultdict(Counter)
    for r in audited:
        c = by_model[r.get("model", "?")]
        c["kernels"] += 1
        c["violation"] += j[r["key"]]["violation"]
        c["broken"] += j[r["key"]]["broken"]
        c["standard_pass"] += bool(j[r["key"]]["standard"])
    # the calibration sweep: share of kernels over the bound if the bound were s times larger
    ratios = [worst_bound_ratio(r) for r in audited]
    sweep = [{"scale": s, "C": s * BOUND_C, "share_over": sum(x > s for x in ratios) / n} for s in SWEEP]
    control_rows = []
    for r in controls:
        planted = r["expect"] != "none"
        caught = j[r["key"]]["violation"]
        control_rows.append({"key": r["key"], "planted": r["expect"], "standard_pass": j[r["key"]]["standard"],
                             "violations": j[r["key"]]["violations"], "as_planted": caught == planted})
    agree = sum(bool(j[r["key"]]["standard"]) for r in audited)
    without_w = {r["key"]: [v for v in j[r["key"]]["violations"] if v != "W"] for r in audited}
    by_level: dict[str, Counter] = defaultdict(Counter)
    by_gate_level: dict[str, Counter] = defaultdict(Counter)
    for r in audited:
        lv = str(r.get("level", "?"))
        c = by_level[lv]
        c["kernels"] += 1
        c["violation"] += j[r["key"]]["violation"]
        c["violation_without_W"] += bool(without_w[r["key"]])
        c["broken"] += j[r["key"]]["broken"]
        c["standard_pass"] += bool(j[r["key"]]["standard"])
        c["incomplete"] += j[r["key"]]["incomplete"]
        for v in j[r["key"]]["violations"]:
            by_gate_level[v][lv] += 1
    weights_kinds = Counter(k for r in audited for k in weights_failures(r))
    gate_errors_by_gate = Counter(g for r in audited for g, d in r.get("gates", {}).items() if d.get("status") == "error")
    precision = Counter(precision_class(r, j[r["key"]]["violations"]) for r in audited)
    precision.pop(None, None)
    excused = Counter()
    for r in audited:
        for d in r.get("gates", {}).values():
            excused.update(d.get("excused") or {})
    arguable = {
        **{f"only bound failures, {k}": n for k, n in sorted(precision.items())},
        "only the weights contract (W)": sum(j[r["key"]]["violations"] == ["W"] for r in audited),
        "W only through derived parameters": sum(weights_failures(r) == ["derived"] and not without_w[r["key"]]
                                                 for r in audited),
        "only W, a strict load (a strict=False load gives the checkpoint's numbers)": sum(
            j[r["key"]]["violations"] == ["W"] and weights_failures(r) == ["contract"] and lenient_pass(r)
            for r in audited),
        "only G05, the kind of a non-finite value (NaN against an Inf)": sum(
            j[r["key"]]["violations"] == ["G05"] and g05_fact(r, "kinds_only") for r in audited),
        "only G05, non-finite where the reference's value ignores the injected special": sum(
            j[r["key"]]["violations"] == ["G05"] and g05_fact(r, "where_ignored") for r in audited),
        "only the shape of a one-element output ([1] where the reference returns a 0-d tensor; its values "
        "not judged)": sum(one_element_shape_only(r, j[r["key"]]["violations"]) for r in audited),
        "only G03, exceptions at sizes the reference takes (a loud refusal, not a wrong number)": sum(
            g03_refusals_only(r, j[r["key"]]["violations"]) for r in audited),
        "only a sandboxed write of its own files at a fixed path beneath /tmp or a hidden folder of a home "
        "(a drop-in run writes them too)": sum(own_files_write_only(r, j[r["key"]]["violations"]) for r in audited),
    }
    return {
        "records": len(records), "corpus_records": len(corpus),
        "skipped": sum("skip" in r for r in corpus),
        "adapter_refused": sum("adapter" in r for r in corpus),
        "unbuilt": sum("unbuilt" in r for r in corpus),
        "without_mode": sum("mode" not in r for r in audited),
        "audited": len(audited),
        "incomplete": sum(j[r["key"]]["incomplete"] for r in audited),
        "time_limits": sorted({r["timeout"] for r in audited if isinstance(r.get("timeout"), (int, float))}),
        # per limit: [records made under it, of them incomplete]
        "incomplete_by_limit": {f"{t:g}": [sum(r.get("timeout") == t for r in audited),
                                           sum(r.get("timeout") == t and j[r["key"]]["incomplete"] for r in audited)]
                                for t in sorted({r["timeout"] for r in audited
                                                 if isinstance(r.get("timeout"), (int, float))})},
        "trusted_on": dict(sorted(Counter(str(r.get("trusted_on", "unrecorded")).split(":")[0]
                                          for r in audited).items())),
        "gate_errors": sum(any(g.get("status") == "error" for g in r.get("gates", {}).values()) for r in audited),
        "violation": sum(j[r["key"]]["violation"] for r in audited),
        "broken": sum(j[r["key"]]["broken"] for r in audited),
        "share_violation": sum(j[r["key"]]["violation"] for r in audited) / n,
        "share_broken": sum(j[r["key"]]["broken"] for r in audited) / n,
        "standard_agreement": agree / max(1, len(judged_standard)),
        "confusion": {f"standard_{'pass' if s else 'fail'}__gates_{'violation' if v else 'clean'}": c
                      for (s, v), c in sorted(confusion.items(), key=str)},
        "accepted_by_standard_rejected_by_gates": confusion[(True, True)],
        "rejected_by_standard_clean_in_gates": confusion[(False, False)],
        "by_gate": dict(sorted(by_gate.items())),
        "by_model": {m: dict(c) for m, c in sorted(by_model.items())},
        "weights": dict(Counter(r.get("weights", {}).get("status", "-") for r in audited)),
        "g07_not_applicable": sum(j[r["key"]]["g07_not_applicable"] for r in audited),
        "g07_failures_not_applicable": sum(j[r["key"]]["g07_not_applicable"]
                                           and r["gates"]["G07"].get("status") == "fail" for r in audited),
        "g07_params_unknown": sum(r.get("gates", {}).get("G07", {}).get("status") == "fail"
                                  and "params" not in r.get("weights", {}) for r in audited),
        "params": params or {},
        "violation_without_W": sum(bool(v) for v in without_w.values()),
        "share_violation_without_W": sum(bool(v) for v in without_w.values()) / n,
        "W": sum("W" in j[r["key"]]["violations"] for r in audited), "W_by_check": dict(weights_kinds),
        "by_level": {lv: dict(c) for lv, c in sorted(by_level.items())},
        "by_gate_level": {g: dict(sorted(c.items())) for g, c in sorted(by_gate_level.items())},
        "kfuzz_errors": {"records_with_gate_error": sum(any(g.get("status") == "error" for g in r.get(
                             "gates", {}).values()) for r in audited),
                         "gate_errors_by_gate": dict(sorted(gate_errors_by_gate.items())),
                         "weights_check_errors": sum(r.get("weights", {}).get("status") == "error" for r in audited),
                         "killed_for_time": sum(j[r["key"]]["incomplete"] for r in audited),
                         "adapter_refused": sum("adapter" in r for r in corpus),
                         "unbuilt": sum("unbuilt" in r for r in corpus),
                         # not audited: no standard test's verdict yet (--retry redoes both)
                         "run_errors": sum("error" in r and not j[r["key"]]["audited"] for r in corpus),
                         # an error of kfuzz's that ended the kernel's run after its standard test (not a
                         # GPU's memory shared with other kernels, which is incomplete): judged on what finished
                         "ended_by_error": sum("error" in r and not j[r["key"]]["incomplete"] for r in audited),
                         "build_killed_for_time": sum(r.get("phase") == "build" and not j[r["key"]]["audited"]
                                                      and str(r.get("ended", "")).startswith("timeout")
                                                      for r in corpus),
                         "fell_back": sum(fell_back(r.get("build")) for r in audited)},
        "arguable": arguable, "excused_cases": dict(sorted(excused.items())),
        "sweep": sweep, "broken_ratio": BROKEN_RATIO, "controls": control_rows,
        "controls_as_planted": all(c["as_planted"] for c in control_rows) if control_rows else None,
    }


def kernel_rows(records: list[dict]) -> list[dict]:
    rows = []
    for r in records:
        jr = judge_record(r)
        rows.append({"key": r["key"], "model": r.get("model"), "level": r.get("level"), "problem": r.get("problem"),
                     "standard": r.get("standard", {}).get("reason"), "weights": r.get("weights", {}).get("status"),
                     "gates": {g: d.get("status") for g, d in sorted(r.get("gates", {}).items())},
                     "params": r.get("weights", {}).get("params"),
                     "violations": jr["violations"], "broken": jr["broken"], "ended": r.get("ended"),
                     "skip": r.get("skip"), "adapter": r.get("adapter", {}).get("error")})
    return rows


def markdown(s: dict) -> str:
    pct = lambda x: f"{100 * x:.1f}%"
    out = ["# Audit report", "",
           *([f"The corpora hold {s['corpus_accepted']} accepted kernels; {s['audited']} of them are audited here "
              f"({pct(s['audited'] / max(1, s['corpus_accepted']))})"
              + (f"; {s['corpus_without_solution']} carry no solution that runs (a row whose code is the string "
                 f"\"None\", does not parse or defines no `ModelNew`: nothing to audit)."
                 if s.get("corpus_without_solution") else "."), ""] if s.get("corpus_accepted") else []),
           f"{s['audited']} kernels audited ({s['incomplete']} incomplete: killed for time, judged on the gates "
           f"that finished, or out of a GPU's memory beside other kernels or unconfirmed by a second run; {s['gate_errors']} with a gate that could "
           f"not run, judged on the others; {s['kfuzz_errors'].get('ended_by_error', 0)} whose run an error of kfuzz's ended "
           f"after the standard test, judged on what finished), "
           f"{s['skipped']} rows skipped (not accepted), {s['adapter_refused']} refused by the adapter, "
           f"{s['unbuilt']} that did not build or import here (not judged)."
           + (f" Per-kernel time limits: {', '.join(f'{t:g} s' for t in s['time_limits'])} (records that name theirs"
              + "".join(f"; at {t} s, {k} of {n} incomplete ({pct(k / max(1, n))})"
                        for t, (n, k) in s.get("incomplete_by_limit", {}).items()) + ")."
              if s.get("time_limits") else "")
           + (" The trusted implementation (the reference in float32, which scales the bound) ran where the "
              "kernel ran for " + (", ".join(f"{n} ({'on the GPU' if d == 'cuda' else 'on the ' + d.upper()})"
                                            for d, n in s["trusted_on"].items() if d != "unrecorded") or "none")
              + (f"; {s['trusted_on']['unrecorded']} "
                 + ("record does" if s["trusted_on"]["unrecorded"] == 1 else "records do")
                 + " not say where: made when the gates ran it on the CPU whatever the kernel's device"
                 if s["trusted_on"].get("unrecorded") else "") + "."
              if s.get("trusted_on") else ""), "",
           *([f"Results lines: {s['lines_refused']} refused (not a record, or its HMAC fails: forged, altered, "
              f"or signed under another key), {s['lines_unsigned']} taken without an HMAC (`--trust-unsigned`: made before "
              f"results were signed, or under a key that is not kept); {s.get('unsigned_audited', 0)} audited kernels' "
              f"records are unsigned (`kfuzz audit --redo-unsigned` audits them again).", ""]
             if s.get("lines_refused") or s.get("lines_unsigned") else []),
           *([f"{s['without_mode']} records predate the train/eval mode field: their models ran in train "
              f"mode, which differs from CUDA-L1's eval mode for references with BatchNorm or dropout "
              f"(docs/audit.md; `kfuzz audit --retry` redoes those).", ""] if s["without_mode"] else []),
           f"G07 (exact accumulation) is n/a on a reference with float weights (no exact answer by "
           f"construction): {s['g07_not_applicable']} kernels, {s['g07_failures_not_applicable']} of them with a "
           f"G07 failure recorded before that rule, counted as n/a"
           + (f" (the fact came from the corpus rows for {s['params']['filled_from_corpus']} older records)"
              if s["params"].get("filled_from_corpus") else "")
           + (f". For {s['g07_params_unknown']} kernels with a G07 failure no corpus row was found (or their "
              f"reference does not build here), so whether it has float weights is unknown and the failure "
              f"counts as recorded."
              if s["g07_params_unknown"] else "."), "",
           "| measure | value |", "| --- | --- |",
           f"| broken beyond any tolerance (a tolerance-free failure, or error > {s['broken_ratio']:g} x bound) | "
           f"{s['broken']} ({pct(s['share_broken'])}) |",
           f"| at least one violation (a gate failed, the weights contract, or a finding of the build or standard "
           f"test: a sandbox violation, a limit, a crash, a timeout) | {s['violation']} "
           f"({pct(s['share_violation'])}) |",
           f"| our standard test agrees with the corpora's (all rows accepted) | {pct(s['standard_agreement'])} |",
           f"| accepted by our standard test, rejected by the gates | {s['accepted_by_standard_rejected_by_gates']} |",
           f"| rejected by our standard test, clean in the gates | {s['rejected_by_standard_clean_in_gates']} |",
           "", "## Confusion matrix against the standard test", "",
           "| | gates: violation | gates: clean |", "| --- | --- | --- |"]
    c = s["confusion"]
    for std in ("pass", "fail"):
        out.append(f"| standard {std} | {c.get(f'standard_{std}__gates_violation', 0)} | "
                   f"{c.get(f'standard_{std}__gates_clean', 0)} |")
    out += ["", "## Violations by gate", "", "| gate | kernels | share |", "| --- | --- | --- |"]
    for g, k in s["by_gate"].items():
        name = GATES[g].name if g in GATES else {
            "W": "weights contract", "crash": "kernel process died",
            "timeout": "standard test did not end in time"}.get(g, "build or standard test ended in" if "-" in g else g)
        out.append(f"| {g} {name} | {k} | {pct(k / max(1, s['audited']))} |")
    out += ["", "## By level", "", "| level | kernels | standard pass | violation | violation without W | broken | "
            "incomplete |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for lv, c in s["by_level"].items():
        k = max(1, c["kernels"])
        out.append(f"| {lv} | {c['kernels']} | {c.get('standard_pass', 0)} | {c.get('violation', 0)} "
                   f"({pct(c.get('violation', 0) / k)}) | {c.get('violation_without_W', 0)} "
                   f"({pct(c.get('violation_without_W', 0) / k)}) | {c.get('broken', 0)} ({pct(c.get('broken', 0) / k)}) | "
                   f"{c.get('incomplete', 0)} |")
    levels = list(s["by_level"])
    out += ["", "## Violations by gate and level", "", "| gate | " + " | ".join(f"level {lv}" for lv in levels) + " |",
            "| --- |" + " --- |" * len(levels)]
    for g, c in s["by_gate_level"].items():
        out.append(f"| {g} | " + " | ".join(str(c.get(lv, 0)) for lv in levels) + " |")
    out += ["", "## The weights contract (W), separately", "",
            f"{s['W']} kernels fail W (by check: {', '.join(f'{k} {n}' for k, n in sorted(s['W_by_check'].items())) or 'none'}; "
            f"contract: Model's state_dict does not load; derived: a parameter derived in __init__ does not follow a "
            f"loaded checkpoint; reload: weights copied before a checkpoint was loaded). Without W, "
            f"{s['violation_without_W']} kernels ({pct(s['share_violation_without_W'])}) have at least one violation "
            f"(with it, {s['violation']}, {pct(s['share_violation'])}).", "",
            "## kfuzz's own errors and timeouts", "", "| what | count |", "| --- | --- |",
            f"| kernels with a gate that could not run (kfuzz error) | {s['kfuzz_errors']['records_with_gate_error']} |",
            *[f"| ... of them in {g} | {n} |" for g, n in s["kfuzz_errors"]["gate_errors_by_gate"].items()],
            f"| weights check that could not run | {s['kfuzz_errors']['weights_check_errors']} |",
            f"| kernels killed for time in the gates or the build, or out of a GPU's memory unconfirmed (incomplete) | {s['kfuzz_errors']['killed_for_time']} |",
            f"| references the adapter refused | {s['kfuzz_errors']['adapter_refused']} |",
            f"| solutions that did not build here (not judged) | {s['kfuzz_errors']['unbuilt']} |",
            f"| kernels whose run a kfuzz error ended before the standard test's verdict (not audited) "
            f"| {s['kfuzz_errors'].get('run_errors', 0)} |",
            f"| kernels whose run a kfuzz error ended after the standard test (judged on what finished) "
            f"| {s['kfuzz_errors'].get('ended_by_error', 0)} |",
            f"| kernels killed for time in their build (not audited) | {s['kfuzz_errors'].get('build_killed_for_time', 0)} |",
            f"| solutions whose extension did not build here and that ran their own fallback (judged as they ran) "
            f"| {s['kfuzz_errors']['fell_back']} |",
            "", "## Arguable classes", "",
            "Kernels whose violations are arguable, each class on its own (the precision bands: the worst relative "
            "error of the first failing case, at most 4 x 2^-11 for TF32/fp16, 4 x 2^-8 for bf16; TF32 and fp16 "
            "keep the same mantissa and are not told apart by error size), and the cases the gates excused (passed, "
            "saying why) as their own classes:", "", "| class | kernels or cases |", "| --- | --- |",
            *[f"| {k} | {n} kernels |" for k, n in s["arguable"].items()],
            *[f"| excused: {k} | {n} cases |" for k, n in s["excused_cases"].items()]]
    out += ["", "## By generating model", "", "| model | kernels | standard pass | violation | broken |",
            "| --- | --- | --- | --- | --- |"]
    for m, c in s["by_model"].items():
        out.append(f"| {m} | {c['kernels']} | {c['standard_pass']} | {c['violation']} | {c['broken']} |")
    out += ["", "## Calibration sweep", "",
            f"Share of audited kernels whose worst error/bound over G01-G04 exceeds s, i.e. that a bound s times "
            f"larger (C = s x {BOUND_C:g}) would still fail:", "", "| s | C | share over |", "| --- | --- | --- |"]
    out += [f"| {r['scale']:g} | {r['C']:g} | {pct(r['share_over'])} |" for r in s["sweep"]]
    out += ["", "## Positive controls", "", "| control | planted | standard | violations | as planted |",
            "| --- | --- | --- | --- | --- |"]
    for r in s["controls"]:
        out.append(f"| {r['key']} | {r['planted']} | {'pass' if r['standard_pass'] else 'fail'} | "
                   f"{','.join(r['violations']) or '-'} | {'yes' if r['as_planted'] else 'NO'} |")
    out += ["", f"Weights contract: {s['weights']}", ""]
    return "\n".join(out)


def plot(s: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(17, 4.8))
    gates = list(s["by_gate"])
    ax[0].bar(gates, [s["by_gate"][g] / max(1, s["audited"]) for g in gates])
    ax[0].set_title("kernels failing each gate (share)")
    models = list(s["by_model"])
    share = lambda m, k: s["by_model"][m][k] / max(1, s["by_model"][m]["kernels"])
    x = range(len(models))
    ax[1].bar([i - 0.2 for i in x], [share(m, "violation") for m in models], 0.4, label="violation")
    ax[1].bar([i + 0.2 for i in x], [share(m, "broken") for m in models], 0.4, label="broken")
    ax[1].set_xticks(list(x), [m.split("/")[-1][:18] for m in models], rotation=35, ha="right", fontsize=8)
    ax[1].set_title("by generating model (share)")
    ax[1].legend()
    ax[2].semilogx([r["scale"] for r in s["sweep"]], [r["share_over"] for r in s["sweep"]], marker="o")
    ax[2].axvline(1, color="gray", ls="--")
    ax[2].set_xlabel(f"bound multiplier s (C = s x {BOUND_C:g})")
    ax[2].set_title("share over the bound (G01-G04)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


NOT_ACCEPTED = ("custom_code is null (not accepted)", "code is null")


def accepted_in_corpora(dirs) -> tuple[int, int] | None:
    """How many accepted kernels (rows with a solution, paired or not) the first corpora folder
    found holds, the audit's denominator, and how many of them carry no solution that runs (a
    row whose code is the string "None", does not parse or defines no ``ModelNew``); None where
    no corpus is found."""
    for d in dirs:
        files = sorted(Path(d).glob("cuda-l1-*.jsonl")) + sorted(Path(d).glob("*leaderboard*.json"))
        if files:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                accepted = [e for f in files for e in read_corpus(f) if e.pair is not None or e.skip not in NOT_ACCEPTED]
            return len(accepted), sum(e.pair is None for e in accepted)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="results.jsonl file(s) from kfuzz audit")
    ap.add_argument("--out", default="reports/audit", help="folder for report.md, report.json, report.png")
    ap.add_argument("--corpora", help="folder of the corpus files, for whether older records' references have "
                    "float weights (default .corpora, then ../shared/corpora)")
    ap.add_argument("--key", help="the key file that signed the results (default: kfuzz audit's)")
    ap.add_argument("--trust-unsigned", action="store_true",
                    help="take lines without an HMAC (made before results were signed, or under a key that is not kept)")
    a = ap.parse_args(argv)
    if a.corpora and not Path(a.corpora).is_dir():
        ap.error(f"--corpora {a.corpora}: no such folder")
    records: dict[str, dict] = {}
    refused, unsigned = 0, 0
    unsigned_keys: set[str] = set()
    key = None
    if a.key:
        try:
            key = results_key(a.key, create=False)
        except Exception as e:
            ap.error(str(e))
    for path in a.results:
        if not Path(path).is_file():
            ap.error(f"{path}: no such results file")
        got = read_results(path, key, a.trust_unsigned)
        records.update(got)
        refused += len(got.refused)
        unsigned += got.unsigned
        unsigned_keys = (unsigned_keys - set(got)) | got.unsigned_keys
    recs = list(records.values())
    params = fill_params(recs, CorpusWeights([a.corpora] if a.corpora else DEFAULT_CORPORA))
    s = summarize(recs, params)
    accepted = accepted_in_corpora([Path(a.corpora)] if a.corpora else DEFAULT_CORPORA)
    s.update(lines_refused=refused, lines_unsigned=unsigned,
             unsigned_audited=sum(r["key"] in unsigned_keys and r.get("expect") is None and judge_record(r)["audited"]
                                  for r in recs),
             corpus_accepted=accepted and accepted[0],
             corpus_without_solution=accepted and accepted[1])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(markdown(s))
    (out / "report.json").write_text(json.dumps({"summary": s, "kernels": kernel_rows(recs)}, indent=1,
                                                default=str))
    plot(s, out / "report.png")
    print(f"{out / 'report.md'}: {s['audited']} audited, {s['violation']} with a violation, {s['broken']} broken; "
          f"G07 n/a for float weights on {s['g07_not_applicable']} ({params['filled_from_corpus']} from the corpus, "
          f"{params['unknown']} unknown)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
