"""The GDN-family forward: oracle, chunked reference and Triton kernel.

Without a GPU the Triton kernel runs under the interpreter (TRITON_INTERPRET=1,
set before gdn.chunk_fwd is imported, since triton.jit reads it then)."""
import dataclasses
import json
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from gdn.chunk_fwd import chunk_gdn_fwd  # noqa: E402
from gdn.common import fdot, saturated  # noqa: E402
from gdn.config import DEFAULT  # noqa: E402
from gdn.fwd_state import _chunk_scalars as _real_scalars  # noqa: E402
from gdn.oracle import recurrence  # noqa: E402
from gdn.reference import chunked  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN, interpreter
DEV = "cuda" if torch.cuda.is_available() else "cpu"
MEMBERS = [(gate, delta) for gate in ("none", "scalar", "vector") for delta in (True, False)]
MEMBER_IDS = [f"{gate}-{'delta' if delta else 'linear'}" for gate, delta in MEMBERS]
BOUND = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# the output kernel's matrix part with K in 16-wide slices (bf16 inputs at K over 16)
SLICED_16 = dataclasses.replace(DEFAULT, out_sliced=dataclasses.replace(DEFAULT.out_sliced, bk=16))
if DEV == "cuda":
    BOUND[torch.float32] = 1e-4  # fp32 inputs use ieee products, not tf32


def make_inputs(gate, delta, B=2, T=37, H=2, K=16, V=32, *, dtype=torch.float32, seed=0,
                cu_seqlens=None, h0=True):
    """Domain inputs: L2-normalized keys, beta in (0, 1), gates in log space <= 0."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    x = dict(q=rnd(B, T, H, K), k=torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1),
             v=rnd(B, T, H, V), g=None, beta=None,
             initial_state=rnd(N, H, K, V) if h0 else None)
    if gate == "scalar":
        x["g"] = torch.nn.functional.logsigmoid(rnd(B, T, H) + 2)
    elif gate == "vector":
        x["g"] = torch.nn.functional.logsigmoid(rnd(B, T, H, K) + 2)
    if delta:
        x["beta"] = torch.rand(B, T, H, generator=gen)
    for name in ("q", "k", "v"):
        x[name] = x[name].to(dtype)
    return {n: (t.to(DEV) if t is not None else None) for n, t in x.items()}


def call(fn, x, **kw):
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], **kw)


def rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# -- the oracle ---------------------------------------------------------------

def naive(q, k, v, g, beta, scale, S, delta):
    """The recurrence with explicit K x K transition matrices, one sequence, one head."""
    outs = []
    for t in range(q.shape[0]):
        a = torch.ones(k.shape[1], dtype=torch.float64) if g is None else torch.exp(g[t]) * \
            torch.ones(k.shape[1], dtype=torch.float64)
        M = torch.diag(a)
        if delta:
            M = (torch.eye(k.shape[1], dtype=torch.float64) - beta[t] * torch.outer(k[t], k[t])) @ M
            S = M @ S + beta[t] * torch.outer(k[t], v[t])
        else:
            S = M @ S + torch.outer(k[t], v[t])
        outs.append(S.T @ (scale * q[t]))
    return torch.stack(outs), S


@pytest.mark.parametrize("gate,delta", MEMBERS, ids=MEMBER_IDS)
def test_oracle_matches_naive_loop(gate, delta):
    cu = torch.tensor([0, 9, 10, 23])
    x = make_inputs(gate, delta, B=1, T=23, K=8, V=5, cu_seqlens=cu)
    x = {n: (t.cpu().double() if t is not None else None) for n, t in x.items()}
    o, s = call(recurrence, x, cu_seqlens=cu, delta=delta, scale=0.3)
    for n in range(3):
        for h in range(2):
            sl = slice(int(cu[n]), int(cu[n + 1]))
            g = None if x["g"] is None else x["g"][0, sl, h]
            b = None if x["beta"] is None else x["beta"][0, sl, h]
            on, sn = naive(x["q"][0, sl, h], x["k"][0, sl, h], x["v"][0, sl, h], g, b, 0.3,
                           x["initial_state"][n, h], delta)
            torch.testing.assert_close(o[0, sl, h], on, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(s[n, h], sn, rtol=1e-12, atol=1e-12)


def test_oracle_is_differentiable_and_optional_state():
    x = make_inputs("vector", True, B=1, T=6, K=4, V=3)
    x = {n: t.cpu().double().requires_grad_() for n, t in x.items()}
    o, s = call(recurrence, x, output_final_state=False)
    assert s is None
    o.square().sum().backward()
    assert all(x[n].grad is not None for n in x)


# -- the chunked reference -----------------------------------------------------

@pytest.mark.parametrize("gate,delta", MEMBERS, ids=MEMBER_IDS)
def test_reference_matches_oracle(gate, delta):
    for kw in (dict(B=2, T=100), dict(B=1, T=100, cu_seqlens=torch.tensor([0, 30, 31, 100]))):
        x = make_inputs(gate, delta, K=16, V=24, **kw)
        x = {n: (t.cpu() if t is not None else None) for n, t in x.items()}
        cu = kw.get("cu_seqlens")
        o, s = call(recurrence, x, cu_seqlens=cu, delta=delta)
        o2, s2 = call(chunked, x, cu_seqlens=cu, delta=delta, chunk_size=16)
        assert o2.dtype == torch.float32 and s2.dtype == torch.float32
        assert rel(o2, o) < 1e-5 and rel(s2, s) < 1e-5


# -- the Triton forward ----------------------------------------------------------

SHAPES = {
    "T37-K16-V32": dict(B=2, T=37, H=2, K=16, V=32),
    "T100-K32-V16": dict(B=1, T=100, H=2, K=32, V=16, h0=False),
    "varlen3": dict(B=1, T=90, H=2, K=16, V=16, cu_seqlens=torch.tensor([0, 17, 18, 90])),
    # K, V not powers of two (masked columns), T not a multiple of either chunk size
    "T77-K24-V20": dict(B=1, T=77, H=1, K=24, V=20),
}
if DEV == "cuda":   # 32-wide output tiles at K 64 give o 0.45 off or an illegal address on the H200
    SHAPES["T100-K64-V32"] = dict(B=1, T=100, H=2, K=64, V=32)


# bf16 inputs hand bf16 intermediates (w, u, chunk states, v_new) between launches.
# On a GPU every shape, dtype and member (each compiles on its own); under the interpreter each
# shape meets each member once, at a dtype chosen so that every dtype meets every shape and
# every member.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CASES = [(shape, dtype, *member) for i, shape in enumerate(SHAPES) for j, member in enumerate(MEMBERS)
         for k, dtype in enumerate(DTYPES) if DEV == "cuda" or k == (i + j) % len(DTYPES)]


def _seed(shape: str) -> int:
    """A seed per shape name, the same in every run (str's hash() is salted per process)."""
    return zlib.crc32(shape.encode()) % 1000


@pytest.mark.parametrize("shape,dtype,gate,delta", CASES,
                         ids=[f"{s}-{str(d)[6:]}-{MEMBER_IDS[MEMBERS.index((g, dl))]}" for s, d, g, dl in CASES])
def test_triton_matches_oracle(shape, gate, delta, dtype):
    kw = dict(SHAPES[shape])
    cu = kw.get("cu_seqlens")
    x = make_inputs(gate, delta, dtype=dtype, seed=_seed(shape), **kw)
    if cu is not None:
        cu = cu.to(DEV)
    o, s = call(recurrence, x, cu_seqlens=cu, delta=delta)
    o2, s2 = call(chunk_gdn_fwd, x, cu_seqlens=cu, delta=delta)
    assert o2.dtype == dtype and o2.shape == o.shape and s2.dtype == torch.float32
    assert rel(o2, o) < BOUND[dtype], rel(o2, o)
    assert rel(s2, s) < BOUND[dtype], rel(s2, s)
    if dtype == torch.float32:
        _, s3 = call(chunk_gdn_fwd, x, cu_seqlens=cu, delta=delta, output_final_state=False)
        assert s3 is None


def test_triton_strong_gates_take_exact_path_and_stay_accurate():
    """Huge negative gates (chunk decay far past the fast path's limits) and a
    long sequence of vector-gate chunks."""
    for gate in ("scalar", "vector"):
        x = make_inputs(gate, True, B=1, T=70, H=1, K=16, V=16)
        x["g"] = x["g"] * 40 - 1e6 * (torch.rand_like(x["g"]) < 0.05)
        o, s = call(recurrence, x)
        o2, s2 = call(chunk_gdn_fwd, x)
        assert o2.isfinite().all() and rel(o2, o) < 1e-4 and rel(s2, s) < 1e-4


# -- the NaN/Inf contract --------------------------------------------------------

INJECT_AT = 20  # mid-chunk for the 64-token chunks (scalar/no gate) and the 16-token ones (vector)


def inject(x, name, value):
    t = x[name]
    if name == "initial_state":
        t[0, 1, 3, 5] = value
    elif t.dim() == 3:
        t[0, INJECT_AT, 1] = value
    else:
        t[0, INJECT_AT, 1, 3] = value


def assert_same_nonfinite(out, ref, bound=1e-4):
    ref = ref.to(out.dtype)
    assert torch.equal(out.isnan(), ref.isnan()), "NaN sets differ"
    assert torch.equal(out.isinf(), ref.isinf()), "Inf sets differ"
    assert torch.equal(out.isposinf(), ref.isposinf()), "Inf signs differ"
    fin = ref.isfinite()
    if fin.any():
        assert rel(out[fin], ref[fin].double()) < bound


SPECIAL_VALUES = (float("nan"), float("inf"), float("-inf"))


def check_nonfinite_sets(gate, delta):
    """A NaN, +Inf or -Inf in one element of each input mid-chunk: the kernel's NaN/Inf sets
    equal the oracle's and the rest is within 1e-4.  The value rotates with the input and the
    member, so that each member meets all three and each input meets all three over the members."""
    names = ["q", "k", "v", "initial_state"] + (["g"] if gate != "none" else []) + \
        (["beta"] if delta else [])
    member = MEMBERS.index((gate, delta))
    for name in names:
        i = ["q", "k", "v", "initial_state", "g", "beta"].index(name)
        value = SPECIAL_VALUES[(i + member) % len(SPECIAL_VALUES)]
        x = make_inputs(gate, delta, B=1, T=28, H=2, K=16, V=16, seed=7)
        inject(x, name, value)
        o, s = call(recurrence, x, delta=delta)
        o2, s2 = call(chunk_gdn_fwd, x, delta=delta)
        assert_same_nonfinite(o2, o)
        assert_same_nonfinite(s2, s)


@pytest.mark.parametrize("gate,delta", MEMBERS, ids=MEMBER_IDS)
def test_triton_nonfinite_sets_equal_oracle(gate, delta):
    check_nonfinite_sets(gate, delta)


@pytest.mark.skipif(DEV != "cuda", reason="a GPU compile problem; the interpreter has no shared memory")
@pytest.mark.parametrize("gate,delta", MEMBERS, ids=MEMBER_IDS)
def test_nonfinite_v_at_bf16_wide_tiles_on_gpu(gate, delta):
    """A NaN or Inf in v sends a chunk to the state pass's 16-wide resume tiles.  With bf16
    operands there, DeltaNet at B2 T300 H16 K=V=128 reads shared memory out of bounds on the
    H200 (Triton 3.6; compute-sanitizer places it in the tiles' product)."""
    for value in (float("nan"), float("inf")):
        x = make_inputs(gate, delta, B=2, T=300, H=16, K=128, V=128, seed=3, dtype=torch.bfloat16)
        x["v"][0, 150, 3, 9] = value
        o, s = call(recurrence, x, delta=delta)
        o2, s2 = call(chunk_gdn_fwd, x, delta=delta)
        torch.cuda.synchronize()
        assert_same_nonfinite(o2, o, BOUND[torch.bfloat16])
        assert_same_nonfinite(s2, s, BOUND[torch.bfloat16])


@pytest.mark.parametrize("gate,delta", [("none", False), ("scalar", True)],
                         ids=["none-linear", "scalar-delta"])
def test_triton_nonfinite_sets_equal_oracle_fp16(gate, delta):
    """fp16 inputs (the scan reads q, k, v in their dtype): an Inf must send its
    chunk to the exact path even though the bound 65536 is inf in fp16.  The sign alternates
    over the inputs and the two members, so that each input meets both."""
    for i, name in enumerate(("q", "k", "v")):
        value = float("inf") if (i + (gate == "none")) % 2 == 0 else float("-inf")
        x = make_inputs(gate, delta, B=1, T=28, H=2, K=16, V=16, seed=7, dtype=torch.float16)
        inject(x, name, value)
        o, s = call(recurrence, x, delta=delta)
        o2, s2 = call(chunk_gdn_fwd, x, delta=delta)
        assert_same_nonfinite(o2, o, BOUND[torch.float16])
        assert_same_nonfinite(s2, s, BOUND[torch.float16])




@triton.jit
def _scalars_one_too_far(flag, gflag, gc, gcl, c_first, bos, eos, c, nch, i_h, H: tl.constexpr,
                         BT: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr):
    """A planted `gdn.fwd_state._chunk_scalars`: the chunk after the one asked for."""
    return _real_scalars(flag, gflag, gc, gcl, c_first, bos, eos, c + 1, nch, i_h, H, BT, GATE, DELTA)


@pytest.mark.parametrize("gate,delta,T,cu,nan_in,planted", [
    pytest.param("scalar", True, 260, None, None, True, marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="plants a helper, which the interpreter looks up at each call and a "
                                          "compiled kernel keeps from its first compile")),
    ("scalar", True, 260, None, "k", False),
    ("none", True, 200, None, "v", False),
    ("vector", True, 150, None, None, False),
    ("scalar", False, 200, None, "q", False),
    ("scalar", True, 300, [0, 30, 31, 200, 300], "g", False),
])
def test_state_scalars_loaded_a_chunk_ahead_follow_the_recurrence(monkeypatch, gate, delta, T, cu,
                                                                  nan_in, planted):
    """The state pass's matrix part takes each chunk's flags and last gate from loads issued a
    chunk ahead (`gdn.fwd_state._chunk_scalars`): o and the final state follow the recurrence, NaNs
    where it has them, over sequences of 3 to 5 chunks, every gate, delta rule on and off,
    varlen with short sequences, a NaN stopping the matrix part in mid-sequence.  Planted,
    the scalars of the chunk after the right one fail it."""
    import gdn.fwd_state
    x = make_inputs(gate, delta, B=1, T=T, H=2, K=16, V=32, seed=7,
                    cu_seqlens=None if cu is None else torch.tensor(cu))
    if nan_in is not None:   # in the third chunk: the matrix part runs two chunks, then stops
        t = x[nan_in]
        (t[0, 150, 1] if t.dim() == 3 else t[0, 150, 1, 3]).fill_(float("nan"))
    kw = dict(delta=delta, cu_seqlens=None if cu is None else torch.tensor(cu, device=DEV))
    o, s = call(recurrence, x, **kw)

    def check():
        o2, s2 = call(chunk_gdn_fwd, x, **kw)
        assert_same_nonfinite(o2, o, BOUND[torch.float32])
        assert_same_nonfinite(s2, s, BOUND[torch.float32])
    check()
    if planted:
        monkeypatch.setattr(gdn.fwd_state, "_chunk_scalars", _scalars_one_too_far)
        with pytest.raises(AssertionError):
            check()


