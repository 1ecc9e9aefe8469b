"""The bound and the nonfinite check, on tensors built by hand."""
import math

import pytest
import torch

from kfuzz.compare import compare


def oracle_and_trusted(n=100_000, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(n, generator=g, dtype=torch.float64)
    return o, o.to(dtype)


def test_honest_rounding_passes():
    o, t = oracle_and_trusted()
    assert compare(t.clone(), o, t, "bfloat16").kind is None


def test_one_wrong_element_in_a_large_tensor_fails():
    o, t = oracle_and_trusted()
    k = t.clone()
    k[54321] += 0.5
    f = compare(k, o, t, "bfloat16")
    assert f.kind == "bound" and "element 54321" in f.detail


@pytest.mark.parametrize("wrong", [0.0, 0.5, 1e-3])
def test_a_nan_every_side_shares_changes_no_judgment_of_the_other_positions(wrong):
    """An output without NaN or Inf is judged in one pass over every position; the same
    output with a NaN at one more position (kernel, oracle and trusted alike) takes the masked
    path: both give the same finding, element and numbers."""
    o, t = oracle_and_trusted(n=10_000, dtype=torch.float32)
    k = t.clone()
    k[1234] += wrong
    plain = compare(k, o, t, "float32")
    nan = torch.tensor([math.nan])
    masked = compare(torch.cat([k, nan.float()]), torch.cat([o, nan]), torch.cat([t, nan.float()]),
                     "float32")
    assert plain.kind == masked.kind and plain.detail == masked.detail
    assert plain.ratio == pytest.approx(masked.ratio, rel=1e-12)
    assert [name for name, _ in plain.metrics] == [name for name, _ in masked.metrics]
    for (_, a), (_, b) in zip(plain.metrics, masked.metrics):
        assert a == pytest.approx(b, rel=1e-12)
    assert (plain.kind is None) == (wrong == 0.0)


def test_low_precision_running_total_stands_out():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(64, 4096, generator=g, dtype=torch.float64)
    o = x.sum(-1)
    trusted = x.float().sum(-1)                      # fp32 total
    k = torch.zeros(64, dtype=torch.float16)          # fp16 running total
    for j in range(0, 4096, 64):
        k = k + x[:, j:j + 64].float().sum(-1).half()
    assert compare(trusted, o, trusted, "float32").kind is None
    assert compare(k.float(), o, trusted, "float32").kind == "bound"


def test_nan_sets_must_match_exactly():
    o = torch.tensor([1.0, math.nan, 3.0], dtype=torch.float64)
    good = torch.tensor([1.0, math.nan, 3.0])
    assert compare(good, o, good, "float32").kind is None
    f = compare(torch.tensor([1.0, 0.0, 3.0]), o, good, "float32")
    assert f.kind == "nonfinite" and "NaN set differs" in f.detail
    f = compare(torch.tensor([1.0, math.nan, math.nan]), o, good, "float32")
    assert f.kind == "nonfinite"


def test_the_nonfinite_check_alone_judges_no_values():
    o = torch.tensor([1.0, math.nan, math.inf, -math.inf, 5.0], dtype=torch.float64)
    off = torch.tensor([7.0, math.nan, math.inf, -math.inf, 5.0])          # 1.0 off by 6: a bound failure
    assert compare(off, o, None, "float32").kind == "bound"
    assert compare(off, o, None, "float32", values=False).kind is None
    for wrong in ([1.0, 0.0, math.inf, -math.inf, 5.0], [1.0, math.nan, -math.inf, -math.inf, 5.0],
                  [1.0, math.nan, math.inf, math.inf, 5.0], [1.0, math.nan, math.inf, -math.inf, math.nan]):
        f = compare(torch.tensor(wrong), o, None, "float32", values=False)
        assert f.kind == "nonfinite", wrong
    finite = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert compare(torch.tensor([1.0, math.inf]), finite, None, "float32", values=False).kind == "nonfinite"
    assert compare(torch.tensor([9.0, 2.0]), finite, None, "float32", values=False).kind is None


def test_same_classes_agrees_with_the_classes_position_by_position():
    """``same_classes`` (worked out only where a value is not finite) says what comparing
    ``_class`` everywhere says, across dtypes, for every kind of difference one position can make."""
    from kfuzz.compare import _class, same_classes
    g = torch.Generator().manual_seed(3)
    values = torch.tensor([0.0, -2.5, math.nan, math.inf, -math.inf], dtype=torch.float64)
    for trial in range(300):
        a = values[torch.randint(0, 5, (40,), generator=g)]
        b = a.clone()
        if trial % 3:      # one position changed to another value (often of another class)
            i = int(torch.randint(0, 40, (1,), generator=g))
            b[i] = values[int(torch.randint(0, 5, (1,), generator=g))]
        for x, y in ((a, b), (a.float(), b), (a, b.half()), (a.float(), b.bfloat16())):
            assert same_classes(x, y) == bool((_class(x) == _class(y)).all()), (x, y)
    assert same_classes(torch.zeros(0), torch.zeros(0, dtype=torch.float64))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_outputs_are_judged(dtype):
    """A float8 output is compared like any other (torch has no reductions for float8 and no
    promotion of it to float64): its own rounding passes, a lost NaN is nonfinite, a wrong value
    fails the bound, on the nonfinite check alone too."""
    dt = getattr(torch, dtype)
    o = torch.tensor([1.0, 2.0, 3.0, math.nan], dtype=torch.float64)
    honest = o.to(dt)
    assert compare(honest, o, honest, dtype).kind is None
    assert compare(honest, o, None, dtype, values=False).kind is None
    assert compare(torch.tensor([1.0, 2.0, 3.0, 0.0]).to(dt), o, honest, dtype).kind == "nonfinite"
    assert compare(torch.tensor([1.0, 2.0, 3.0, 0.0]).to(dt), o, None, dtype, values=False).kind == "nonfinite"
    f = compare(torch.tensor([1.0, 2.0, 32.0, math.nan]).to(dt), o, honest, dtype)
    assert f.kind == "bound" and "element 2: kernel 32" in f.detail, f.detail


def test_inf_sign_matters_and_overflow_threshold_is_ambiguous():
    o = torch.tensor([math.inf, 65500.0], dtype=torch.float64)
    assert compare(torch.tensor([-math.inf, 65504.0], dtype=torch.float16), o, None, "float16").kind == "nonfinite"
    # 65500 rounds to 65504 in fp16, but an honest kernel may land on inf at the edge
    assert compare(torch.tensor([math.inf, math.inf], dtype=torch.float16), o, None, "float16").kind is None


def test_oracle_overflowing_the_output_dtype_means_inf():
    o = torch.tensor([1e6], dtype=torch.float64)   # beyond fp16's max
    assert compare(torch.tensor([math.inf], dtype=torch.float16), o, None, "float16").kind is None
    assert compare(torch.tensor([65504.0], dtype=torch.float16), o, None, "float16").kind == "nonfinite"


def test_overflow_is_excused_only_where_the_trusted_implementation_overflows_too():
    o = torch.tensor([3.0e38, 1.0], dtype=torch.float64)          # finite in fp32
    k = torch.tensor([math.inf, 1.0])
    honest_overflow = torch.tensor([math.inf, 1.0])
    assert compare(k, o, honest_overflow, "float32").kind is None
    assert compare(k, o, torch.tensor([3.0e38, 1.0]), "float32").kind == "nonfinite"


def test_an_intermediate_overflow_may_turn_inf_into_nan_only_where_the_trusted_one_does():
    o = torch.tensor([math.inf, math.inf], dtype=torch.float64)
    k = torch.tensor([math.nan, math.nan])
    assert compare(k, o, torch.tensor([math.nan, math.inf]), "float32").kind == "nonfinite"
    assert compare(k, o, torch.tensor([math.nan, math.nan]), "float32").kind is None


def test_a_nan_the_inputs_carry_excuses_no_kernel_where_the_trusted_one_spread_it():
    """The trusted implementation's NaN where the oracle is finite excuses an overflow (its
    NaN made of Infs: inputs without NaN or Inf), not a NaN spread from one the inputs carry
    (it is finite there on the inputs without their NaN)."""
    o = torch.tensor([1.0, 2.0, math.nan], dtype=torch.float64)
    spread = torch.tensor([math.nan, 2.0, math.nan])      # the trusted one: NaN at 0 as well
    clean = torch.tensor([1.0, 2.0, 0.0])                 # ... but not without the input's NaN
    leaky = torch.tensor([math.nan, 2.0, math.nan])       # a kernel with the same leak
    f = compare(leaky, o, spread, "float32", trusted_clean=clean)
    assert f.kind == "nonfinite" and "NaN set differs" in f.detail
    assert compare(torch.tensor([1.0, 2.0, math.nan]), o, spread, "float32", trusted_clean=clean).kind is None
    o = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    overflow = torch.tensor([math.nan, 2.0, 3.0])         # inf - inf, the inputs hold no NaN or Inf
    assert compare(torch.tensor([math.nan, 2.0, 3.0]), o, overflow, "float32").kind is None


def test_near_the_dtypes_max_a_finite_value_is_judged_by_the_bound():
    """Within the bound's floor of fp16's max (6.25% at C 32) an honest kernel's error may leave
    it finite where the oracle rounds to Inf: the bound judges it; an Inf must have the oracle's sign."""
    o = torch.tensor([67556.8, 1.0], dtype=torch.float64)        # rounds to inf in fp16

    def kind(v, c=32.0):
        return compare(torch.tensor([v, 1.0], dtype=torch.float16), o, None, "float16", c).kind
    assert kind(63424.0) is None
    assert kind(math.inf) is None
    assert kind(-math.inf) == "nonfinite"
    assert kind(math.nan) == "nonfinite"
    assert kind(30000.0) == "bound"
    assert kind(63424.0, c=8.0) == "nonfinite"        # 3.1% past the max is outside C 8's floor
    near = torch.tensor([65000.0], dtype=torch.float64)
    assert compare(torch.tensor([-math.inf], dtype=torch.float16), near, None, "float16").kind == "nonfinite"


def test_past_the_range_where_the_trusted_one_overflows_any_nonfinite_value_passes():
    """The oracle finite in float64 past fp32's max, the trusted implementation overflowing there
    on clean inputs: an honest chunked kernel may make NaN of the Infs; a finite value fails."""
    o = torch.tensor([1e39, 1.0], dtype=torch.float64)
    trusted = torch.tensor([math.inf, 1.0])
    for v in (math.nan, math.inf, -math.inf):
        assert compare(torch.tensor([v, 1.0]), o, trusted, "float32").kind is None
    assert compare(torch.tensor([3e38, 1.0]), o, trusted, "float32").kind == "nonfinite"
    # without the trusted one overflowing, the oracle's Inf is the answer
    assert compare(torch.tensor([math.nan, 1.0]), o, torch.tensor([3e38, 1.0]), "float32").kind == "nonfinite"
    # a NaN the trusted one spread from an input's NaN (finite without it) excuses nothing
    spread = torch.tensor([math.nan, 1.0])
    assert compare(torch.tensor([math.nan, 1.0]), o, spread, "float32",
                   trusted_clean=torch.tensor([3e38, 1.0])).kind == "nonfinite"
    assert compare(torch.tensor([math.nan, 1.0]), o, spread, "float32",
                   trusted_clean=torch.tensor([math.inf, 1.0])).kind is None


def test_an_inf_passes_where_the_bound_reaches_past_the_dtypes_largest():
    """fp16, oracle -57483.46 and the trusted implementation 459 from it (gdn_fwd_kda on an
    H100: q x 1e4 against v near fp16's largest, tf32 products): the bound admits any value
    within 8 x 4 x 459 = 14,690 of the oracle, past -65504, where a kernel's value rounds to
    -inf in fp16. That -inf passes; +inf there, or -inf where the oracle is -20000, fails."""
    o = torch.tensor([-57483.46, 1.0], dtype=torch.float64)
    t = torch.tensor([-57024.0, 1.0], dtype=torch.float16)
    k = torch.tensor([-math.inf, 1.0], dtype=torch.float16)
    assert compare(k, o, t, "float16", 32.0).kind is None
    assert compare(-k, o, t, "float16", 32.0).kind == "nonfinite"
    far = torch.tensor([-20000.0, 1.0], dtype=torch.float64)
    assert compare(k, far, far.half() + torch.tensor([459.0, 0.0]).half(), "float16", 32.0).kind == "nonfinite"


@pytest.mark.parametrize("masked, trusted_special, off", [(False, False, False), (True, True, True),
                                                          (False, True, False), (True, False, True)])
def test_the_bound_taken_a_chunk_at_a_time_is_the_bound_over_the_whole_output(monkeypatch, masked,
                                                                              trusted_special, off):
    """An output larger than the bound's chunk: the same finding, detail and ratio as in one
    chunk, and its metrics up to the order of the norms' sums."""
    import kfuzz.compare
    g = torch.Generator().manual_seed(1)
    o = torch.randn(5000, generator=g, dtype=torch.float64)
    k = (o + torch.randn(5000, generator=g, dtype=torch.float64) * 1e-7).float()
    t = (o + torch.randn(5000, generator=g, dtype=torch.float64) * 1e-7).float()
    if off:
        k[3001] += 0.5
    if trusted_special:
        t[7], t[4998] = float("nan"), float("inf")
    if masked:       # a non-finite position: the bound judges the others
        k[5], o[5] = float("inf"), float("inf")
    whole = compare(k, o, t, "float32")
    monkeypatch.setattr(kfuzz.compare, "BOUND_CHUNK", {"cpu": 1000})
    chunked = compare(k, o, t, "float32")
    assert (chunked.kind, chunked.detail) == (whole.kind, whole.detail)
    assert chunked.ratio == pytest.approx(whole.ratio, rel=1e-12)
    assert [m for m, _ in chunked.metrics] == [m for m, _ in whole.metrics]
    assert [v for _, v in chunked.metrics] == pytest.approx([v for _, v in whole.metrics], rel=1e-12)
    assert (whole.kind == "bound") == off


def test_the_largest_difference_is_taken_a_chunk_at_a_time_in_float64(monkeypatch):
    """``compare.largest`` hands ``difference`` float64 chunks of ``BOUND_CHUNK`` elements, never
    a whole output, and folds their maxima: the largest difference wherever it is, a NaN that the
    difference gives in any chunk; G08's difference (NaN at the same place in both: none; in one
    only: infinite) gives the same through it."""
    import kfuzz.compare
    from kfuzz.compare import largest
    from kfuzz.gates.calls import _largest_difference
    monkeypatch.setattr(kfuzz.compare, "BOUND_CHUNK", {"cpu": 7})
    seen = []

    def difference(x, y):
        seen.append((x.numel(), x.dtype, y.dtype))
        return (x - y).abs()
    a = torch.arange(40, dtype=torch.float32).reshape(5, 8)
    b = a.clone()
    b[4, 6] += 3.0                      # in the last chunk but one
    assert largest(a.t(), b.t(), difference) == 3.0
    assert len(seen) == 6 and all(n <= 7 and dx == dy == torch.float64 for n, dx, dy in seen), seen
    assert largest(a[:0], b[:0], difference) == 0.0
    b[1, 1] = float("nan")
    assert math.isnan(largest(a, b, difference))
    assert _largest_difference(a, b) == math.inf            # NaN in one only
    a[1, 1] = float("nan")
    assert _largest_difference(a, b) == 3.0                  # NaN in both: no difference there
