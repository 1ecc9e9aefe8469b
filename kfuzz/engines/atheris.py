"""The atheris engine: libFuzzer's coverage-guided search over the case space.

libFuzzer takes over the process it runs in (``atheris.Fuzz`` never returns), so it
runs in its own spawned *fuzzer process*, one per job; the campaign stays in kfuzz's
process and drives kernels through its sandboxed workers. The two meet in
``next_case``/``feedback``:

1. libFuzzer calls ``TestOneInput(data)`` in the fuzzer process; the bytes become a
   case (``decode_input``): a ``.case.zst`` encoding is read as is, anything else is
   decoded field by field through ``FuzzedDataProvider``; either way the case is
   valid for the target;
2. the case goes to kfuzz's process (``next_case``), is executed and judged;
3. ``feedback`` sends back *features*, which the fuzzer process turns into coverage
   by calling one instrumented leaf function a feature (``_feature_leaves``):
   the harness's own line edges that the worker executed, and with ``divergence``
   on, how close the case came to failing (verdict kind, error-over-bound bucket,
   count of non-finite outputs, exception site). Divergence feedback is off by
   default: measured, it did not help and on the deepest control it hurt (every
   new error bucket is a corpus entry, and the corpus drowns; docs/benchmarks.md).

Only the decoder and the feature leaves are instrumented, not torch.
libFuzzer mutates through ``mutate_case`` (structure-aware: one change to dims,
dtype, seed, a layout, a distribution or the injections; every result is a valid
case) and ``crossover`` (fields taken from either parent); now and then through
libFuzzer's byte mutator, whose output goes through the decoder, and now and then
(``P_FRESH``) a fresh case from the random engine, which also supplies ``INITIAL``
cases of the starting corpus: the random engine is the fallback's breadth, the
mutator the depth around what coverage kept.

The corpus: libFuzzer works in a temporary folder that starts as a copy of
``seeds/<target>/`` (the files are ``.case.zst`` bytes already); a case that brings
a feature kfuzz's process has not seen is reported kept, and the campaign saves it
under ``seeds/<target>/``, so the next campaign starts from it.

``mode="hypothesis"`` decodes instead with ``kfuzz.strategies`` through hypothesis's
``fuzz_one_input`` (no custom mutator, no seeds); it is kept for the measurement in
docs/benchmarks.md.
"""
from __future__ import annotations

import json
import math
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import zlib
from multiprocessing.connection import Connection, wait
from pathlib import Path

from kfuzz.case import DISTRIBUTIONS, ArgCase, Case, Dist, Layout, decode, encode
from kfuzz.corpus import target_folder
from kfuzz.engines.random import EDGE_SIZES, sample_case, sample_layout, sample_size
from kfuzz.errors import KfuzzError
from kfuzz.launcher import helpers_ignore_ctrl_c
from kfuzz.target import Target, get_target, prepare_triton
from kfuzz.verdict import KINDS

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
FEATURES = 1024                       # one instrumented leaf function a feature
COVERAGE_LEAVES = 768                 # harness edges hash into [0, 768); divergence above
MAX_LEN = 4096
P_BYTES = 0.05                        # share of mutations left to libFuzzer's byte mutator
P_FRESH = 0.2                         # share of mutations replaced by a fresh random case
INITIAL = 32                          # random cases added to libFuzzer's starting corpus
STARTUP_TIMEOUT = 600.0


# decoding bytes into a case -------------------------------------------------------------------

def _hi(dim) -> int:
    return getattr(dim, "search_hi", dim.hi)


def _fix(case: Case, target: Target) -> Case:
    """Bring injections inside their argument after a size change; CaseError if still invalid."""
    dims = case.dim
    args = {}
    for name, a in case.args:
        n = target.numel(name, dims)
        inject = tuple(sorted({(p % n): v for p, v in a.inject}.items())) if n else ()
        args[name] = ArgCase(a.layout, a.dist, inject)
    case = case.with_(args=args)
    target.validate(case)
    return case