def test_state_configs_come_from_the_config(monkeypatch):
    """A config's ``state_configs`` are the state pass's GPU configs: the autotuner and the
    untuned launch see exactly the triples given, the default config the built-in list, and
    one autotuner is kept per list."""
    import dataclasses

    import gdn.fwd_state as fs
    from gdn.config import DEFAULT
    monkeypatch.setattr(fs, "INTERPRET", False)
    mine = dataclasses.replace(DEFAULT, state_configs=((32, 2, 3), (64, 4, 4)))
    triples = lambda cs: [(c.kwargs["BV"], c.num_warps, c.num_stages) for c in cs]  # noqa: E731
    assert triples(fs._state_configs(mine)) == [(32, 2, 3), (64, 4, 4)]
    assert triples(fs._state_configs(DEFAULT)) == list(DEFAULT.state_configs)
    assert triples(fs._tuner(mine).configs) == [(32, 2, 3), (64, 4, 4)]
    assert fs._tuner(dataclasses.replace(mine, state_pick="first")) is fs._tuner(mine)
    assert fs._tuner(DEFAULT) is not fs._tuner(mine)


def test_a_config_refuses_what_no_launch_takes():
    """`GDNConfig` names the field at fault: an unknown state pick, a config that is not a
    (BV, warps, stages) triple, a resume tile that is not a power of two of at least 16, an
    unknown field from a tool's command line; known fields from a dict replace the
    default's."""
    import dataclasses

    from gdn.config import DEFAULT, GDNConfig, OutLaunch
    with pytest.raises(ValueError, match="state_pick"):
        dataclasses.replace(DEFAULT, state_pick="fastest")
    with pytest.raises(ValueError, match="state_configs"):
        dataclasses.replace(DEFAULT, state_configs=((32, 4),))
    with pytest.raises(ValueError, match="bwd_dstates_bv"):
        dataclasses.replace(DEFAULT, bwd_dstates_bv=32)
    for bv in (8, 24):
        with pytest.raises(ValueError, match="state_resume_bv"):
            dataclasses.replace(DEFAULT, state_resume_bv=bv)
    with pytest.raises(ValueError, match="prep_warps_typo"):
        GDNConfig.from_dict({"prep_warps_typo": 8})
    got = GDNConfig.from_dict({"bwd_prep_warps": 8, "out_sliced": {"bv": 64, "warps": 4, "bk": 32},
                               "state_configs": [[64, 4, 2]]})
    assert got == dataclasses.replace(DEFAULT, bwd_prep_warps=8, out_sliced=OutLaunch(bv=64, warps=4, bk=32),
                                      state_configs=((64, 4, 2),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.state_pick = "spread"


def test_the_gdn_code_cites_no_development_log():
    """The GDN kernels, their targets and their tests describe the code as it is: no comment,
    docstring or test name cites a numbered session or log entry or the notes files."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[1]
    files = [*sorted((root / "gdn").glob("*.py")), *sorted((root / "harnesses").glob("gdn*.py")),
             *sorted((root / "tests").glob("test_gdn_*.py"))]
    log = re.compile(r"\b[Ss]essions? \d+|\b[Ee]ntry \d+|\bNOTE[S](?:_BWD)?\.md|\bBENCHMARK[S]\.md")
    found = [f"{p.name}:{i}: {line.strip()}" for p in files
             for i, line in enumerate(p.read_text().splitlines(), 1) if log.search(line)]
    assert not found, found


def test_the_gdn_package_reads_no_environment_switch():
    """The launch choices are `gdn.config`'s fields, passed per call: no module under gdn/ reads
    the environment except for Triton's own TRITON_INTERPRET and GDN_DEVICE_PRODUCTS, which
    applies only under it (an ast walk over every call of os.environ / os.getenv)."""
    import ast
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1] / "gdn"
    reads = set()
    for path in sorted(root.glob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                reads.add(f"{path.name}: {lines[node.lineno - 1].strip()}")
    assert reads == {'common.py: INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"',
                     'common.py: EXACT_PRODUCTS = INTERPRET and os.environ.get("GDN_DEVICE_PRODUCTS") != "1"'}, reads


def test_the_output_kernels_token_by_token_part_over_chunk_groups():
    """The output kernel's PART 1 looks at ``out_chunks`` chunks a program: a NaN in q in a chunk
    of the first program and one in a later program (20 chunks of 64) reach o as the
    oracle's do, and the rest of o matches it."""
    from gdn.config import DEFAULT
    x = make_inputs("scalar", True, B=1, T=1280, H=1, K=16, V=16, seed=3)
    assert 1280 // 64 > DEFAULT.out_chunks
    x["q"] = x["q"].clone()
    x["q"][0, 70, 0, 2] = float("nan")
    x["q"][0, 1250, 0, 5] = float("nan")
    o, s = call(recurrence, x, delta=True)
    o2, s2 = call(chunk_gdn_fwd, x, delta=True)
    assert_same_nonfinite(o2, o)
    assert_same_nonfinite(s2, s)

@pytest.mark.parametrize("gate", ["scalar", "vector"])
@pytest.mark.parametrize("delta", [True, False], ids=["delta", "linear"])
def test_triton_minus_inf_gate_is_a_complete_forget(gate, delta):
    x = make_inputs(gate, delta, B=1, T=100, H=2, K=16, V=16, seed=3)
    if gate == "scalar":
        x["g"][0, [5, 20, 21, 70], 1] = float("-inf")
    else:
        x["g"][0, [5, 20, 21, 70], 1] = float("-inf")  # every key forgets
        x["g"][0, 40, 0, :8] = float("-inf")           # half the keys forget
    o, s = call(recurrence, x, delta=delta)
    o2, s2 = call(chunk_gdn_fwd, x, delta=delta)
    assert o.isfinite().all() and o2.isfinite().all() and s2.isfinite().all()
    assert rel(o2, o) < 1e-4 and rel(s2, s) < 1e-4


def test_a_gate_past_exp_range_leaves_the_tiles_padding_out_of_the_state():
    """A scalar gate whose exp overflows (out of the domain, as an injection may put it)
    multiplies the whole state tile; its padding (K and V under the tile) must not turn
    0 * inf into a NaN that k S then sums into the real columns (gdn_fwd on the H200, kept
    in crashes/gdn_fwd/nonfinite-o/61a742f421880fcd: o NaN where the oracle's is +inf)."""
    x = make_inputs("scalar", True, B=1, T=1, H=1, K=1, V=1, seed=5)
    x["k"] = -x["k"].abs()
    x["g"][0, 0, 0] = 1000.0
    x["beta"][0, 0, 0] = -1.0
    x["initial_state"] = x["initial_state"].abs()
    o, s = call(recurrence, x)
    o2, s2 = call(chunk_gdn_fwd, x)
    assert not o.isnan().any() and not o.isfinite().all()
    assert_same_nonfinite(o2, o)
    assert_same_nonfinite(s2, s)


def test_a_final_state_inside_fp32_keeps_its_digits_beside_one_past_it():
    """A key at fp32's maximum on a chunk's last token, after an initial state holding one:
    the state tile's largest element ends near 1e109 while others lie inside fp32's range.
    Those must come back to fp32 as the oracle's round, not from a subnormal of a state
    scaled by the tile's largest element (gdn_fwd on the H200: ht 3.4e-3 off at 3e36,
    114x the bound; crashes/gdn_fwd/bound-ht/98f562303f1d53fb)."""
    x = make_inputs("scalar", True, B=1, T=16, H=1, K=13, V=40, seed=7)
    x["initial_state"][0, 0, 5, 38] = torch.finfo(torch.float32).max
    x["k"][0, 15, 0, 7] = torch.finfo(torch.float32).max
    _, s = call(recurrence, x)
    _, s2 = call(chunk_gdn_fwd, x)
    inside = s.abs() < torch.finfo(torch.float32).max
    assert (~inside).any() and (s.abs() > 1e30).logical_and(inside).any()
    err = (s2.double() - s).abs()[inside] / s.abs()[inside].clamp_min(1e-30)
    assert err.max() < 1e-5, float(err.max())


def test_triton_nonfinite_in_one_sequence_stays_there():
    cu = torch.tensor([0, 30, 31, 90])
    x = make_inputs("scalar", True, B=1, T=90, H=2, K=16, V=16, cu_seqlens=cu)
    x["v"][0, 40, 1, 2] = float("nan")
    cu = cu.to(DEV)
    o, s = call(recurrence, x, cu_seqlens=cu)
    o2, s2 = call(chunk_gdn_fwd, x, cu_seqlens=cu)
    assert_same_nonfinite(o2, o)
    assert_same_nonfinite(s2, s)
    assert o2[0, :40].isfinite().all() and s2[:2].isfinite().all()




def test_a_state_past_fp32_range_inside_a_chunk_comes_back_as_the_oracles_does():
    """G06 (range, strict) on its seed-0 case, kept in crashes/: beta at bf16's maximum sends
    the chunk to the exact path, whose state passes fp32's range between two steps and comes
    back (the oracle's final state 1.6e32); the fp32 step gave NaN (o -Inf before the float64
    steps).  The q-at-fp32-max case (crashes/gdn_fwd/nonfinite-o/) is replayed by CI."""
    from pathlib import Path

    from kfuzz.corpus import load
    from kfuzz.gates import GATES
    from kfuzz.target import get_target
    case, record = load(Path(__file__).resolve().parents[1] / "crashes" / "gdn_fwd" / "nonfinite-ht" /
                        "f758b859b313ac96.case.zst")
    assert record["fixed_from"]["output"] == "ht"
    verdict = GATES["G06"].check(get_target("gdn_fwd"), case, DEV)
    assert verdict.passed, verdict.detail


def boundary_overflow(gate, delta, dtype=torch.float32, seed=3):
    """Inputs (make_inputs', B1 H1 K4 V8) whose state leaves fp32's range on the last tokens of
    the first chunk and comes back inside it two tokens into the second, where every gate is
    -100: no delta rule, v at 3e38 on keys e_0 for three tokens; with it, keys 2 e_0, beta 1
    and v at 1e36 for eight tokens, each step multiplying row 0 of the state by
    1 - beta |k|^2 = -3 (and its gate)."""
    C = 16 if gate == "vector" else 64
    x = make_inputs(gate, delta, B=1, T=C + 8, H=1, K=4, V=8, dtype=dtype, seed=seed)
    for n in ("q", "k", "v") + (("beta",) if delta else ()):
        x[n] = x[n].clone()
    e0 = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=dtype, device=DEV)
    for t in range(C - (8 if delta else 3), C):
        x["k"][0, t, 0] = 2 * e0 if delta else e0
        if delta:
            x["beta"][0, t, 0] = 1.0
            x["v"][0, t, 0] = 1e36
        else:
            x["v"][0, t, 0] = 3e38
    x["g"] = x["g"].clone()
    x["g"][0, C + 2] = -100.0
    return x


@pytest.mark.parametrize("gate,delta", [("scalar", False), ("vector", False), ("scalar", True),
                                        ("vector", True)])
def test_a_state_past_fp32_range_at_a_chunk_boundary_comes_back_as_the_oracles_does(gate, delta):
    """The state entering the second chunk is past fp32's range (the oracle's 1e39 and more,
    `boundary_overflow`), and the gates of -100 two tokens in bring it back: the state pass
    hands it on as hs 2^hexp, so the output from there on and the final state are the
    oracle's, not inf or NaN (crashes/gdn_fwd_gla/nonfinite-ht: ht +inf where the oracle's is
    2.17e38)."""
    x = boundary_overflow(gate, delta)
    C = 16 if gate == "vector" else 64
    o, s = call(recurrence, x, delta=delta)
    o2, s2, saved = call(chunk_gdn_fwd, x, delta=delta, return_saved=True)
    assert s.isfinite().all() and o[0, C + 2:].isfinite().all()
    assert_same_nonfinite(o2, o)
    assert_same_nonfinite(s2, s)
    assert saved["state_exp"][1].max() > 0


@pytest.mark.parametrize("gate,delta", [("scalar", True), ("none", False)])
def test_large_states_match_the_oracle(gate, delta):
    """A large state makes k S pass BIG in the first chunk, or the initial state pass SBIG
    (the whole sequence resumes on the exact path); and G06's case (seed 0, gdn_fwd_linear):
    one initial-state element at fp32's maximum, so q S overflows fp32 before the scale
    brings it back."""
    for factor in (1e6, 1e31):   # k S past BIG in the first chunk; the initial state past SBIG
        x = make_inputs(gate, delta, B=1, T=70, H=1, K=16, V=16)
        x["initial_state"] = x["initial_state"] * factor
        o, s = call(recurrence, x, delta=delta)
        o2, s2 = call(chunk_gdn_fwd, x, delta=delta)
        assert rel(o2, o) < 1e-4 and rel(s2, s) < 1e-4, factor
    x = make_inputs(gate, delta, B=2, T=16, H=2, K=32, V=32)
    x["initial_state"].view(-1)[0] = torch.finfo(torch.float32).max
    o, s = call(recurrence, x, delta=delta)
    o2, s2 = call(chunk_gdn_fwd, x, delta=delta)
    fin = o.to(torch.float32).isfinite()
    assert o2[fin].isfinite().all() and rel(o2[fin], o[fin]) < 1e-4


def test_spread_takes_one_config_per_key_and_the_same_one_each_time():
    """The "spread" pick (kfuzz's GDN targets): one config order per key, picked from the key
    alone (the same in every process), and different keys start at different configs."""
    import triton

    import gdn.fwd_state as fs
    configs = [triton.Config({"BV": bv}, num_warps=w) for bv in (16, 32, 64) for w in (2, 4, 8)]
    key = dict(K=128, V=128, BT=64, GATE=1, DELTA=True, PREC="tf32", DT="bf16")
    picks = {}
    for occ in (1, 2, 4, 8, 16, 32, 64, 128):
        order = fs._spread_order(configs, dict(key, OCC=occ))
        assert sorted(map(str, order)) == sorted(map(str, configs))   # every config, once
        assert fs._spread_order(configs, dict(key, OCC=occ)) == order
        picks[occ] = configs.index(order[0])
    assert len(set(picks.values())) > 2, picks


def test_the_gdn_targets_pass_the_spread_pick_on_every_call(monkeypatch):
    """kfuzz's GDN targets run the forward's state pass with the "spread" pick, passed with each
    call (harnesses.gdn.CONFIG), forward and backward; importing the harness changes nothing
    for anyone else: a direct call still takes the default, autotuned pick."""
    import gdn.fwd_state as fs
    import harnesses.gdn as hg
    from kfuzz.target import get_target
    picks = []
    real = fs.launch_state
    monkeypatch.setattr(fs, "launch_state", lambda args, NH, config, **kw: picks.append(config.state_pick)
                        or real(args, NH, config, **kw))
    x = make_inputs("scalar", True, B=1, T=20, H=1, K=16, V=16, seed=2)
    args = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], h0=x["initial_state"])
    get_target("gdn_fwd").kernel(**args)
    gen = torch.Generator().manual_seed(3)
    get_target("gdn_bwd").kernel(**args, do=torch.randn(x["v"].shape, generator=gen).to(DEV),
                                 dht=torch.randn(x["initial_state"].shape, generator=gen).to(DEV))
    assert picks == ["spread", "spread"] and hg.CONFIG.state_pick == "spread"
    call(chunk_gdn_fwd, x, delta=True)
    assert picks[-1] == "tune"


