"""The nonfinite rule's latitude where the trusted implementation is non-finite: an overflow
(non-finite on the inputs without their NaN and Inf too) excuses any value; a NaN the inputs
carry, spread by the trusted implementation, excuses none; two honest algorithms' other kinds of
non-finite value admit any non-finite value, never a finite one."""
import math

import pytest
import torch

from kfuzz.case import ArgCase, Case
from kfuzz.compare import compare
from kfuzz.execute import judge, without_specials
from kfuzz.target import Arg, Dim, Output, Target

NAN, INF = math.nan, math.inf


def t32(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def never():
    raise AssertionError("the clean run was not needed here")


def test_an_overflow_nan_is_excused_in_an_output_where_the_oracle_has_nans_too():
    o = torch.tensor([1e39, 2.0, NAN], dtype=torch.float64)   # 1e39: past fp32, finite in float64
    trusted, clean = t32(NAN, 2.0, NAN), t32(NAN, 2.0, 0.0)     # inf - inf at 0, with or without the NaN
    for kernel in (t32(NAN, 2.0, NAN), t32(-INF, 2.0, NAN), t32(3e38, 2.0, NAN)):
        assert compare(kernel, o, trusted, "float32", trusted_clean=clean).kind is None
    # a wrong value where the trusted implementation is finite still fails
    assert compare(t32(NAN, 2.5, NAN), o, trusted, "float32", trusted_clean=clean).kind == "bound"


def test_a_nan_the_trusted_implementation_spread_from_an_input_excuses_no_kernel():
    o = torch.tensor([1.0, 2.0, NAN], dtype=torch.float64)
    spread, clean = t32(NAN, 2.0, NAN), t32(1.0, 2.0, 0.0)     # finite at 0 without the input's NaN
    f = compare(t32(NAN, 2.0, NAN), o, spread, "float32", trusted_clean=clean)
    assert f.kind == "nonfinite" and "NaN set differs" in f.detail
    assert compare(t32(1.0, 2.0, NAN), o, spread, "float32", trusted_clean=lambda: clean).kind is None


def test_the_kind_of_a_non_finite_value_is_free_only_where_two_honest_algorithms_differ():
    o = torch.tensor([NAN, INF, -INF], dtype=torch.float64)
    trusted, clean = t32(INF, NAN, -INF), t32(1.0, 1.0, 1.0)   # inf arithmetic, no overflow
    assert compare(t32(-INF, NAN, -INF), o, trusted, "float32", trusted_clean=clean).kind is None
    for kernel in (t32(1.0, NAN, -INF),      # finite where the oracle is NaN
                   t32(NAN, 5.0, -INF),      # finite where it is +Inf
                   t32(NAN, NAN, NAN)):      # NaN where both are -Inf: a padding zero times an Inf
        assert compare(kernel, o, trusted, "float32", trusted_clean=clean).kind == "nonfinite"


def test_the_clean_run_is_computed_only_where_the_kernel_or_the_trusted_implementation_differs_in_kind():
    o = torch.tensor([1.0, NAN, -INF], dtype=torch.float64)
    assert compare(t32(1.0, NAN, -INF), o, t32(1.0, NAN, -INF), "float32", trusted_clean=never).kind is None


def test_a_trusted_overflow_of_the_oracles_kind_witnesses_no_kind():
    # the trusted implementation overflowed upstream (NaN at every position, with or without
    # the inputs' specials); the oracle is finite, then NaN where an infinite key meets the state
    o = torch.tensor([1.3e17, -3.4e16, NAN, NAN], dtype=torch.float64)
    trusted, clean = t32(NAN, NAN, NAN, NAN), t32(NAN, NAN, NAN, NAN)
    for kernel in (t32(-3.8e20, 6.9e18, -INF, NAN), t32(1.3e17, -3.4e16, INF, -INF)):
        assert compare(kernel, o, trusted, "float32", trusted_clean=clean).kind is None
    # a finite value where the oracle is NaN still fails
    f = compare(t32(1.3e17, -3.4e16, 5.0, NAN), o, trusted, "float32", trusted_clean=clean)
    assert f.kind == "nonfinite" and "NaN set differs" in f.detail
    # a trusted NaN that the inputs' specials carried there witnesses the oracle's kind
    spread = t32(NAN, NAN, 0.0, NAN)
    f = compare(t32(1.3e17, -3.4e16, -INF, NAN), o, trusted, "float32", trusted_clean=spread)
    assert f.kind == "nonfinite"


def test_without_specials_zeroes_nan_and_inf_only():
    x = {"a": t32(NAN, 3e38, -INF, 1.0), "n": torch.tensor([1, 2])}
    clean = without_specials(x)
    assert torch.equal(clean["a"], t32(0.0, 3e38, 0.0, 1.0))
    assert torch.equal(clean["n"], x["n"])
    assert without_specials({"a": t32(1.0, 3e38)}) is None


def _overflowing_target(kernel):
    """out = (2x - 2x) + x: x in float64; NaN in fp32 where 2x overflows (inf - inf)."""
    def math_(x):
        return (x * 2 - x * 2) + x
    return Target(name="test_compare_specials", kernel=kernel, reference=math_,
                  args={"x": Arg(("N",))}, outputs={"out": Output(("N",))},
                  dims={"N": Dim(1, 8)}, dtypes=("float32",))


def _leaky(x):
    """The honest fp32 math, but the NaN at a position reaches the one before it as well."""
    out = (x * 2 - x * 2) + x
    bad = torch.isnan(x).roll(-1)
    return torch.where(bad, torch.nan, out)


@pytest.mark.parametrize("kernel, kind", [(lambda x: (x * 2 - x * 2) + x, None), (_leaky, "nonfinite")],
                         ids=["honest", "leaky"])
def test_a_campaign_excuses_the_overflow_and_not_the_spread_nan_beside_it(kernel, kind):
    target = _overflowing_target(kernel)
    case = Case.make(target.name, "float32", 0, {"N": 4}, {"x": ArgCase(inject=((0, "max"), (3, "nan")))})
    x = {"x": t32(3e38, 1.0, 2.0, NAN)}
    v = judge(case, target, x, {"out": kernel(x["x"])})
    assert (None if v.passed else v.kind) == kind, v.detail


def test_a_bound_failure_names_the_positions_where_the_trusted_implementation_has_no_value():
    o = torch.tensor([1.0, 2.0, NAN], dtype=torch.float64)
    f = compare(t32(1.5, 2.0, NAN), o, t32(NAN, 2.0, NAN), "float32", trusted_clean=t32(1.0, 2.0, 0.0))
    assert f.kind == "bound" and "non-finite at 1 of the 2 positions judged" in f.detail
    f = compare(t32(1.5, 2.0, NAN), o, t32(1.0, 2.0, NAN), "float32")
    assert f.kind == "bound" and "trusted implementation is non-finite" not in f.detail


def _cancelling_target(kernel):
    """out = x y - w v: its terms pass fp32's range where its answer need not; the trusted
    implementation, (x - w) y + w (y - v), stays finite where x = w."""
    def stable(x, y, w, v):
        return (x - w) * y + w * (y - v)
    return Target(name="test_compare_envelope", kernel=kernel, reference=lambda x, y, w, v: x * y - w * v,
                  trusted=stable, args={n: Arg(("N",)) for n in "xywv"}, outputs={"out": Output(("N",))},
                  dims={"N": Dim(1, 8)}, dtypes=("float32",))


@pytest.mark.parametrize("at0, at1, passes", [
    (math.inf, 0.0, True),     # the answer's class is the inputs' rounding's: x y, w v near 1e76
    (NAN, 0.0, False),         # a NaN is in no envelope
    (0.0, math.inf, False),    # x y, w v near 1: no rounding of the inputs reaches an Inf
], ids=["inf-where-rounding-decides", "nan-there", "inf-where-it-does-not"])
def test_a_value_the_rounding_of_the_inputs_may_give_passes_and_no_other(at0, at1, passes):
    """The oracle's exact 0 at position 0 cancels terms near 1e76: inputs one fp32 rounding
    away give +-1e69 there, past fp32's range either way, so an fp32 kernel may give an Inf
    of either sign; at position 1 (terms near 1) only 0 passes."""
    def kernel(x, y, w, v):
        return torch.tensor([at0, at1], dtype=torch.float32)
    target = _cancelling_target(kernel)
    case = Case.make(target.name, "float32", 3, {"N": 2})
    x = {n: t32(1e38, 1.0) for n in "xywv"}
    v = judge(case, target, x, {"out": kernel(**x)})
    assert v.passed == passes, v.detail
    assert passes or v.kind == "nonfinite"
    if passes:   # without the envelope it fails: the oracle's rounded value is 0, the kernel's Inf
        assert compare(kernel(**x), x["x"].double() * x["y"].double() - x["w"].double() * x["v"].double(),
                       target.trusted(**x), "float32").kind == "nonfinite"


def test_a_nan_where_the_oracle_is_finite_fails_without_moving_the_inputs(monkeypatch):
    """No envelope holds a NaN, so the oracle is not run again on moved inputs for one."""
    import kfuzz.execute as ex

    def kernel(x, y, w, v):
        return torch.tensor([NAN, 0.0], dtype=torch.float32)
    target = _cancelling_target(kernel)
    case = Case.make(target.name, "float32", 3, {"N": 2})
    x = {n: t32(1e38, 1.0) for n in "xywv"}
    monkeypatch.setattr(ex, "moved_oracles", lambda *a, **k: pytest.fail("moved the inputs for a NaN"))
    assert judge(case, target, x, {"out": kernel(**x)}).kind == "nonfinite"


def _inf_times_residue(a, x, y, w, v):
    """out = a (x y - w v) - a: with a = +Inf, NaN where x y - w v >= 0 and -Inf where it is
    below 0, so the kind follows the sign of x y - w v."""
    return a * (x * y - w * v) - a


def _residue_target(kernel):
    def wide(**x):   # the oracle's own kinds: no latitude of the trusted implementation's
        return _inf_times_residue(**{n: t.double() for n, t in x.items()}).float()
    return Target(name="test_compare_kinds", kernel=kernel, reference=_inf_times_residue, trusted=wide,
                  args={n: Arg(("N",)) for n in "axywv"}, outputs={"out": Output(("N",))},
                  dims={"N": Dim(1, 8)}, dtypes=("float32",))


@pytest.mark.parametrize("kernel_out, passes", [
    ((-INF, NAN, NAN), True),     # the kinds the oracle takes on inputs one fp32 rounding away
    ((INF, -INF, NAN), False),    # +Inf at 0: no rounding of the inputs gives it
    ((NAN, -INF, -INF), False),   # -Inf at 2, where x y - w v = 1 is no rounding residue
], ids=["kinds-the-rounding-gives", "an-inf-it-does-not", "where-nothing-cancels"])
def test_a_non_finite_kind_the_rounding_of_the_inputs_picks_passes_and_no_other(kernel_out, passes):
    """An Inf times a difference that cancels to its rounding noise, plus another Inf: the
    oracle's kind (NaN at 0 where x y - w v is 0, -Inf at 1 where it is -2^-46) is the sign of
    that noise, and inputs one fp32 rounding away give the other kind (case seed 1: NaN at 1 in
    its first draw, -Inf at 0 in its second). So did gdn_bwd_kda's dk at token 1 with beta
    +Inf at token 0: the state -Inf there times a sum over keys of the state gradient, 0.011 in
    exact arithmetic from terms near 3e21 (crashes/gdn_bwd_kda/nonfinite-dk)."""
    def kernel(**x):
        return t32(*kernel_out)
    target = _residue_target(kernel)
    case = Case.make(target.name, "float32", 1, {"N": 3})
    x = {"a": t32(INF, INF, INF), "x": t32(1.0, 1 + 2**-23, 2.0), "y": t32(1.0, 1 - 2**-23, 1.0),
         "w": t32(1.0, 1.0, 1.0), "v": t32(1.0, 1.0, 1.0)}
    oracle = _inf_times_residue(**{n: t.double() for n, t in x.items()})
    assert oracle.tolist()[1] == -INF and all(map(math.isnan, oracle.tolist()[::2]))
    v = judge(case, target, x, {"out": kernel(**x)})
    assert v.passed == passes, v.detail
    assert passes or v.kind == "nonfinite"
    if passes:   # the oracle's kinds alone (and the trusted implementation's, the same) fail it
        assert compare(kernel(**x), oracle, target.trusted(**x), "float32").kind == "nonfinite"


@pytest.mark.skipif(torch.cuda.is_available(), reason="judges the CPU interpreter's kernel outputs")
@pytest.mark.skipif(torch.cuda.is_available(), reason="judges the CPU interpreter's kernel outputs")
def test_the_envelope_of_a_kind_takes_more_draws_than_the_bound(monkeypatch):
    """gdn_bwd_kda's dk at a key where an Inf times a sum that cancels to its rounding noise
    gives NaN or -Inf by that noise's sign (crashes/gdn_bwd_kda/nonfinite-dk/46656ad1b01ff210):
    the oracle's copies moved from seeds case.seed - 10 and - 9 keep the oracle's kinds, the
    one from case.seed - 3 takes the kernel's.  Judged with those seeds, the kernel passes on
    ENVELOPE_DRAWS draws and would fail on the bound's two."""
    from pathlib import Path

    import kfuzz.execute as ex
    from kfuzz.corpus import load
    from kfuzz.target import get_target
    case, _ = load(Path(__file__).resolve().parents[1] / "crashes" / "gdn_bwd_kda" / "nonfinite-dk" /
                   "46656ad1b01ff210.case.zst")
    target = get_target(case.target)
    inputs, outputs, verdict = ex.kernel_stage(case, target)
    assert verdict is None
    shifted = case.with_(seed=case.seed - 10)
    assert ex.ENVELOPE_DRAWS >= 8 > ex.PERTURB_DRAWS
    assert ex.judge(shifted, target, inputs, outputs).passed
    monkeypatch.setattr(ex, "ENVELOPE_DRAWS", ex.PERTURB_DRAWS)
    v = ex.judge(shifted, target, inputs, outputs)
    assert v.kind == "nonfinite" and v.output == "dk"


@pytest.mark.parametrize("k0,passes", [(-5e35, True), (2e38, False)], ids=["inside", "outside"])
def test_a_finite_value_inside_an_envelope_that_swings_across_classes_leaves_the_bound(k0, passes):
    """gdn_fwd_kda (fp32, beta 1 and unit keys: each step replaces the state): float64 cancels a
    state of 6e37 against itself to its rounding noise, so the oracle's o is -2.6e59, past
    fp32's range, where the exact answer, 1.676e38, is finite; inputs one rounding away give
    any of +-1e68.  Inside such an envelope a finite value passes, and the bound (here from
    the other position, where the trusted implementation is finite) does not judge it."""
    o = torch.tensor([-2.58e59, 1.0], dtype=torch.float64)
    trusted = t32(-math.inf, 1.0)
    envelope = (torch.tensor([-1e68, 1.0], dtype=torch.float64), torch.tensor([-1e30, 1.0], dtype=torch.float64),
                torch.zeros(2, dtype=torch.int32))
    f = compare(t32(k0, 1.0), o, trusted, "float32", envelope=envelope)
    assert (f.kind is None) == passes, f.detail
    assert compare(t32(k0, 1.0), o, trusted, "float32").kind is not None


def test_a_gpu_oracles_large_output_is_compared_on_the_gpu():
    """``judge`` compares on the oracle's GPU from ``COMPARE_ON_DEVICE_MIN`` output elements (a
    comparison's float64 passes over a large output are bound by the CPU's memory bandwidth), below
    that and for a CPU oracle on the CPU."""
    from kfuzz.execute import COMPARE_ON_DEVICE_MIN, comparison_device
    big, small = torch.empty(COMPARE_ON_DEVICE_MIN), torch.empty(COMPARE_ON_DEVICE_MIN - 1)
    assert comparison_device({"a": small, "b": big}, "cuda:1") == "cuda:1"
    assert comparison_device({"a": small}, "cuda") == "cpu"
    assert comparison_device({"a": big}, "cpu") == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the comparison runs there")
def test_a_comparison_on_the_gpu_gives_the_cpus_verdicts_on_cuda():
    """The same tensors compared on the GPU and on the CPU: the same finding, kind and detail's
    position, the ratio up to the order of a norm's sum; with an envelope too."""
    g = torch.Generator().manual_seed(0)
    o = torch.randn(1 << 20, generator=g, dtype=torch.float64)
    t = (o + torch.randn(o.shape, generator=g, dtype=torch.float64) * 1e-7).float()
    k = (o + torch.randn(o.shape, generator=g, dtype=torch.float64) * 1e-7).float()
    off = k.clone()
    off[77] += 1.0
    nan = k.clone()
    nan[5] = float("nan")
    lo, hi = o - 1e-6, o + 1e-6
    envelope = (lo, hi, torch.zeros(o.shape, dtype=torch.int32))
    for kernel in (k, off, nan):
        for env in (None, envelope):
            on_cpu = compare(kernel, o, t, "float32", envelope=env)
            on_gpu = compare(kernel, o.cuda(), t.cuda(), "float32", envelope=env, device="cuda")
            assert on_gpu.kind == on_cpu.kind and on_gpu.detail.split(":")[0] == on_cpu.detail.split(":")[0]
            assert on_gpu.ratio == pytest.approx(on_cpu.ratio, rel=1e-9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_judgment_on_the_gpu_keeps_the_cpus_verdicts_through_every_rule_on_cuda():
    """``judge`` with the oracle on the GPU and an output of a million elements (compared on the
    GPU, the kernel's output, the oracle's runs on moved inputs and the envelope kept there):
    the CPU's verdicts for an Inf the inputs' rounding allows (the envelope), a NaN (no
    envelope holds one), a value far off (the cancellation rule runs the oracle again first)
    and the honest output."""
    n = 1 << 20
    g = torch.Generator().manual_seed(0)
    plain = {k: torch.rand(n, generator=g) + 0.5 for k in "xywv"}
    special = {k: v.clone() for k, v in plain.items()}
    for v in special.values():
        v[:2] = t32(1e38, 1.0)

    def stable(x, y, w, v):
        return (x - w) * y + w * (y - v)
    target = _cancelling_target(stable)
    case = Case.make(target.name, "float32", 3, {"N": 2})
    verdicts = {}
    for name, inputs, (at0, at1, far) in (("inf", special, (math.inf, 0.0, 0.0)), ("nan", special, (NAN, 0.0, 0.0)),
                                          ("off", plain, (None, None, 1.0)), ("honest", plain, (None, None, 0.0))):
        out = stable(**inputs)
        if at0 is not None:
            out[0], out[1] = at0, at1
        out[1000] += far
        on_cpu = judge(case, target, inputs, {"out": out}, "cpu")
        on_gpu = judge(case, target, {k: v.cuda() for k, v in inputs.items()}, {"out": out.cuda()}, "cuda")
        assert (on_gpu.kind, on_gpu.passed) == (on_cpu.kind, on_cpu.passed), (name, on_gpu.detail, on_cpu.detail)
        verdicts[name] = on_gpu.kind
    assert verdicts == {"inf": "pass", "nan": "nonfinite", "off": "bound", "honest": "pass"}
