"""The bound where an answer cancels: the trusted error is raised to the oracle's own change
under a one-roundoff perturbation of the inputs (kfuzz.execute.perturbed_trusted).

The case: GDN varlen, one token, K = 1, beta = 1 exactly (sigmoid saturated): the state is
replaced at every step, so dg = a <dS, S0> (1 - beta k^2) = 0, a difference of two terms of
about 1.5.  The float64 oracle and the trusted fp32 reference cancel them exactly; the kernel's
other order of operations leaves 1.2e-7 (one fp32 rounding of the terms), which a bound scaled
by the trusted error alone (0) calls 2.5e30 times too large."""
import dataclasses

import pytest
import torch

import kfuzz.execute as ex
from kfuzz.case import SCHEMA, Case
from kfuzz.target import get_target

CASE = {"target": "gdn_bwd_varlen", "dtype": "float32", "seed": 0,
        "dims": {"B": 1, "T": 1, "H": 1, "K": 1, "V": 2, "N": 2},
        "args": {"beta": {"dist": {"kind": "shifted", "shift": 30}}}}


# The kernel outputs judged here are the Triton interpreter's on the CPU, where the cases were
# measured; with a GPU visible the Triton kernels compile for it and take no CPU tensors.
cpu_interpreter = pytest.mark.skipif(torch.cuda.is_available(),
                                     reason="judges the CPU interpreter's kernel outputs")


def run(case):
    """(case, target, inputs, the kernel's outputs)."""
    target = get_target(case.target)
    inputs, outputs, verdict = ex.kernel_stage(case, target)
    assert verdict is None
    return case, target, inputs, outputs


@pytest.fixture(scope="module")
def ran():
    return run(Case.from_json({"payload": None, "kfuzz": SCHEMA, **CASE}))


@cpu_interpreter
def test_an_answer_that_cancels_is_judged_against_its_sensitivity(ran, monkeypatch):
    case, target, inputs, outputs = ran
    assert float(inputs["beta"].min()) == 1.0 and float(outputs["dg"].abs().max()) > 0
    assert ex.judge(case, target, inputs, outputs).passed
    # without the raised trusted error (and without the trusted variants, which realize other
    # roundings of the terms) the bound collapses to the floor at an oracle of 0
    monkeypatch.setattr(ex, "perturbed_trusted", lambda target, case, inputs, oracle, trusted, *rest: trusted)
    v = ex.judge(case, dataclasses.replace(target, trusted_variants=0), inputs, outputs)
    assert v.kind == "bound" and v.output == "dg"


@cpu_interpreter
def test_the_fp32_trusted_variants_realize_a_cancelling_answers_rounding(ran, monkeypatch):
    case, target, inputs, outputs = ran
    monkeypatch.setattr(ex, "perturbed_trusted", lambda target, case, inputs, oracle, trusted, *rest: trusted)
    assert ex.judge(case, target, inputs, outputs).passed
    realized = ex.trusted_realizations(target, case, inputs)
    assert any(float(r["dg"].abs().max()) > 0 for r in realized)   # the nearest roundings give 0


@cpu_interpreter
def test_an_error_beyond_the_sensitivity_still_fails(ran):
    case, target, inputs, outputs = ran
    wrong = dict(outputs, dg=outputs["dg"] + 1e-4)
    v = ex.judge(case, target, inputs, wrong)
    assert v.kind == "bound" and v.output == "dg"


def test_the_perturbation_is_one_roundoff_and_keeps_zeros_and_specials():
    x = torch.tensor([0.0, -0.0, 1.5, -3.0, float("nan"), float("inf")], dtype=torch.bfloat16)
    u = 2.0 ** -24
    p = ex.perturbed_inputs({"x": x, "n": torch.arange(3)}, u, seed=1)["x"]
    assert p.dtype == torch.float64
    assert torch.equal(p[:2], x[:2].double()) and torch.isnan(p[4]) and p[5] == float("inf")
    rel = (p[2:4] / x[2:4].double() - 1).abs()
    assert torch.all((rel - u).abs() < 1e-20)


# gdn_bwd_kda, bf16, one token, K 1, V 16: the trusted reference's roundings to nearest cancel
# to 2.2e-5 in dg, where the kernel's two (h0 and v_new, as stored in bf16) leave 7.2e-4
KDA_CASE = "crashes/gdn_bwd_kda/bound-dg/f8979a50785b0285.case.zst"


@pytest.fixture(scope="module")
def kda():
    from pathlib import Path

    from kfuzz.corpus import load
    return run(load(Path(__file__).resolve().parents[1] / KDA_CASE)[0])


@cpu_interpreter
def test_an_output_no_farther_than_an_honest_rounding_realization_passes(kda, monkeypatch):
    case, target, inputs, outputs = kda
    assert target.trusted_variants > 0
    assert ex.judge(case, target, inputs, outputs).passed
    monkeypatch.setattr(target, "trusted_variants", 0)
    v = ex.judge(case, target, inputs, outputs)
    assert v.kind == "bound" and v.output == "dg"


@cpu_interpreter
def test_an_error_beyond_every_rounding_realization_still_fails(kda):
    case, target, inputs, outputs = kda
    o = ex.oracle_outputs(target, inputs)["dg"]
    far = max(float((ex.trusted_outputs(target, case, inputs, variant=i)["dg"].double() - o).abs().max())
              for i in range(target.trusted_variants))
    wrong = dict(outputs, dg=(o + 1.5 * far).to(outputs["dg"].dtype))
    v = ex.judge(case, target, inputs, wrong)
    assert v.kind == "bound" and v.output == "dg"


def test_a_target_without_variants_refuses_a_variant():
    from kfuzz.errors import TargetError
    with pytest.raises(TargetError, match="trusted variants"):
        get_target("softmax").call_trusted({}, variant=0)


# gdn_fwd_kda, bf16, K 1, 17 tokens: beta +inf at the second chunk's first token meets a state
# of about 1e-15 (h0 -1 decayed sixteen times), whose sign lies below the chunked fp32 form's
# noise; the oracle's o there is NaN (inf - inf), two of the four trusted realizations give +Inf
KIND_CASE = "crashes/gdn_fwd_kda/nonfinite-o/79781b6d3734f198.case.zst"


@pytest.mark.parametrize("o_last,ht,passes", [(float("inf"), float("-inf"), True),
                                              (float("-inf"), float("-inf"), False)])
def test_a_kind_that_an_honest_rounding_realization_takes_passes(monkeypatch, o_last, ht, passes):
    from pathlib import Path

    from kfuzz.corpus import load
    from kfuzz.tensors import materialize
    case = load(Path(__file__).resolve().parents[1] / KIND_CASE)[0]
    target = get_target(case.target)
    inputs = materialize(case, target, "cpu")
    oracle = ex.oracle_outputs(target, inputs)
    assert oracle["o"].flatten()[-1].isnan() and oracle["ht"].isnan().all()
    outputs = {k: v.to(torch.bfloat16 if k == "o" else torch.float32) for k, v in oracle.items()}
    outputs["o"].view(-1)[-1] = o_last
    outputs["ht"].fill_(ht)
    assert ex.judge(case, target, inputs, outputs).passed is passes
    monkeypatch.setattr(target, "trusted_variants", 0)
    v = ex.judge(case, target, inputs, outputs)
    assert v.kind == "nonfinite" and v.output == "o"