def test_a_spread_pick_that_does_not_fit_the_gpu_gives_way_to_the_next():
    """The "spread" launch skips a config the GPU cannot hold (Triton's OutOfResources, raised at
    compile time: the state kernel at fp32 K = V = 256 and BV 64 at 2 stages needs 312320
    bytes of shared memory, the H200 has 232448), and raises when none fits."""
    import triton
    from triton.runtime.errors import OutOfResources

    import gdn.fwd_state as fs
    configs = [triton.Config({"BV": bv}, num_warps=4) for bv in (64, 32, 16)]
    attempts = []

    def launch(config):
        attempts.append(config.kwargs["BV"])
        if config.kwargs["BV"] > 32:
            raise OutOfResources(312320, 232448, "shared memory")
    assert fs._first_that_fits(configs, launch).kwargs["BV"] == 32
    assert attempts == [64, 32]

    def never(config):
        raise OutOfResources(1, 0, "shared memory")
    with pytest.raises(OutOfResources):
        fs._first_that_fits(configs, never)


def test_an_untuned_state_launch_takes_the_first_config_that_fits(monkeypatch):
    """The "first" pick (the benchmarks' accuracy sweeps) launches the configs in their own
    order, skipping those the GPU cannot hold, as "spread" does in its order; PART 1 follows
    at 16."""
    import dataclasses

    import triton
    from triton.runtime.errors import OutOfResources

    import gdn.fwd_state as fs
    launched = []

    class Kernel:
        def __getitem__(self, grid):
            def run(*args, PART, BV, **kw):
                if PART == 0 and BV > 32:
                    raise OutOfResources(312320, 232448, "shared memory")
                launched.append((PART, BV, grid))
            return run
    configs = [triton.Config({"BV": bv}, num_warps=4, num_stages=2) for bv in (64, 32, 16)]
    monkeypatch.setattr(fs, "_state_kernel", Kernel())
    monkeypatch.setattr(fs, "_state_configs", lambda config: configs)
    fs.launch_state((4,), 4, dataclasses.replace(DEFAULT, state_pick="first"), V=128, K=128)
    assert launched == [(0, 32, (4, 4)), (1, 16, (8, 4))]


