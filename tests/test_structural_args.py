"""An argument whose values are structural (``Arg(specials=False)``: offsets, indices) takes no
injected special value: the engines never inject one, the gates' special-value cases skip it,
and a case that injects one is refused before anything runs. Every distribution draws for
integer arguments too."""
import random

import pytest
import torch

from kfuzz.case import ArgCase, Case
from kfuzz.engines.atheris import _mutate_injections, decode_fdp
from kfuzz.engines.random import sample_case
from kfuzz.errors import CaseError
from kfuzz.gates.base import float_args
from kfuzz.strategies import cases
from kfuzz.target import Arg, Dim, Output, Target, get_target


def _segment_sums(x, offsets):
    if not bool((offsets[1:] >= offsets[:-1]).all()) or int(offsets[0]) != 0 or int(offsets[-1]) != x.shape[0]:
        raise ValueError("offsets must rise from 0 to the length of x")
    return torch.stack([x[int(a):int(b)].sum() for a, b in zip(offsets[:-1], offsets[1:])])


def _domain(x, dims):
    inner = torch.sort((torch.sigmoid(x["offsets"][1:-1]) * dims["T"]).floor()).values
    return {**x, "offsets": torch.cat([x["offsets"].new_zeros(1), inner, x["offsets"].new_full((1,), float(dims["T"]))])}


def _target(specials: bool) -> Target:
    return Target(name="segsum", kernel=_segment_sums, reference=_segment_sums,
                  args={"x": Arg(("T",)), "offsets": Arg(("N+1",), dtype="int64", specials=specials)},
                  outputs={"out": Output(("N",))}, dims={"T": Dim(1, 64), "N": Dim(1, 8)}, domain=_domain)


def test_the_engines_never_inject_into_a_structural_argument():
    target, free = _target(False), _target(True)
    rng = random.Random(0)
    drawn = [sample_case(target, rng) for _ in range(300)]
    assert all(not c.arg("offsets").inject for c in drawn)
    assert any(c.arg("x").inject for c in drawn)                      # the float argument still gets them
    # the same draws on an argument that takes specials do inject there (the test can fail)
    rng = random.Random(0)
    assert any(sample_case(free, rng).arg("offsets").inject for _ in range(300))
    for _ in range(50):
        assert _mutate_injections(rng, (), drawn[0], target, "offsets") == ()


def test_the_atheris_decoder_never_injects_into_a_structural_argument():
    pytest.importorskip("atheris")
    target, free = _target(False), _target(True)
    rng = random.Random(1)
    inputs = [bytes(rng.getrandbits(8) for _ in range(256)) for _ in range(300)]
    assert all(not decode_fdp(data, target).arg("offsets").inject for data in inputs)
    # the same inputs do inject where the argument takes specials (the test can fail)
    assert any(decode_fdp(data, free).arg("offsets").inject for data in inputs)


def test_the_hypothesis_strategy_and_the_gates_skip_a_structural_argument():
    hypothesis = pytest.importorskip("hypothesis")
    target = _target(False)

    @hypothesis.settings(max_examples=60, deadline=None, database=None)
    @hypothesis.given(cases(target))
    def check(case):
        assert not case.arg("offsets").inject
    check()
    assert "offsets" not in float_args(target, "float32")


def test_a_case_injecting_into_a_structural_argument_is_refused():
    target = _target(False)
    case = Case.make("segsum", "float32", 1, {"T": 9, "N": 3}, {"offsets": ArgCase(inject=((1, "max"),))})
    with pytest.raises(CaseError, match="'offsets' takes no injected values"):
        target.validate(case)
    _target(True).validate(case)


def test_varlen_gdn_offsets_take_no_special_values():
    for name in ("gdn_fwd_varlen", "gdn_bwd_varlen"):
        assert get_target(name).args["cu_seqlens"].specials is False


@pytest.mark.parametrize("dtype", ["int64", "int32", "float32", "float16", "bfloat16"])
def test_every_distribution_draws_for_every_argument_dtype(dtype):
    from kfuzz.case import DISTRIBUTIONS, Dist
    from kfuzz.tensors import draw, rng_for
    params = {"scaled": (("factor", 100.0),), "shifted": (("shift", 5.0),)}
    for kind in DISTRIBUTIONS:
        values = draw(Dist(kind, params.get(kind, ())), (3, 5), dtype, rng_for(1, "x"))
        assert values.shape == (3, 5), kind
    sub = draw(Dist("subnormal"), (64,), dtype, rng_for(1, "x"))
    assert (sub == 0).all() if dtype.startswith("int") else (sub != 0).all()


def test_a_varlen_case_with_subnormal_offsets_materializes():
    from kfuzz.case import Dist
    from kfuzz.tensors import materialize
    target = get_target("gdn_fwd_varlen")
    case = Case.make("gdn_fwd_varlen", "float32", 3, {"B": 1, "T": 20, "H": 1, "K": 4, "V": 4, "N": 3},
                     {"cu_seqlens": ArgCase(dist=Dist("subnormal"))})
    target.validate(case)
    offsets = materialize(case, target)["cu_seqlens"]
    assert offsets[0] == 0 and offsets[-1] == 20 and bool((offsets[1:] >= offsets[:-1]).all())
