"""The GDN targets' declared JIT specialization (`harnesses.gdn.specialization`) names every
trigger of a new one: cases the key calls one specialization pass each kernel the same Triton
signature (the integers' classes, 1 or a multiple of 16, the pointers' 16-byte alignment, and
every constexpr and launch option), seen by recording the kernels' launches under Triton's interpreter."""
import inspect

import pytest
import torch

from kfuzz.case import Case
from kfuzz.execute import kernel_stage
from kfuzz.schedule import integer_key, specialization
from kfuzz.target import get_target


def launches(case: Case) -> dict[str, set]:
    """Each kernel the case launches, with the Triton signatures it was launched at."""
    from triton.runtime.interpreter import InterpretedFunction
    seen: dict[str, set] = {}
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        constexprs = {n for n, a in inspect.get_annotations(fn).items() if "constexpr" in str(a)}
        free = set(self.kwargs.get("do_not_specialize") or ())
        sig = []
        for name, value in [*zip(self.arg_names, args), *sorted(kwargs.items())]:
            if name in free or isinstance(value, float):
                continue      # floats are not specialized
            if hasattr(value, "data_ptr"):
                sig.append((name, value.data_ptr() % 16 == 0))      # a pointer: its alignment
            elif isinstance(value, int) and not isinstance(value, bool) and name not in constexprs \
                    and name in self.arg_names:
                sig.append((name, integer_key(value)))
            else:
                sig.append((name, repr(value)))
        seen.setdefault(fn.__name__, set()).add(tuple(sig))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording
    try:
        target = get_target(case.target)
        _, _, verdict = kernel_stage(case, target)
        assert verdict is None, verdict
    finally:
        InterpretedFunction.run = run
    return seen


CASES = [   # (target, dtype, [(B, T, H), ...]) at K 4, V 4 (8 with bf16)
    # 12 and 16 chunks of 64 tokens (B 3 and 4 at T 193): Triton specializes the chunk count;
    # the backward launches every kernel of the forward too, at the forward's signatures
    ("gdn_bwd", "float32", [(3, 193, 1), (4, 193, 1), (3, 200, 1)]),
    # 12 and 16 chunks of 16 tokens (a vector gate's, B 3 and 4 at T 49)
    ("gdn_fwd_gla", "float32", [(3, 49, 1), (4, 49, 1), (3, 60, 1)]),
    ("gdn_bwd_kda", "float32", [(3, 49, 1), (4, 49, 1), (3, 60, 1)]),
    # H is a constexpr of the forward's kernels
    ("gdn_fwd_delta", "float16", [(1, 100, 5), (1, 120, 5), (1, 100, 7)]),
    ("gdn_bwd", "bfloat16", [(2, 41, 3), (2, 45, 3), (2, 41, 2)]),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="records the launches under Triton's interpreter")
@pytest.mark.parametrize("name,dtype,shapes", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_cases_of_one_declared_specialization_launch_the_same_kernels(name, dtype, shapes):
    """The cases are grouped by the declared key; within a group every kernel is launched at
    the same signatures (each list holds at least one group of two)."""
    target = get_target(name)
    width = 8 if dtype == "bfloat16" else 4
    groups: dict = {}
    for B, T, H in shapes:
        case = Case.make(name, dtype, 1, dict(B=B, T=T, H=H, K=width, V=width))
        groups.setdefault(specialization(target, case), []).append(case)
    assert any(len(g) > 1 for g in groups.values())
    for cases in groups.values():
        first, *rest = [(c.dim, launches(c)) for c in cases]
        assert first[1], "no kernel launch recorded"
        for dims, got in rest:
            assert got.keys() == first[1].keys(), (first[0], dims)
            for kernel in got:
                assert got[kernel] == first[1][kernel], (kernel, first[0], dims, got[kernel] ^ first[1][kernel])


@pytest.mark.skipif(torch.cuda.is_available(), reason="records the launches under Triton's interpreter")
@pytest.mark.parametrize("name", ["gdn_fwd", "gdn_bwd_delta", "gdn_fwd_kda", "gdn_bwd_linear"])
def test_a_drawn_case_and_a_sibling_of_its_key_launch_the_same_kernels(name):
    """A drawn case (small dims, H 5 to 7) and one at other B, T or H that the declared key
    calls the same specialization, as the scheduler's redraws make them."""
    import random

    from kfuzz.engines.random import RandomEngine
    target = get_target(name)
    rng = random.Random(name)
    case = RandomEngine(target, seed=3).next_case()
    dims = dict(case.dim, B=min(case.dim["B"], 2), T=min(case.dim["T"], 70), H=rng.choice([5, 6, 7]),
                K=min(case.dim["K"], 8), V=min(case.dim["V"], 8))
    one = Case.make(name, case.dtype, 1, dims)
    key = specialization(target, one)
    siblings = [c for c in (Case.make(name, case.dtype, 1, dict(dims, B=rng.randint(1, 3), T=rng.randint(1, 90),
                                                                H=rng.randint(1, 8))) for _ in range(2000))
                if specialization(target, c) == key and c.dim != one.dim]
    # another H where the key allows one, else another B or T
    other = next((c for c in siblings if c.dim["H"] != one.dim["H"]), siblings[0])
    got_one, got_other = launches(one), launches(other)
    assert got_one and got_one.keys() == got_other.keys()
    for kernel in got_one:
        assert got_one[kernel] == got_other[kernel], (kernel, one.dim, other.dim)