def test_the_state_pass_never_launches_bv_32_at_an_odd_k_or_one_stage(monkeypatch):
    """ptxas 12.8 miscompiles the matrix part's BV 32 tiles at an odd K and at one stage (a
    wgmma descriptor from a register nothing wrote: the G03 fault, gdn.fwd_state._sound_configs):
    the autotuner's prune, the "spread" and "first" picks all drop them there, keep every
    config at an even K and 2 or more stages, and say so when nothing is left."""
    import dataclasses

    import triton

    import gdn.fwd_state as fs
    monkeypatch.setattr(fs, "INTERPRET", False)
    configs = [triton.Config({"BV": bv}, num_warps=w, num_stages=2) for bv in (32, 16, 64) for w in (4, 8)]
    for K in (33, 49, 65, 127):
        assert [c.kwargs["BV"] for c in fs._tuner().early_config_prune(configs, {}, K=K)] == [16, 16, 64, 64]
    for K in (16, 34, 128):
        assert fs._tuner().early_config_prune(configs, {}, K=K) == configs
    with pytest.raises(ValueError, match="K=33"):
        fs._sound_configs(configs[:2], 33)
    one_stage = [triton.Config({"BV": bv}, num_warps=4, num_stages=st) for bv in (32, 64) for st in (1, 2)]
    for K in (64, 128):
        assert [(c.kwargs["BV"], c.num_stages) for c in fs._sound_configs(one_stage, K)] == \
            [(32, 2), (64, 1), (64, 2)]
    launched = []

    class Kernel:
        def __getitem__(self, grid):
            def run(*args, PART, BV, **kw):
                launched.append((PART, BV))
            return run
    monkeypatch.setattr(fs, "_state_kernel", Kernel())
    monkeypatch.setattr(fs, "_state_configs", lambda config: configs[::2])   # BV 32, 16, 64 at 4 warps
    for pick in ("first", "spread"):
        for occ in range(1, 9):
            launched.clear()
            fs.launch_state((occ,), 4, dataclasses.replace(DEFAULT, state_pick=pick), V=128, K=33, BT=64,
                            GATE=1, DELTA=True, PREC="tf32", DT="bf16")
            assert launched[0][1] != 32 and launched[1] == (1, 16)


