"""The GDN family's fast oracle: the chunked float64 closed form agrees with the step-by-step
definition to float64 rounding, hands every case with special values to the definition, and
gives the same verdicts as the definition on the kept GDN failures and on gate cases."""
import copy
import dataclasses
import glob

import pytest
import torch
import torch.nn.functional as F

import harnesses.gdn as hg
from gdn.oracle import recurrence
from gdn.oracle_fast import closed_form, fast_path, fast_recurrence
from kfuzz.corpus import load
from kfuzz.execute import judge, trusted_outputs
from kfuzz.gates import GATES
from kfuzz.target import get_target
from kfuzz.tensors import materialize

MEMBERS = [(gate, delta) for gate in (None, "scalar", "vector") for delta in (True, False)]


def _inputs(B, T, H, K, V, gate, delta, varlen=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    g = None if gate is None else -F.softplus(r(B, T, H, *((K,) if gate == "vector" else ())))
    cu = torch.tensor([0, 3, 3, T // 2, T]) if varlen else None
    return dict(q=r(B, T, H, K), k=F.normalize(r(B, T, H, K), dim=-1), v=r(B, T, H, V), g=g,
                beta=torch.sigmoid(r(B, T, H)) if delta else None, initial_state=r(4 if varlen else B, H, K, V),
                cu_seqlens=cu)


@pytest.mark.parametrize("gate,delta", MEMBERS)
@pytest.mark.parametrize("varlen", [False, True])
def test_the_closed_form_is_the_recurrence_to_float64_rounding(gate, delta, varlen):
    x = _inputs(1 if varlen else 2, 37, 3, 11, 7, gate, delta, varlen)
    names = ["q", "k", "v", "initial_state"]

    def run(fn):
        leaves = {n: x[n].clone().requires_grad_(True) for n in names}
        o, ht = fn(**{**x, **leaves}, delta=delta)
        grads = torch.autograd.grad((o, ht), list(leaves.values()), (torch.ones_like(o), torch.ones_like(ht)))
        return (o, ht, *grads)

    for a, b in zip(run(recurrence), run(closed_form)):
        a, b = a.detach(), b.detach()
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= 1e-12 * max(1.0, float(a.abs().max()))


@pytest.mark.parametrize("gate,delta", [m for m in MEMBERS if m[0] is not None])
def test_a_gate_gradient_far_below_the_terms_beside_it_keeps_its_digits(gate, delta):
    """At the first token the gate's gradient is exp(g) <dS, h0>: with a tiny h0 and a large
    output gradient it is some 1e-34, beside the first token's own q k v do (some 1e5), whose
    decay exp(G_1 - G_1) = 1 depends on the gate in form only. The closed form takes it
    without that term entering twice with both signs (``_Between``, ``_After``): the step-by-step
    definition's value to 1e-12. Differentiated as a difference of cumulative sums, the two
    signs cancel to exactly 0 (``crashes/gdn_bwd_mamba2/bound-dg``: 0 against -3.66e-34)."""
    x = _inputs(1, 5, 2, 3, 4, gate, delta, seed=3)
    x["initial_state"] = x["initial_state"] * 1e-30
    names = ["g", "initial_state"]

    def dg(fn):
        leaves = {n: x[n].clone().requires_grad_(True) for n in names}
        o, ht = fn(**{**x, **leaves}, delta=delta)
        return torch.autograd.grad((o, ht), leaves["g"], (1e4 * torch.ones_like(o), torch.ones_like(ht)))[0]

    step, fast = dg(recurrence)[:, 0], dg(closed_form)[:, 0]
    assert float(step.abs().max()) < 1e-25
    assert float((fast - step).abs().max()) <= 1e-12 * float(step.abs().max())


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 3e38, -3e38])
@pytest.mark.parametrize("arg", ["q", "k", "v", "g", "beta", "initial_state"])
def test_special_and_out_of_domain_values_go_step_by_step(arg, value):
    """A gate of -3e38 is in the domain (a complete forget) but its chunk's gate sums lose
    every later gate in float64: it goes step by step too."""
    x = _inputs(1, 9, 2, 5, 3, "scalar", True)
    x[arg] = x[arg].clone()
    x[arg].view(-1)[4] = value
    if abs(value) == 3e38 and arg in ("q", "v", "initial_state"):
        return     # finite and in the domain: the closed form applies (tested above)
    assert not fast_path(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"])
    for s, t in zip(recurrence(**x), fast_recurrence(**x)):   # the definition's own result, bit for bit
        assert torch.equal(s.isnan(), t.isnan()) and torch.equal(s.nan_to_num(), t.nan_to_num())


def _step_by_step(target):
    """``target`` judged by the step-by-step definition alone."""
    fwd = target.name.startswith("gdn_fwd")
    delta = "beta" in target.args
    reference = ((lambda **x: hg._call(recurrence, x, delta)) if fwd
                 else (lambda **x: hg._grads(recurrence, x, delta)))
    return dataclasses.replace(target, reference=reference)


def _trusted_once(target):
    """``target`` with its trusted implementation run once for each distinct inputs and variant
    (it is deterministic; under the interpreter its runs are this file's cost), its outputs
    handed out as copies."""
    if target.trusted is None:
        return target
    memo = {}

    def key(x):
        return tuple((k, (v.dtype, tuple(v.shape), v.stride(), v.detach().contiguous().view(-1).view(torch.uint8)
                          .numpy().tobytes()) if isinstance(v, torch.Tensor) else repr(v)) for k, v in sorted(x.items()))

    def trusted(**x):
        k = key(x)
        if k not in memo:
            memo[k] = target.trusted(**x)
        return copy.deepcopy(memo[k])
    return dataclasses.replace(target, trusted=trusted)


def _same_verdicts(case, target):
    """Judged against the trusted implementation's outputs and against them with one element
    off by 1%: the fast and the step-by-step oracle give the same verdict each time."""
    target = _trusted_once(target)
    inputs = materialize(case, target)
    honest = trusted_outputs(target, case, inputs)
    name = next(iter(honest))
    off = dict(honest)
    off[name] = honest[name].contiguous().clone()
    if off[name].numel():
        off[name].view(-1)[0] = off[name].view(-1)[0] * 1.01 + 1e-3
    slow = _step_by_step(target)
    for outputs in (honest, off):
        assert judge(case, target, inputs, outputs).signature == judge(case, slow, inputs, outputs).signature


def _small(target, case) -> bool:
    """Cases the CPU judges in seconds (the float64 autograd of a B=4, H=16, K=V=256 state
    takes a minute here; it is the same code)."""
    return target.numel("q", case.dim) <= 4096 and target.numel("h0", case.dim) <= 8192


KEPT = [p for p in sorted(glob.glob("crashes/gdn_*/*/*.case.zst")) if _small(get_target(load(p)[0].target), load(p)[0])]


@pytest.mark.parametrize("path", KEPT, ids=lambda p: p.split("/", 1)[1])
def test_the_kept_gdn_failures_get_the_same_verdicts(path):
    case, _ = load(path)
    _same_verdicts(case, get_target(case.target))


@pytest.mark.parametrize("target_name", ["gdn_fwd", "gdn_bwd"])
@pytest.mark.parametrize("gid", ["G01", "G02", "G03", "G04", "G05"])
def test_gate_cases_get_the_same_verdicts(target_name, gid):
    target = get_target(target_name)
    cases = [c for c in GATES[gid].cases(target, 0) if _small(target, c)][:4]
    assert cases
    for case in cases:
        _same_verdicts(case, target)