def decode_fdp(data: bytes, target: Target) -> Case:
    """A valid case from arbitrary bytes, field by field (small byte changes, small case changes)."""
    import atheris
    fdp = atheris.FuzzedDataProvider(data)
    dims = {}
    for name, d in target.dims.items():
        hi = _hi(d)
        edges = [s for s in EDGE_SIZES if d.lo <= s <= hi and s % d.multiple_of == 0] or [d.lo]
        if fdp.ConsumeBool():
            n = fdp.PickValueInList(edges)
        else:
            n = fdp.ConsumeIntInRange(d.lo, hi)
            n = max(d.lo, n - n % d.multiple_of)
        dims[name] = n
    if target.constraint is not None and target.constraint(dims):
        dims = {name: d.lo + (-d.lo) % d.multiple_of for name, d in target.dims.items()}
    dtype = fdp.PickValueInList(list(target.dtypes))
    seed = fdp.ConsumeUInt(4)
    args = {}
    for name, arg in target.args.items():
        rank = len(arg.shape)
        kind = fdp.PickValueInList(["contiguous"] * 3 + list(arg.layouts))
        layout = _layout_of(kind, rank, fdp)
        dist_kind = fdp.PickValueInList(["normal"] * 3 + list(DISTRIBUTIONS))
        dist = _dist_of(dist_kind, fdp.ConsumeIntInRange(0, 2))
        numel = target.numel(name, dims)
        names = target.special_names(name, dtype)
        inject = {}
        for _ in range(fdp.ConsumeIntInRange(0, 3) if numel and names else 0):
            inject[fdp.ConsumeIntInRange(0, numel - 1)] = fdp.PickValueInList(names)
        args[name] = ArgCase(layout, dist, tuple(sorted(inject.items())))
    return _fix(Case.make(target.name, dtype, seed, dims, args), target)


def _layout_of(kind: str, rank: int, fdp) -> Layout:
    if rank == 0 or kind == "contiguous":
        return Layout()
    if kind == "permuted":
        perm = list(range(rank))
        for i in range(rank - 1, 0, -1):
            j = fdp.ConsumeIntInRange(0, i)
            perm[i], perm[j] = perm[j], perm[i]
        return Layout("permuted", perm=tuple(perm)) if perm != sorted(perm) else Layout()
    if kind == "strided":
        return Layout("strided", step=tuple(fdp.ConsumeIntInRange(1, 3) for _ in range(rank)))
    if kind == "offset":
        return Layout("offset", offset=fdp.ConsumeIntInRange(1, 17))
    return Layout("expanded", dims=(fdp.ConsumeIntInRange(0, rank - 1),))


def _dist_of(kind: str, k: int) -> Dist:
    if kind == "scaled":
        return Dist(kind, (("factor", (1e-2, 1e2, 1e4)[k]),))
    if kind == "shifted":
        return Dist(kind, (("shift", (5.0, -5.0, 100.0)[k]),))
    return Dist(kind)


def decode_input(data: bytes, target: Target) -> Case:
    """The case that libFuzzer's bytes stand for (see the module docstring)."""
    if data[:4] == ZSTD_MAGIC:
        try:
            case, _ = decode(data)
            if case.target == target.name:
                target.validate(case)
                return case
        except KfuzzError:
            pass
    return decode_fdp(data, target)


# structure-aware mutation ------------------------------------------------------------------

def _new_dist(rng: random.Random, old: Dist) -> Dist:
    for _ in range(8):
        d = _dist_of(rng.choice(DISTRIBUTIONS), rng.randrange(3))
        if d != old:
            return d
    return Dist()


