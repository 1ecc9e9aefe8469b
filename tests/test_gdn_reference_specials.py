"""The trusted chunked GDN reference's gradients carry a NaN to the gates the recurrence
carries it to, and no others (the bound's scale is its error where the oracle is finite)."""
import pytest
import torch

import harnesses.gdn as gdn_targets
from gdn.oracle import recurrence
from gdn.reference import _PairSums, chunked


def _inputs(gate: str, T=6, K=3, V=2, nan_at=("v", 3)):
    g = torch.Generator().manual_seed(0)
    x = {"q": torch.randn(1, T, 1, K, generator=g), "k": torch.randn(1, T, 1, K, generator=g),
         "v": torch.randn(1, T, 1, V, generator=g),
         "g": -torch.rand(*((1, T, 1) if gate == "scalar" else (1, T, 1, K)), generator=g),
         "beta": torch.rand(1, T, 1, generator=g), "h0": torch.randn(1, 1, K, V, generator=g),
         "do": torch.randn(1, T, 1, V, generator=g), "dht": torch.randn(1, 1, K, V, generator=g)}
    x["k"] = x["k"] / x["k"].norm(dim=-1, keepdim=True)
    name, t = nan_at
    x[name][0, t] = float("nan")
    return x


@pytest.mark.parametrize("gate", ["scalar", "vector"])
@pytest.mark.parametrize("nan_at", [("v", 3), ("do", 4), ("q", 4)])
def test_a_nan_reaches_the_gate_gradients_the_recurrence_takes_it_to(gate, nan_at):
    x = _inputs(gate, nan_at=nan_at)
    wide = {k: v.double() for k, v in x.items()}
    oracle = gdn_targets._grads(recurrence, wide, True)[3]
    trusted = gdn_targets._grads(chunked, x, True)[3]
    assert bool(torch.isfinite(oracle).any()), "the case must leave some gate gradient finite"
    assert torch.equal(torch.isnan(trusted), torch.isnan(oracle))
    fin = torch.isfinite(oracle)
    assert torch.allclose(trusted[fin].double(), oracle[fin], rtol=1e-4, atol=1e-5)


def test_pair_sums_gradient_is_the_sum_over_the_pairs_that_span_each_gate():
    gc = (-torch.rand(2, 1, 7, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(_PairSums.apply, (gc,))
    D = _PairSums.apply(gc)
    w = torch.zeros_like(D)
    w[0, 0, 5, 2] = float("nan")                    # the pair (5, 2) spans gates 3, 4, 5
    (grad,) = torch.autograd.grad(D, gc, w)
    assert torch.isnan(grad[0, 0]).tolist() == [False, False, False, True, True, True, False]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_lands_on_a_bracketing_neighbour_without_bias(dtype):
    from gdn.reference import round_to
    x = torch.tensor([1.0 + 3 * 2.0 ** -13, -3.3e-3, 0.1, 1e-6, 0.0, float("inf"), float("nan")],
                     dtype=torch.float32)
    draws = torch.stack([round_to(x, dtype, torch.Generator().manual_seed(s)) for s in range(400)])
    near = x.to(dtype).to(torch.float32)
    fin = torch.isfinite(x) & (x != 0)
    for j in torch.nonzero(fin).flatten().tolist():
        vals = set(draws[:, j].tolist())
        assert all(float(torch.tensor(v).to(dtype).float()) == v for v in vals)   # representable
        lo, hi = min(vals), max(vals)
        assert len(vals) == 2 and lo < float(x[j]) < hi and float(near[j]) in vals   # x is not representable
        assert abs(float(draws[:, j].double().mean()) - float(x[j])) < 0.1 * (hi - lo)   # unbiased
    assert torch.equal(draws[:, ~fin][:, :2], near[~fin][:2].expand(400, 2))    # 0 and inf: nearest
    assert torch.isnan(draws[:, -1]).all()
    assert torch.allclose(round_to(x, dtype, torch.Generator().manual_seed(7)),
                          round_to(x, dtype, torch.Generator().manual_seed(7)), rtol=0, atol=0, equal_nan=True)
    assert torch.allclose(round_to(x, dtype), near, rtol=0, atol=0, equal_nan=True)   # no generator: nearest


def test_an_fp32_operand_is_the_rounding_of_a_value_within_half_a_unit_of_it():
    from gdn.reference import round_to
    x = torch.tensor([1.0, 1.5 + 2.0 ** -22, -3.3e-3, 1e-40, 0.0, float("inf"), float("nan")])
    draws = torch.stack([round_to(x, torch.float32, torch.Generator().manual_seed(s)) for s in range(400)])
    ulp = torch.tensor([2.0 ** -23, 2.0 ** -23, 2.0 ** -32, 2.0 ** -149])   # each value's unit (just above)
    for j in range(4):
        d = (draws[:, j].double() - float(x[j])).abs()
        assert bool((d <= float(ulp[j]) * 1.0001).all()) and bool((d > 0).any())    # moved by one unit at most
        assert abs(float(draws[:, j].double().mean()) - float(x[j])) < 0.1 * float(ulp[j])   # unbiased
    assert torch.equal(draws[:, 4:6], x[4:6].expand(400, 2)) and torch.isnan(draws[:, 6]).all()
    assert torch.equal(round_to(x[:4], torch.float32), x[:4])    # no generator: x itself
