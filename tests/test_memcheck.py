"""tools/interpreter_memcheck.py: a planted out-of-bounds store is caught, a correct kernel
and the GDN forward's exact/resume parts (a NaN in q, in the initial state) pass."""
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import interpreter_memcheck  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
interpreter_memcheck.install()


@triton.jit
def _copy(x, y, n, extra, B: tl.constexpr):
    r = tl.arange(0, B)
    tl.store(y + r, tl.load(x + r, mask=r < n), mask=r < n + extra)


def test_a_store_one_past_the_end_is_caught_naming_the_argument():
    x, y = torch.arange(8.0), torch.zeros(8)
    _copy[(1,)](x, y, 8, 0, B=16)                 # masked right: passes, copies
    assert torch.equal(y, x)
    with pytest.raises(Exception, match=r"memcheck: store outside every argument of _copy .*`y` \(32 bytes\)"):
        _copy[(1,)](x, y, 8, 1, B=16)


def test_gdn_forward_exact_and_resume_parts_stay_inside_their_tensors():
    runs = list(interpreter_memcheck.gdn_sweep(
        T=80, members=[("scalar", True)], inputs=("q", "h0"), values=(float("nan"),)))
    assert [r for r, _ in runs] == ["scalar-delta q=nan", "scalar-delta h0=nan"]
    assert all(err is None for _, err in runs), runs


def test_masked_out_lanes_are_surveyed_by_how_far_they_point_past_their_argument():
    """`masked_out`: the masked-off lanes of an access, which read nothing under the interpreter
    but present their addresses on a GPU where the load is pipelined, reported per (kernel,
    argument, load or store) by the farthest such address (a byte offset from the argument's
    start) beside the argument's size; an access whose masked lanes stay inside reports
    nothing."""
    x, y = torch.arange(8.0), torch.zeros(8)
    far = interpreter_memcheck.masked_out(lambda: _copy[(1,)](x, y, 5, 0, B=16))
    # lanes 8..15 of both the load and the store point past the 32 bytes of x and y, the last
    # at byte 60 (lanes 5..7 are masked but inside)
    assert far == {("_copy", "x", "load"): (60, 32), ("_copy", "y", "store"): (60, 32)}
    assert interpreter_memcheck.masked_out(lambda: _copy[(1,)](x, y, 5, 0, B=8)) == {}
    assert interpreter_memcheck.MASKED_OUT is None   # the survey is off again