def mutate_case(case: Case, target: Target, rng: random.Random) -> Case:
    """One structural change; the result is a valid case for ``target``."""
    for _ in range(16):
        what = rng.choice(("dims", "dims", "dtype", "seed", "layout", "dist", "inject", "inject"))
        try:
            if what == "dims":
                name = rng.choice(list(target.dims))
                d = target.dims[name]
                old = case.dim[name]
                n = rng.choice((sample_size(rng, d.lo, _hi(d), d.multiple_of), old + d.multiple_of,
                                old - d.multiple_of, old * 2, old // 2))
                new = case.with_(dims={**case.dim, name: n})
            elif what == "dtype":
                new = case.with_(dtype=rng.choice(target.dtypes))
            elif what == "seed":
                new = case.with_(seed=rng.getrandbits(32))
            else:
                name = rng.choice(list(target.args))
                a, arg = case.arg(name), target.args[name]
                if what == "layout":
                    a = ArgCase(sample_layout(_forced(rng), len(arg.shape), arg.layouts), a.dist, a.inject)
                elif what == "dist":
                    a = ArgCase(a.layout, _new_dist(rng, a.dist), a.inject)
                else:
                    a = ArgCase(a.layout, a.dist, _mutate_injections(rng, a.inject, case, target, name))
                new = case.with_arg(name, a)
            new = _fix(new, target)
        except KfuzzError:
            continue
        if new != case:
            return new
    return case.with_(seed=rng.getrandbits(32))


class _forced(random.Random):
    """A Random whose first draw in ``sample_layout`` always asks for a non-default layout."""

    def __init__(self, parent: random.Random):
        super().__init__(parent.getrandbits(64))
        self._first = True

    def random(self):
        if self._first:
            self._first = False
            return 0.0
        return super().random()


def _position(rng: random.Random, shape: tuple[int, ...]) -> int:
    """A flat position; half the time at an edge of the last dim (its first element or one of
    its last 16, where tail loops and masks live), in a random row."""
    n = math.prod(shape)
    if not shape or rng.random() < 0.5:
        return rng.randrange(n)
    d = shape[-1]
    col = rng.choice((0, d - 1, d - 1 - rng.randrange(min(d, 16))))
    return rng.randrange(n // d) * d + col


def _mutate_injections(rng, inject, case, target, name) -> tuple:
    shape = target.shape_of(target.args[name].shape, case.dim)
    n = math.prod(shape)
    names = target.special_names(name, case.dtype)
    items = dict(inject)
    op = rng.choice(("add", "add", "drop", "value", "move")) if items else "add"
    if op == "add" and n and names:
        items[_position(rng, shape)] = rng.choice(names)
    elif op == "drop":
        items.pop(rng.choice(list(items)))
    elif op == "value" and names:
        items[rng.choice(list(items))] = rng.choice(names)
    elif op == "move" and n:
        pos = rng.choice(list(items))
        items[rng.choice((pos + 1, pos - 1, _position(rng, shape))) % n] = items.pop(pos)
    return tuple(sorted(items.items()))


def crossover(a: Case, b: Case, target: Target, rng: random.Random) -> Case:
    """Each field (every dim, dtype, seed, every argument) taken from ``a`` or ``b``."""
    pick = lambda x, y: x if rng.random() < 0.5 else y  # noqa: E731
    dims = {k: pick(a.dim[k], b.dim[k]) for k in target.dims}
    args = {k: pick(a.arg(k), b.arg(k)) for k in target.args}
    try:
        return _fix(Case.make(target.name, pick(a.dtype, b.dtype), pick(a.seed, b.seed), dims, args), target)
    except KfuzzError:
        return a


# features: what kfuzz's process tells libFuzzer about a case ---------------------------------

def _bucket(x: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))


def divergence_features(verdict, outputs) -> list[int]:
    """How close the case came to failing, as feature ids in [COVERAGE_LEAVES, FEATURES)."""
    base = COVERAGE_LEAVES
    feats = [base + KINDS.index(verdict.kind)]                       # 10 kinds
    r = verdict.ratio
    rb = 0 if not r or r <= 0 else (63 if math.isinf(r) or math.isnan(r) else
                                    _bucket(int(2 * math.log2(r)) + 48, 1, 62))
    feats.append(base + 16 + rb)                                     # error over bound, half-octaves
    if outputs:
        import torch
        nonfinite = sum(int((~torch.isfinite(v.float())).sum()) for v in outputs.values())
        feats.append(base + 80 + _bucket(nonfinite.bit_length(), 0, 31))
    if verdict.frame or verdict.exc_type:
        site = f"{verdict.exc_type}@{verdict.frame}"
        feats.append(base + 128 + zlib.crc32(site.encode()) % 128)
    return feats


def coverage_features(edges) -> list[int]:
    return sorted({zlib.crc32(e.to_bytes(8, "little")) % COVERAGE_LEAVES for e in edges})


def _feature_leaves(instrument) -> list:
    """FEATURES tiny functions, each its own code object and so its own coverage counter.
    (One function with a branch per feature would do, but atheris instruments a large
    function in time that grows faster than its size.)"""
    leaves = []
    for k in range(FEATURES):
        namespace: dict = {}
        exec(f"def _feature_{k}():\n    return {k}", namespace)   # noqa: S102
        leaves.append(instrument(namespace[f"_feature_{k}"]))
    return leaves


# the fuzzer process ------------------------------------------------------------------------

def _fuzzer_main(conn: Connection, target_name: str, mode: str, corpus_dir: str, seed: int, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)     # libFuzzer's own chatter goes to the log, never to kfuzz's terminal
    prepare_triton()
    import atheris
    target = get_target(target_name)
    leaves = _feature_leaves(atheris.instrument_func)
    for fn in (decode_input, decode_fdp, _layout_of, _dist_of, _fix):
        atheris.instrument_func(fn)

    def ask(case: Case) -> None:
        try:
            conn.send(case.canonical())
            features = conn.recv()
        except (EOFError, OSError):
            os._exit(0)   # the campaign is over
        for f in features:
            leaves[f]()

    def test_one_input(data: bytes) -> None:
        ask(decode_input(data, target))

    def custom_mutator(data: bytes, max_size: int, s: int) -> bytes:
        rng = random.Random(s)
        r = rng.random()
        if r < P_BYTES:
            return atheris.Mutate(data, max_size)
        if r < P_BYTES + P_FRESH:   # the random engine as the fallback: breadth the corpus lacks
            return encode(sample_case(target, rng))[:max_size]
        return encode(mutate_case(decode_input(data, target), target, rng))[:max_size]

    def custom_crossover(d1: bytes, d2: bytes, max_size: int, s: int) -> bytes:
        rng = random.Random(s)
        return encode(crossover(decode_input(d1, target), decode_input(d2, target), target, rng))[:max_size]

    # libFuzzer's own artifacts (crash-<sha1> files) stay in the engine's folder, not the cwd;
    # SIGINT stays ignored (-handle_int=0): kfuzz's process ends its fuzzers
    argv = [sys.argv[0], f"-seed={seed}", f"-max_len={MAX_LEN}", "-rss_limit_mb=0", "-timeout=0",
            "-print_final_stats=0", "-reduce_inputs=0", "-handle_int=0", f"-artifact_prefix={os.path.dirname(log)}/"]
    conn.send(("ready", os.getpid()))
    if mode == "hypothesis":
        from hypothesis import HealthCheck, given, settings
        from kfuzz import strategies

        @settings(database=None, deadline=None, suppress_health_check=list(HealthCheck))
        @given(strategies.cases(target))
        def prop(case):
            ask(case)
        atheris.Setup(argv, prop.hypothesis.fuzz_one_input)
    else:
        atheris.Setup(argv + [corpus_dir], test_one_input, custom_mutator=custom_mutator,
                      custom_crossover=custom_crossover)
    atheris.Fuzz()


# the engine, in kfuzz's process --------------------------------------------------------------

class AtherisEngine:
    """Coverage-guided engine; ``start`` spawns the fuzzer processes, ``close`` ends them."""

    name = "atheris"
    wants_coverage = True

    def __init__(self, target: Target, seed: int = 0, mode: str = "hand", divergence: bool = False):
        if mode not in ("hand", "hypothesis"):
            raise ValueError(f"unknown atheris mode {mode!r}")
        try:
            import atheris  # noqa: F401
        except ImportError:
            raise KfuzzError("the atheris engine needs atheris: pip install 'kfuzz[fuzz]'") from None
        self.target, self.seed, self.mode, self.divergence = target, seed, mode, divergence
        self.fuzzers: list = []
        self.pending: dict[str, list] = {}     # canonical case -> fuzzer connections waiting
        self.seen: set[int] = set()
        self.workdir: Path | None = None
        self.corpus = None

    def start(self, corpus=None, parallel: int = 1) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=f"kfuzz-atheris-{target_folder(self.target.name)}-"))
        (self.workdir / "corpus").mkdir()
        if corpus is not None and self.mode == "hand":
            seeds = corpus.seed_folder(self.target.name)
            for f in sorted(seeds.glob("*.case.zst")) if seeds.is_dir() else []:
                shutil.copyfile(f, self.workdir / "corpus" / f.name)
        if self.mode == "hand":
            rng = random.Random(self.seed)
            for i in range(INITIAL):
                (self.workdir / "corpus" / f"random-{i}").write_bytes(encode(sample_case(self.target, rng)))
        self.fuzzers = [self._spawn(i) for i in range(parallel)]

    def _spawn(self, i: int):
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        p = ctx.Process(target=_fuzzer_main, daemon=True, name=f"kfuzz-fuzzer-{i}",
                        args=(child, self.target.name, self.mode, str(self.workdir / "corpus"),
                              self.seed * 1000 + i + 1, str(self.workdir / f"fuzzer-{i}.log")))
        with helpers_ignore_ctrl_c():
            p.start()
        child.close()
        if not conn.poll(STARTUP_TIMEOUT) or conn.recv()[0] != "ready":
            p.kill()
            raise RuntimeError(f"atheris fuzzer process did not start; see {self.workdir}/fuzzer-{i}.log")
        return [p, conn, i]

    @property
    def capacity(self) -> int:
        """Each fuzzer process waits for one case's features before it proposes the next."""
        return max(1, len(self.fuzzers))

    def next_case(self) -> Case:
        if not self.fuzzers:
            self.start()
        while True:
            ready = wait([f[1] for f in self.fuzzers], timeout=STARTUP_TIMEOUT)
            for fz in self.fuzzers:
                if fz[1] not in ready:
                    continue
                try:
                    text = fz[1].recv()
                except (EOFError, OSError):   # libFuzzer ended (it should not): start it again
                    fz[0].join(5)
                    self.fuzzers[self.fuzzers.index(fz)] = self._spawn(fz[2])
                    break
                case = Case.from_json(json.loads(text))
                self.pending.setdefault(text, []).append(fz[1])
                return case
            else:
                if not ready:
                    raise RuntimeError(f"atheris fuzzer processes stalled; see {self.workdir}")

    def features(self, verdict, result) -> list[int]:
        feats = coverage_features(result.coverage)
        if self.divergence:
            feats += divergence_features(verdict, result.outputs)
        return feats

    def feedback(self, case: Case, verdict, result) -> bool:
        """Tell the waiting fuzzer process the case's features; True if one is new."""
        feats = self.features(verdict, result)
        waiting = self.pending.get(case.canonical())
        if waiting:
            conn = waiting.pop(0)
            if not waiting:
                del self.pending[case.canonical()]
            try:
                conn.send(feats)
            except (OSError, BrokenPipeError):
                pass
        new = set(feats) - self.seen
        self.seen |= new
        return bool(new)

    def close(self) -> None:
        for p, conn, _ in self.fuzzers:
            conn.close()
            p.join(2)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.fuzzers = []
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
