"""The GDN kernels read only memory they wrote: with every allocation of the gdn modules
(hand-offs between launches, flags, outputs) filled with NaN, huge values or nonzero flags
instead of zeros, and with the inputs inside NaN-filled storage, the op's forward and backward
give the same bits.  A GPU's caching allocator hands back memory holding earlier values;
the interpreter's fresh memory is mostly zeros, so these fills are what make an unwritten read
show on the CPU (tools/poison_gdn.py does the same on a GPU).  Programs of one launch run in no
order on a GPU and in a fixed one in the interpreter: run in reverse, they give the same bits
too (a program reading another's output would not)."""
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from poison_gdn import differences, fills, op_outputs, reversed_programs  # noqa: E402

import gdn.fwd_state  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
F = torch.nn.functional


def inputs(T, H, K, V, gate, delta, dtype, *, N=1, seed=0):
    """q, k, v, g, beta, h0, do, dht on DEV: keys L2-normalized, log gates <= 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    g = {0: None, 1: F.logsigmoid(rn(1, T, H)), 2: F.logsigmoid(rn(1, T, H, K) + 2)}[gate]
    x = dict(q=rn(1, T, H, K), k=F.normalize(rn(1, T, H, K), dim=-1), v=rn(1, T, H, V), g=g,
             beta=torch.rand(1, T, H, generator=gen) if delta else None, h0=rn(N, H, K, V),
             do=rn(1, T, H, V), dht=rn(N, H, K, V))
    low = ("q", "k", "v", "beta", "do")
    return {n: None if t is None else t.to(dtype if n in low else torch.float32).to(DEV)
            for n, t in x.items()}


def in_nan_storage(t, before=7, after=9):
    """t as a view into a larger storage whose other elements are NaN (the same values and
    shape, contiguous strides)."""
    if t is None:
        return None
    buf = torch.full((before + t.numel() + after,), float("nan"), dtype=t.dtype, device=t.device)
    buf[before:before + t.numel()] = t.reshape(-1)
    return buf[before:before + t.numel()].view(t.shape)


def assert_fills_agree(x, cu=None, delta=True, save_states=True, poison=("nan", "huge")):
    with fills("zero"):
        want = op_outputs(x, cu, delta, save_states)
    for fill in poison:
        with fills(fill):
            got = op_outputs(x, cu, delta, save_states)
        assert not differences(want, got), f"scratch filled with {fill}: {differences(want, got)}"


# K = V = 17: the last key of a 32-wide tile valid, the rest padding; T = 1 and T not a
# multiple of the chunk (64; 16 for the vector gate); several heads
@pytest.mark.parametrize("T,H,gate,delta,dtype", [
    (1, 3, 1, True, torch.bfloat16),
    (20, 2, 2, True, torch.float32),
    (5, 2, 0, False, torch.bfloat16),
    (3, 2, 2, False, torch.float32),
])
def test_the_ops_outputs_do_not_depend_on_what_its_scratch_held(T, H, gate, delta, dtype):
    assert_fills_agree(inputs(T, H, 17, 17, gate, delta, dtype), delta=delta)


def test_the_recomputed_states_do_not_depend_on_what_the_scratch_held():
    """save_states=False: the backward's own prep, inverse and state pass."""
    assert_fills_agree(inputs(3, 2, 17, 17, 1, True, torch.bfloat16), save_states=False, poison=("nan",))


def test_varlen_outputs_do_not_depend_on_what_the_scratch_held():
    """Packed sequences, an empty one among them."""
    cu = torch.tensor([0, 0, 1, 6], device=DEV)
    assert_fills_agree(inputs(6, 2, 17, 17, 1, True, torch.bfloat16, N=3), cu=cu, poison=("nan",))


def test_the_exact_path_does_not_depend_on_what_the_scratch_held():
    """A NaN beta sends its chunk token by token (and leaves v_new and dU unwritten there)."""
    x = inputs(2, 2, 17, 17, 1, True, torch.bfloat16)
    x["beta"][0, 1, 0] = float("nan")
    assert_fills_agree(x, poison=("nan",))


def test_inputs_are_read_only_where_they_lie():
    """Inputs inside NaN-filled storage give the bits of compact ones."""
    x = inputs(5, 2, 17, 17, 1, True, torch.bfloat16)
    want = op_outputs(x)
    got = op_outputs({n: in_nan_storage(t) for n, t in x.items()})
    assert not differences(want, got)


def test_the_check_catches_a_launch_that_reads_scratch_nobody_wrote(monkeypatch):
    """A planted bug: the forward's state pass without its matrix part (its config launch
    skipped), so the resume part reads the stop chunk and state that the matrix part should
    have stored.  The fills then change the outputs."""
    import dataclasses

    from gdn.config import DEFAULT
    spread = dataclasses.replace(DEFAULT, state_pick="spread")
    monkeypatch.setattr(gdn.fwd_state, "_first_that_fits", lambda configs, launch: configs[0])
    x = inputs(1, 1, 17, 17, 1, True, torch.float32)
    with fills("zero"):
        want = op_outputs(x, config=spread)
    with fills("nan"):
        got = op_outputs(x, config=spread)
    assert differences(want, got)


needs_interpreter = pytest.mark.skipif(DEV == "cuda", reason="reorders the Triton interpreter's programs")


@needs_interpreter
def test_the_ops_outputs_do_not_depend_on_the_order_of_programs():
    """Programs of one launch run in no order on a GPU: the interpreter's programs in reverse
    grid order give the same bits."""
    x = inputs(1, 3, 17, 17, 1, True, torch.bfloat16)
    want = op_outputs(x)
    with reversed_programs():
        got = op_outputs(x)
    assert not differences(want, got)


@needs_interpreter
def test_the_order_check_catches_a_program_that_reads_another_programs_output():
    """A planted launch whose program i reads what program i - 1 wrote."""
    import triton
    import triton.language as tl

    @triton.jit
    def chained(out):
        i = tl.program_id(0)
        prev = tl.load(out + i - 1, mask=i > 0, other=0.)
        tl.store(out + i, prev + 1.)

    def run():
        out = torch.zeros(4)
        chained[(4,)](out)
        return out
    want = run()
    with reversed_programs():
        got = run()
    assert not torch.equal(want, got)