# SASS lines of the state pass's matrix part (sm_90, Triton 3.6, K 33, BV 32, 4 warps, 3 stages):
# ptxas builds a wgmma descriptor by adding to UR10, which nothing wrote (the G03 fault)
_MISCOMPILED_SASS = """
        /*1400*/                   UIADD3 UR9, UR16, 0x4000, URZ ;
        /*1440*/                   UIADD3 UR8, UR16, 0x2000, URZ ;
        /*1460*/                   UIADD3 UR10, UP0, UR10, 0x40, URZ ;
        /*1490*/                   USHF.R.U32.HI UR19, URZ, 0x4, UR9 ;
        /*1520*/                   UIADD3 UR26, UP0, UR10, 0x40, URZ ;
        /*5490*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR24].tnspA.tnspB, R24 ;
"""


def test_kernel_resources_finds_descriptors_built_from_unwritten_uniform_registers():
    """tools/kernel_resources.py's `unwritten_uniform` lists the UIADD3 that reads a uniform
    register nothing wrote before it (the ptxas 12.8 miscompile behind the G03 fault), and
    nothing once that register is written first (UR16 here stands for a write the snippet
    leaves out, so it is given one)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    given = "        /*0320*/                   UMOV UR16, 0x400 ;\n"
    fixed = _MISCOMPILED_SASS.replace("UIADD3 UR10, UP0, UR10", "UIADD3 UR10, UP0, UR19")
    fixed = fixed.replace("        /*1460*/", "        /*1498*/                   USHF.R.U32.HI UR19, URZ, 0x4, UR9 ;\n"
                          "        /*1460*/")
    code = ("import sys, json; sys.path.insert(0, 'tools'); import kernel_resources as kr; "
            "print(json.dumps([kr.unwritten_uniform(t) for t in json.loads(sys.stdin.read())]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps([given + _MISCOMPILED_SASS, given + fixed]),
                         env=env, cwd=root, capture_output=True, text=True, timeout=300)
    bad, good = json.loads(out.stdout.strip().splitlines()[-1])
    assert bad == ["1460: UIADD3 UR10, UP0, UR10, 0x40, URZ"], out.stderr[-2000:]
    assert good == []


@pytest.mark.parametrize("gate,delta", [("scalar", True), ("none", False)], ids=["scalar-delta", "none-linear"])
def test_output_kernel_at_128_wide_tiles_matches_oracle(gate, delta):
    """The output kernel's V tile (``out_whole``, as ``out_sliced`` for K slices, `gdn.config`):
    one 128-wide V tile at V 80 (48 columns masked), with a NaN sending one tile to the exact
    part, gives what the default two 64-wide tiles give."""
    import dataclasses

    import gdn.chunk_fwd as cf
    from gdn.config import DEFAULT, OutLaunch
    wide = dataclasses.replace(DEFAULT, out_whole=OutLaunch(bv=128, warps=4))   # K 16: one piece
    assert cf.out_launch(16, 80, 1, torch.float32, wide)["BV"] == 128
    x = make_inputs(gate, delta, B=1, T=70, H=2, K=16, V=80, seed=5)
    o, s = call(recurrence, x, delta=delta)
    o2, s2 = call(chunk_gdn_fwd, x, delta=delta, config=wide)
    assert rel(o2, o) < BOUND[torch.float32] and rel(s2, s) < BOUND[torch.float32]
    inject(x, "q", float("nan"))
    o, s = call(recurrence, x, delta=delta)
    o2, s2 = call(chunk_gdn_fwd, x, delta=delta, config=wide)
    assert_same_nonfinite(o2, o)
    assert_same_nonfinite(s2, s)


@pytest.mark.parametrize("gate,delta", [("scalar", True), ("none", False)], ids=["scalar-delta", "none-linear"])
def test_output_kernel_in_k_slices_matches_oracle(gate, delta):
    """The output kernel's matrix part in K slices (``out_sliced.bk``, `gdn.config`): K 48 in
    16-wide slices (the last 16 of BK 64 masked) gives the oracle's answer, and with a NaN in
    v (a chunk the state pass steps token by token, which the slices' part must leave to the
    exact part) and one in q, the oracle's NaN/Inf sets."""
    import gdn.chunk_fwd as cf
    x = make_inputs(gate, delta, B=1, T=70, H=2, K=48, V=24, seed=6, dtype=torch.bfloat16)
    assert cf.out_launch(64, 24, 1, torch.bfloat16, SLICED_16)["BKS"] == 16   # bf16 only: the swept dtype
    assert cf.out_launch(64, 24, 1, torch.float32, SLICED_16)["BKS"] == 64
    o, s = call(recurrence, x, delta=delta)
    o2, s2 = call(chunk_gdn_fwd, x, delta=delta, config=SLICED_16)
    assert rel(o2, o) < BOUND[torch.bfloat16] and rel(s2, s) < BOUND[torch.bfloat16]
    inject(x, "v", float("nan"))
    inject(x, "q", float("nan"))
    o, s = call(recurrence, x, delta=delta)
    o2, s2 = call(chunk_gdn_fwd, x, delta=delta, config=SLICED_16)
    assert_same_nonfinite(o2, o, BOUND[torch.bfloat16])
    assert_same_nonfinite(s2, s, BOUND[torch.bfloat16])


@pytest.mark.parametrize("gate,delta,nan_in", [("scalar", True, "v"), ("none", False, "k"),
                                               ("scalar", True, None)])
def test_xflag_reduced_after_the_k_slices_leaves_stepped_chunks_to_the_exact_part(gate, delta, nan_in):
    """The sliced matrix part of the output kernel reduces the state pass's xflag after its K
    loop: o and the final state follow the recurrence, NaNs where it has them, with K 48 in
    16-wide slices at bf16 and a NaN in v or k making the state pass step a chunk (its xflag
    set, so the slices' part must leave the chunk to the exact part).  Planted, the xflag never
    added after the loop, the NaN-in-v case fails."""
    x = make_inputs(gate, delta, B=1, T=140, H=2, K=48, V=24, seed=8, dtype=torch.bfloat16)
    if nan_in is not None:
        inject(x, nan_in, float("nan"))
    o, s = call(recurrence, x, delta=delta)
    o2, s2 = call(chunk_gdn_fwd, x, delta=delta, config=SLICED_16)
    assert_same_nonfinite(o2, o, BOUND[torch.bfloat16])
    assert_same_nonfinite(s2, s, BOUND[torch.bfloat16])


@pytest.mark.parametrize("gate,delta", [("scalar", True), ("vector", True), ("none", False)],
                         ids=["scalar-delta", "vector-delta", "none-linear"])
def test_entry_stores_before_the_checks_are_redone_where_a_chunk_fails(gate, delta):
    """The state pass's matrix part stores a chunk's entry state and a clear xflag before its
    checks, masked by the chunks before it (`gdn.fwd_state._enter_stores`); a chunk that fails
    has both stored again by the resume part.  A NaN in v mid-sequence (the resume part from
    that chunk on) and one head's initial state past SBIG (the first chunk fails at its
    entry) give the oracle's NaN/Inf sets and values; the clean case the oracle's values."""
    x = make_inputs(gate, delta, B=1, T=70, H=2, K=32, V=48, seed=9, dtype=torch.bfloat16)
    big = make_inputs(gate, delta, B=1, T=70, H=2, K=32, V=48, seed=9, dtype=torch.bfloat16)
    big["initial_state"][0, 1] *= 1e31
    nan = make_inputs(gate, delta, B=1, T=70, H=2, K=32, V=48, seed=9, dtype=torch.bfloat16)
    inject(nan, "v", float("nan"))
    for case in (x, nan, big):
        o2, s2 = call(chunk_gdn_fwd, case, delta=delta)
        o, s = call(recurrence, case, delta=delta)
        assert_same_nonfinite(o2, o, BOUND[torch.bfloat16])
        assert_same_nonfinite(s2, s, BOUND[torch.bfloat16])


def test_fp32_keys_over_128_take_the_sliced_output_launch():
    """fp32 inputs at K > 128 run the output kernel in K slices (gdn.chunk_fwd.out_launch): in
    one piece it needs more shared memory than a GPU has at K = V = 256 (262144 bytes, sm_90
    offline).  K 144 (BK 256, the last 112 columns masked) in 64-wide slices gives the
    oracle's answer, and with a NaN in v the oracle's NaN/Inf sets."""
    import gdn.chunk_fwd as cf
    assert cf.out_launch(256, 16, 1, torch.float32)["BKS"] == 64
    assert cf.out_launch(128, 16, 1, torch.float32)["BKS"] == 128   # fits whole
    x = make_inputs("scalar", True, B=1, T=40, H=2, K=144, V=16, seed=7)
    o, s = call(recurrence, x)
    o2, s2 = call(chunk_gdn_fwd, x)
    assert rel(o2, o) < BOUND[torch.float32] and rel(s2, s) < BOUND[torch.float32]
    inject(x, "v", float("nan"))
    o, s = call(recurrence, x)
    o2, s2 = call(chunk_gdn_fwd, x)
    assert_same_nonfinite(o2, o)
    assert_same_nonfinite(s2, s)



