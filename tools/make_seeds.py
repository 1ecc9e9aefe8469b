"""Write the starting corpus: three seed cases for every shipped target, under seeds/<target>/.

    python tools/make_seeds.py [--root .] [--targets softmax,gdn_bwd,...]

The seeds are the atheris engine's starting corpus (it copies ``seeds/<target>/`` into
libFuzzer's working corpus and mutates from there; the random engine does not read them).
Each target gets the same three shapes of case, built from its contract:

- ``smallest``: every dim at its lower bound, the first dtype, default arguments;
- ``tails``: every dim at 17 (or the nearest size the contract admits: not a power of
  two, so block tails run), bfloat16 where admitted, the first argument that admits it
  strided (or permuted, or offset);
- ``specials``: every dim at 8, float16 where admitted, NaN at the first and Inf at the
  last element of the first argument at the case's dtype.

A seed must pass on its target (replay treats a case without a record as ``expect: pass``),
so each is executed first and written only if it passes; one that fails is reported, not
written. Targets with a planted bug get no seeds of their own: a campaign on one starts
from nothing, as from its base's bugs.
"""
from __future__ import annotations

import argparse
import sys

from kfuzz.case import ArgCase, Case, Layout
from kfuzz.corpus import Corpus
from kfuzz.execute import execute
from kfuzz.target import Target, load_targets
from kfuzz.dtypes import special_value_table


def _size(dim, want: int) -> int:
    hi = min(dim.hi, dim.cpu_hi or dim.hi)
    n = max(dim.lo, min(hi, want))
    n -= n % dim.multiple_of
    return n if dim.admits(n) else dim.lo + (-dim.lo) % dim.multiple_of


def _dims(target: Target, want: int | None) -> dict[str, int]:
    for w in ([want, 16, 8, 4, 2] if want else [None]):
        dims = {k: (d.lo + (-d.lo) % d.multiple_of if w is None else _size(d, w)) for k, d in target.dims.items()}
        if target.constraint is None or not target.constraint(dims):
            return dims
    return {k: d.lo for k, d in target.dims.items()}


def _dtype(target: Target, want: str) -> str:
    return want if want in target.dtypes else target.dtypes[0]


def seeds_of(target: Target) -> dict[str, Case]:
    """The three seeds of ``target`` by kind."""
    out = {"smallest": Case.make(target.name, target.dtypes[0], 0, _dims(target, None))}

    dims, dtype = _dims(target, 17), _dtype(target, "bfloat16")
    args = {}
    for name, arg in target.args.items():
        rank = len(arg.shape)
        for kind, layout in (("strided", Layout("strided", step=(1,) * (rank - 1) + (2,))),
                             ("permuted", Layout("permuted", perm=tuple(reversed(range(rank))))),
                             ("offset", Layout("offset", offset=3))):
            if rank and kind in arg.layouts and (kind != "permuted" or rank > 1):
                args[name] = ArgCase(layout=layout)
                break
        if args:
            break
    out["tails"] = Case.make(target.name, dtype, 1, dims, args)

    dims, dtype = _dims(target, 8), _dtype(target, "float16")
    args = {}
    for name, arg in target.args.items():
        if arg.dtype == "case" and special_value_table(dtype).get("inf") is not None:
            last = target.numel(name, dims) - 1
            args[name] = ArgCase(inject=((0, "nan"),) + (((last, "inf"),) if last > 0 else ()))
            break
    out["specials"] = Case.make(target.name, dtype, 2, dims, args)
    for case in out.values():
        target.validate(case)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=".", help="project root holding seeds/")
    ap.add_argument("--targets", default=None, help="comma-separated; default: every shipped target")
    a = ap.parse_args(argv)
    targets = load_targets()
    names = a.targets.split(",") if a.targets else sorted(n for n, t in targets.items() if not t.planted_bug)
    corpus, failed = Corpus(a.root), 0
    for name in names:
        target = targets[name]
        for kind, case in seeds_of(target).items():
            verdict = execute(case, target)
            if verdict.passed:
                print(f"{name:20s} {kind:9s} {corpus.save_seed(case)}", flush=True)
            else:
                failed += 1
                print(f"{name:20s} {kind:9s} NOT WRITTEN: {verdict.signature.slug}: {verdict.detail[:200]}",
                      file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