@triton.jit
def _saturate_both(x, y, z):
    r = tl.arange(0, 8)
    a = tl.load(x + r)
    tl.store(y + r, saturated(a, tl.bfloat16))
    tl.store(z + r, saturated(a, tl.float32))


def test_handoff_saturates_finite_states_beyond_bf16():
    """`gdn.common.saturated`, the step before a state is stored in a bf16 hand-off: finite
    fp32 values beyond bf16's largest become it (signed), so the GPU's round-to-nearest cannot
    make them inf (G06: an initial state at fp32's maximum gives NaN dq on the H200 without
    it; the interpreter truncates to bf16, so only this shows it on the CPU);
    inf, NaN and values in range pass as they are, and an fp32 hand-off keeps everything."""
    fmax, bmax = torch.finfo(torch.float32).max, torch.finfo(torch.bfloat16).max
    x = torch.tensor([fmax, -fmax, 3.39e38, bmax, 1.5, float("inf"), -float("inf"), float("nan")],
                     device=DEV)
    y, z = torch.empty_like(x), torch.empty_like(x)
    _saturate_both[(1,)](x, y, z)
    want = torch.tensor([bmax, -bmax, bmax, bmax, 1.5, float("inf"), -float("inf"), float("nan")],
                        device=DEV)
    assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y[:7], want[:7])
    assert torch.equal(z[:7], x[:7]) and z[7].isnan()


@triton.jit
def _tf32_product(a, b, c):
    r = tl.arange(0, 16)
    ix = r[:, None] * 16 + r[None, :]
    tl.store(c + ix, fdot(tl.load(a + ix), tl.load(b + ix), "tf32"))


def test_tf32_products_round_their_operands_to_nearest():
    """`gdn.common.fdot` at "tf32" (the forward's products for fp16 inputs, and bf16 ones
    narrower than 32): each operand is rounded to the nearest tf32 value, not truncated as a
    tensor core reads it (gdn_fwd_gla, fp16, T 13, K = V = 1: keys decayed by exp(-ln 2 j)
    came out just under 2^-j and the final state 40x over its bound on the H200).  A @ I:
    0.49999997 must read 0.5 (truncated: 0.49951172), -1.0009766 (a tf32 value) itself,
    -1.0004883 (half an ulp above 1) -1.0009766, NaN and inf themselves."""
    vals = torch.tensor([0.49999997, -1.0009766, -1.0004883, 3.0])
    a = torch.zeros(16, 16)
    a[0, :4] = vals
    a[1, 1], a[2, 2] = float("nan"), float("inf")    # alone in their rows: A @ I keeps them
    c = torch.empty(16, 16, device=DEV)
    _tf32_product[(1,)](a.to(DEV), torch.eye(16, device=DEV), c)
    got = c.cpu()
    assert torch.equal(got[0, :4], torch.tensor([0.5, -1.0009766, -1.0009766, 3.0])), got[0, :4]
    assert got[1, 1].isnan() and got[2, 2] == float("inf")


@pytest.mark.parametrize("gate,nan_in", [("scalar", None), ("none", None), ("scalar", "k")],
                         ids=["scalar", "none", "scalar-nan-k"])
def test_t_stored_in_bf16_is_the_fp32_t_rounded(gate, nan_in):
    """``prep_t_bf16`` (the default, `gdn.config`): for bf16 inputs T is stored in bf16,
    the inverse's scratch fp32 in the same bytes (the diagonal blocks only, A's blocks below
    them kept in registers), and w, u take one bf16 product a tile.  bf16 GDN inputs (T 70:
    a full chunk, then a short last one; K 48: masked key columns): T within a bf16 unit of
    the fp32 T of ``prep_t_bf16`` off (the interpreter rounds by truncation), o and the final
    state within bf16's bound of the oracle, and with a NaN in k the oracle's NaN/Inf sets;
    without a NaN, the backward on the forward's saved bf16 T gives the fp32 T's gradients to
    2e-2 (with the NaN in k every chunk of the backward steps token by token, reading no T,
    so the NaN case runs none).  Planted, the diagonal blocks' inverses stored one scratch
    column off, every case (then also two products a tile) fail."""
    from gdn.chunk_bwd import chunk_gdn_bwd
    assert DEFAULT.prep_t_bf16
    x = make_inputs(gate, True, B=1, T=70, H=2, K=48, V=24, seed=11, dtype=torch.bfloat16)
    if nan_in is not None:
        inject(x, nan_in, float("nan"))
    gen = torch.Generator().manual_seed(12)
    do = torch.randn(x["v"].shape, generator=gen).to(DEV, torch.bfloat16)
    runs = {}
    for m in (0, 1):
        config = dataclasses.replace(DEFAULT, prep_t_bf16=bool(m))
        o, s, saved = call(chunk_gdn_fwd, x, output_final_state=True, return_saved=True, config=config)
        grads = None if nan_in is not None else chunk_gdn_bwd(
            x["q"], x["k"], x["v"], x["g"], x["beta"], do, initial_state=x["initial_state"],
            saved=saved)
        runs[m] = (o, s, saved["inverse"], grads)
    t32, t16 = runs[0][2], runs[1][2]
    assert t32.dtype == torch.float32 and t16.dtype == torch.bfloat16
    fin = t32.isfinite()
    assert torch.equal(fin, t16.isfinite())
    assert ((t16.float() - t32).abs() <= 2 ** -7 * t32.abs())[fin].all()
    o, s = call(recurrence, x, delta=True)
    assert_same_nonfinite(runs[1][0], o, BOUND[torch.bfloat16])
    assert_same_nonfinite(runs[1][1], s, BOUND[torch.bfloat16])
    if nan_in is None:
        for a, b in zip(runs[1][3], runs[0][3]):
            if a is not None:
                assert rel(a, b) < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_stored_inverse_is_the_float64_inverse(dtype):
    """T, as the forward stores it (`return_inverse`), against (I + A)^-1 in float64 chunk by
    chunk, A = tril(beta k k^T Gamma_i / Gamma_j, -1) from the inputs as the kernel reads them.
    The keys share a direction (cosine about 0.9), so that A's entries are near beta and the
    block merges' far terms (F^2, F^3 of `gdn.fwd_prep.unit_lower_inverse`) are large: with
    random normalized keys those terms are below every output's tolerance.  bf16 (T stored in
    bf16, the merges on bf16 operands, ``prep_merge_bf16``): within 1e-2 normwise a
    chunk (3.1e-3 under the interpreter); fp32 (tf32x3 merges; "ieee" under the interpreter,
    1.4e-7): within 1e-4.  T 150: a short last chunk.  Planted, the merges' last Neumann step
    dropped for the bf16 operands: the bf16 case at 3.3e-2, failing."""
    B, T, H, K, V, BT = 1, 150, 2, 32, 16, 64
    gen = torch.Generator().manual_seed(21)
    base = torch.nn.functional.normalize(torch.randn(K, generator=gen), dim=0)
    k = torch.nn.functional.normalize(base + 0.25 * torch.randn(B, T, H, K, generator=gen), dim=-1)
    x = dict(q=torch.randn(B, T, H, K, generator=gen), k=k,
             v=torch.randn(B, T, H, V, generator=gen), g=-0.05 * torch.rand(B, T, H, generator=gen),
             beta=0.5 + 0.5 * torch.rand(B, T, H, generator=gen), initial_state=None)
    for name in ("q", "k", "v"):
        x[name] = x[name].to(dtype)
    x = {n: (t.to(DEV) if t is not None else None) for n, t in x.items()}
    _, _, tm = call(chunk_gdn_fwd, x, return_inverse=True)
    assert tm.dtype == (torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    kd, bd, gd = x["k"].double().cpu(), x["beta"].double().cpu(), x["g"].double().cpu()
    worst = 0.0
    for c0 in range(0, T, BT):
        n = min(BT, T - c0)
        for h in range(H):
            kc = kd[0, c0:c0 + n, h]
            G = gd[0, c0:c0 + n, h].cumsum(0)
            decay = torch.exp(G[:, None] - G[None, :])
            A = torch.tril(bd[0, c0:c0 + n, h, None] * (kc @ kc.T) * decay, -1)
            ref = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + A)
            worst = max(worst, rel(tm[0, c0:c0 + n, h, :n].cpu(), ref))
    assert worst < (1e-2 if dtype == torch.bfloat16 else 1e-4), worst


def test_a_campaign_fails_a_chunk_that_spreads_a_later_nan_to_earlier_tokens(tmp_path):
    """A NaN in v at token 5 of a 16-token chunk: the recurrence (and gdn.reference.chunked,
    the trusted implementation) reach tokens 5 on, a kernel whose causal mask meets v through
    a product reaches tokens 0-4 too.  The campaign fails it (nonfinite o) and passes the
    Triton kernel on the same case."""
    import harnesses.gdn_chunkleak  # noqa: F401  (registers gdn_fwd_linear.maskafter)
    from kfuzz.campaign import run_campaign
    from kfuzz.case import Case
    from kfuzz.corpus import Corpus
    from kfuzz.target import get_target

    class Cases:
        name = "list"

        def __init__(self, case):
            self.case = case

        def next_case(self):
            return self.case

        def feedback(self, case, verdict):
            return None

    def campaign(name):
        case = Case.from_json({"kfuzz": 1, "target": name, "dtype": "float32", "seed": 7, "payload": None,
                               "dims": {"B": 1, "T": 20, "H": 1, "K": 4, "V": 4},
                               "args": {"v": {"inject": [[5 * 4 + 1, "nan"]]}}})
        return run_campaign(get_target(name), Cases(case), Corpus(tmp_path / name), runs=1, jobs=0,
                            device=DEV)

    bad = campaign("gdn_fwd_linear.maskafter")
    assert [(s.kind, s.output) for s in bad.failures] == [("nonfinite", "o")]
    assert campaign("gdn_fwd_linear").failures == {}


@pytest.mark.parametrize("name", ["v", "k", "beta", "g", "q"])
def test_reference_spreads_a_nan_exactly_as_the_recurrence_does(name):
    """One NaN at token 70 (the seventh of the second 64-token chunk): the chunked reference's
    outputs have the NaN/Inf sets of the float64 recurrence's, so the first NaN of o is at
    token 70, not at the chunk's start; and where the NaN reaches the gradients through the
    delta rule's triangles (k, beta, q), autograd through it gives the recurrence's sets too."""
    x = make_inputs("scalar", True, B=1, T=128, H=1, K=16, V=16, seed=5)
    x[name] = x[name].clone()
    x[name][0, 70].view(-1)[0] = float("nan")
    leaves = {n: t for n, t in x.items() if t is not None}
    outs = {}
    for label, fn, dt in (("oracle", recurrence, torch.float64), ("reference", chunked, torch.float32)):
        ins = {n: t.detach().to(dt).requires_grad_() for n, t in leaves.items()}
        o, ht = call(fn, ins)
        gen = torch.Generator().manual_seed(1)
        loss = (o * torch.randn(o.shape, generator=gen, dtype=dt).to(o.device)).sum() + (ht * 0.5).sum()
        grads = torch.autograd.grad(loss, [ins[n] for n in ("q", "k", "v", "g", "beta", "initial_state")])
        outs[label] = (o, ht, *grads)
    for i, (a, b) in enumerate(zip(outs["reference"], outs["oracle"])):
        if i >= 2 and name not in ("k", "beta", "q"):
            break
        assert torch.equal(torch.isnan(a), torch.isnan(b)), f"output {i}: NaN sets differ"
        assert torch.equal(torch.isinf(a), torch.isinf(b)), f"output {i}: Inf sets differ"
    assert torch.isnan(outs["reference"][0][0, :70]).sum() == 0


@pytest.mark.parametrize("gate", ["scalar", "vector"])
def test_a_beta_that_expands_each_step_sends_its_chunk_to_the_exact_path(gate):
    """beta at -65504 (fp16's largest, out of the domain, as an injection may put it) with unit
    keys: each step's transition I - beta k k^T expands by 6.5e4, so the chunk's WY inverse
    overflows fp32 and the matrix path mixes its NaN into every output of the chunk, the
    first token's too, where the oracle's o is finite (gdn_fwd_kda on the CPU: o NaN at t 0,
    oracle -542.5). Such a chunk steps token by token: o finite as long as the oracle's is."""
    x = make_inputs(gate, True, B=1, T=16, H=1, K=4, V=2, seed=11)      # one chunk of either member
    x["beta"] = torch.full_like(x["beta"], -65504.0)
    o, _ = call(recurrence, x)
    o2, _ = call(chunk_gdn_fwd, x)
    inside = o.abs() < torch.finfo(torch.float32).max
    assert inside[:, :3].all() and not inside.all()
    assert o2[inside].isfinite().all()
    assert torch.allclose(o2.double()[inside], o[inside], rtol=1e-4, atol=0)
    assert_same_nonfinite(o2, o)


def two_chunk_inputs(gate, k, beta, v):
    """bf16 inputs of one chunk and a token (K 2, V 1, q ones, gates 0, no h0), per token: k
    (pairs), beta and v (fp32 beta: 1 + 2^-14 is not a bf16 value)."""
    C = 16 if gate == "vector" else 64
    x = make_inputs(gate, True, B=1, T=C + 1, H=1, K=2, V=1, dtype=torch.bfloat16, seed=1, h0=False)
    x["q"] = torch.ones_like(x["q"])
    x["k"] = torch.tensor(k, dtype=torch.bfloat16, device=DEV).view(1, C + 1, 1, 2)
    x["v"] = torch.tensor(v, dtype=torch.bfloat16, device=DEV).view(1, C + 1, 1, 1)
    x["beta"] = torch.tensor(beta, device=DEV).view(1, C + 1, 1)
    if x["g"] is not None:
        x["g"] = torch.zeros_like(x["g"])
    return x


@pytest.mark.parametrize("gate", ["none", "scalar", "vector"])
def test_a_stepped_chunk_takes_its_output_from_the_state_the_state_pass_holds(gate):
    """bf16, K 2, V 1, one chunk boundary: the first chunk, stepped (v past BIG at a token with
    beta 0), leaves the state (1 + 2^-14, -1) (beta 1 + 2^-14 on key e_0 and v 1, then v -1 on
    e_1); in bf16, to nearest or truncated, it is (1, -1).  At the next chunk's first token
    beta is +inf, the keys (1/2, 1/2) and v -1: k · S is 2^-15, and the step gives -inf in both
    keys and o -inf; from the state in bf16, k · S is 0 and inf · 0 gives NaN.  The state pass
    steps that chunk from the state it holds and writes its o, so o and the final state have
    the oracle's NaN/Inf sets."""
    C = 16 if gate == "vector" else 64
    e0, e1, half = ([a, b] for a, b in ((1, 0), (0, 1), (0.5, 0.5)))
    x = two_chunk_inputs(gate, [e0, e1] + [e0] * (C - 2) + [half],
                         [1 + 2 ** -14, 1.0] + [0.0] * (C - 2) + [float("inf")],
                         [1.0, -1.0, 1e5] + [0.0] * (C - 3) + [-1.0])
    o, s = call(recurrence, x)
    assert o[0, C, 0, 0] == float("-inf")
    last = {n: (x[n][:, C:] if x[n] is not None else None) for n in ("q", "k", "v", "g", "beta")}
    _, S = recurrence(*(x[n][:, :C] if x[n] is not None else None for n in ("q", "k", "v", "g", "beta")))
    truncated = (S.float().view(torch.int32) & -65536).view(torch.float32)
    for rounded in (S.bfloat16().float(), truncated):
        o_r, _ = recurrence(last["q"], last["k"], last["v"], last["g"], last["beta"],
                            initial_state=rounded.double())
        assert o_r.isnan().all()
    o2, s2 = call(chunk_gdn_fwd, x)
    assert_same_nonfinite(o2, o, BOUND[torch.bfloat16])
    assert_same_nonfinite(s2, s, BOUND[torch.bfloat16])


@pytest.mark.parametrize("gate", ["none", "scalar", "vector"])
def test_an_infinite_q_after_a_stepped_chunk_meets_the_state_the_state_pass_holds(gate):
    """bf16, K 2, V 1: the first chunk, stepped as in
    `test_a_stepped_chunk_takes_its_output_from_the_state_the_state_pass_holds`, leaves the state
    (1 + 2^-14, -1), (1, -1) in bf16.  At the next chunk's first token q is (+inf, 0) and the
    step (key e_0, beta 1/2, v -1) leaves 2^-15 at key 0, so o is +inf; from the state in bf16
    it leaves 0, and inf · 0 gives NaN.  The chunk's k, v and beta admit the matrix path, q
    does not: the state pass's resume part steps it from the state it holds and writes its o."""
    C = 16 if gate == "vector" else 64
    e0, e1, zero = [1, 0], [0, 1], [0, 0]
    x = two_chunk_inputs(gate, [e0, e1] + [zero] * (C - 2) + [e0],
                         [1 + 2 ** -14, 1.0] + [0.0] * (C - 2) + [0.5],
                         [1.0, -1.0, 1e5] + [0.0] * (C - 3) + [-1.0])
    x["q"][0, C, 0] = torch.tensor([float("inf"), 0.0])
    o, s = call(recurrence, x)
    assert o[0, C, 0, 0] == float("inf")
    o2, s2, saved = call(chunk_gdn_fwd, x, return_saved=True)
    assert saved["stepped"][:, 0, 0].tolist() == [1, 1]
    assert_same_nonfinite(o2, o, BOUND[torch.bfloat16])
    assert_same_nonfinite(s2, s, BOUND[torch.bfloat16])

@pytest.mark.parametrize("gate,delta", [("scalar", True), ("vector", False)],
                         ids=["scalar-delta", "vector-linear"])
def test_an_output_tile_with_stepped_and_matrix_columns_matches_the_oracle(gate, delta):
    """A NaN in one head's initial state at column 5 of V 48: the state pass steps that
    head's columns 0-15 (a resume tile) in every chunk and takes columns 16-47 by the matrix
    path, and the output kernel's 64-wide tile goes to its token-by-token part, which takes
    only the columns the state pass did not step.  o and the final state are the oracle's,
    NaN in column 5 alone."""
    x = make_inputs(gate, delta, B=1, T=70, H=2, K=16, V=48, seed=4)
    inject(x, "initial_state", float("nan"))
    o, s = call(recurrence, x, delta=delta)
    o2, s2, saved = call(chunk_gdn_fwd, x, delta=delta, return_saved=True)
    stepped = saved["stepped"][:, 1].bool()
    assert stepped[:, :16].all() and not stepped[:, 16:].any() and not saved["stepped"][:, 0].any()
    assert o[0, :, 1, 5].isnan().all() and o[0, :, 1, 16:].isfinite().all()
    assert_same_nonfinite(o2, o)
    assert_same_nonfinite(s2, s)


@pytest.mark.parametrize("gate", ["none", "scalar", "vector"])
def test_a_stepped_chunk_keeps_its_state_in_float64_from_step_to_step(gate):
    """fp32, K 2, V 1, three tokens: beta 1 + 2^-20 and v 1 + 2^-20 on key e_0 leave
    S_0 = 1 + 2^-19 + 2^-40, which fp32 rounds to 1 + 2^-19; v -(1 + 2^-19) on e_1; then beta
    +inf (the chunk steps), keys (1/2, 1/2) and v -1: k · S is 2^-41 and the step gives -inf
    in both keys, o -inf; from the state rounded to fp32 after each step k · S is 0 and
    inf · 0 gives NaN.  The state pass steps the chunk with its state in float64 from step to
    step, as the oracle does, so o and the final state have the oracle's NaN/Inf sets."""
    x = make_inputs(gate, True, B=1, T=3, H=1, K=2, V=1, seed=1, h0=False)
    x["q"] = torch.ones_like(x["q"])
    x["k"] = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]], device=DEV).view(1, 3, 1, 2)
    x["v"] = torch.tensor([1 + 2 ** -20, -(1 + 2 ** -19), -1.0], device=DEV).view(1, 3, 1, 1)
    x["beta"] = torch.tensor([1 + 2 ** -20, 1.0, float("inf")], device=DEV).view(1, 3, 1)
    if x["g"] is not None:
        x["g"] = torch.zeros_like(x["g"])
    o, s = call(recurrence, x)
    assert o[0, 2, 0, 0] == float("-inf") and (s == float("-inf")).all()
    o2, s2 = call(chunk_gdn_fwd, x)
    assert_same_nonfinite(o2, o)
    assert_same_nonfinite(s2, s)


@pytest.mark.parametrize("delta", [True, False], ids=["delta", "linear"])
def test_a_vector_gate_with_a_q_below_the_factorable_range_matches_the_oracle(delta):
    """fp32, vector gate, gates -3 a token (a chunk's decay e^-45, inside the factored form's
    bound), q ~ 1e-30: (Gamma_t q_t) would lie far below fp32's normals (0 from token 12 on),
    so o from the factored products loses all its digits.  A chunk with a nonzero |q| below
    VECTOR_Q_MIN takes the exact path, and o is the oracle's to fp32 precision."""
    x = make_inputs("vector", delta, B=1, T=16, H=1, K=4, V=4, seed=3)
    x["q"] = x["q"] * 1e-30
    x["g"] = torch.full_like(x["g"], -3.0)
    o, s = call(recurrence, x, delta=delta)
    o2, s2 = call(chunk_gdn_fwd, x, delta=delta)
    assert rel(o2, o) < 1e-5
    assert rel(s2, s) < 1e-5


def test_a_state_below_fp32s_range_at_a_boundary_meets_an_infinite_q():
    """fp32, vector gate, K 2, V 1, no delta rule: token 0 writes 1 at key 0, the first
    chunk's last token decays key 0 by exp(-200) (past the factored form's bound, so the chunk
    steps), leaving ~1.4e-87 there, below fp32's range; the next token's q is (+inf, 0), so o
    is +inf.  Rounded to 0 at the boundary it would give inf * 0 = NaN; the state pass hands it on as
    fp32's smallest subnormal with its sign, and o has the oracle's NaN and Inf sets."""
    C = 16
    x = make_inputs("vector", False, B=1, T=C + 1, H=1, K=2, V=1, seed=1, h0=False)
    x["k"] = torch.zeros_like(x["k"])
    x["k"][0, 0, 0, 0] = 1.0
    x["k"][0, 1:, 0, 1] = 1.0
    x["v"] = torch.ones_like(x["v"])
    x["g"] = torch.zeros_like(x["g"])
    x["g"][0, C - 1, 0, 0] = -200.0
    x["q"] = torch.zeros_like(x["q"])
    x["q"][0, :C, 0, 1] = 1.0
    x["q"][0, C, 0] = torch.tensor([float("inf"), 0.0])
    o, s = call(recurrence, x, delta=False)
    assert o[0, C, 0, 0] == float("inf")
    o2, s2 = call(chunk_gdn_fwd, x, delta=False)
    assert_same_nonfinite(o2, o)
    assert_same_nonfinite(s2, s)


@pytest.mark.parametrize("gate", ["none", "scalar", "vector"])
def test_a_first_chunk_that_q_sends_off_the_matrix_path_starts_from_h0_as_given(gate):
    """bf16 inputs, fp32 h0 (1 + 2^-10, 1) at keys 0 and 1 (bf16 holds 1 + 2^-10 as 1), one token
    with k 0, q (1e38, -1e38): o is scale 1e38 2^-10 ~ 6.9e34, where from h0 rounded to bf16
    it is 0.  q past BIG sends the chunk off the matrix path; its o comes from h0 as given."""
    x = make_inputs(gate, False, B=1, T=1, H=1, K=2, V=1, dtype=torch.bfloat16, seed=2)
    x["k"] = torch.zeros_like(x["k"])
    x["q"] = torch.tensor([1e38, -1e38], dtype=torch.bfloat16, device=DEV).view(1, 1, 1, 2)
    x["initial_state"] = torch.tensor([1 + 2 ** -10, 1.0], device=DEV).view(1, 1, 2, 1)
    if x["g"] is not None:
        x["g"] = torch.zeros_like(x["g"])
    o, s = call(recurrence, x, delta=False)
    assert abs(o.item()) > 1e34
    o2, s2 = call(chunk_gdn_fwd, x, delta=False)
    assert rel(o2, o) < BOUND[torch.bfloat16]
    assert rel(s2, s) < 1e-6


@pytest.mark.parametrize("gate", ["none", "scalar", "vector"])
@pytest.mark.parametrize("name,kept", [("q", "out_stepped"), ("k", "stepped"), ("v", "stepped"),
                                       ("beta", "stepped")])
def test_an_input_below_the_products_range_sends_its_chunk_to_the_exact_path(gate, name, kept):
    """fp32, three chunks: one value of q, k, v or beta at 1e-39 (a subnormal) in the second
    chunk. The tensor-core products flush operands below fp32's normals (their lower tf32 part
    below 2^-104: `gdn.common.PRODUCT_MIN`; on the H200 q ~1e-39 against v ~1e4 put o 5.5e-3
    off), so that chunk, and only it, is stepped: by the state pass (k, v, beta) or by the
    output kernel (q); o and the final state are the oracle's."""
    C = 16 if gate == "vector" else 64
    x = make_inputs(gate, True, B=1, T=2 * C + 5, H=1, K=4, V=8, seed=3)
    x[name] = x[name].clone()
    x[name][0, C + 3, 0] = 1e-39
    x["v"] = x["v"] * 1e4
    o, s = call(recurrence, x)
    o2, s2, saved = call(chunk_gdn_fwd, x, output_final_state=True, return_saved=True)
    per_chunk = saved[kept].bool().any(dim=(0, 2) if kept == "out_stepped" else (1, 2))
    assert per_chunk.tolist() == [False, True, False], per_chunk
    assert rel(o2, o) < 1e-6 and rel(s2, s) < 1e-6, (rel(o2, o), rel(s2, s))
