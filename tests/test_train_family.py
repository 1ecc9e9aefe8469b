"""Training the five GDN family members through our Triton op (gdn.op) against the float32
chunked reference (gdn.reference), at a CPU size, under the Triton interpreter.

Tolerances.  Both paths run in float32 here (the interpreter's products are IEEE); one head
of 16 (the interpreter's cost grows with heads; the kernel tests cover many heads):
- every parameter's gradient of one batch's loss agrees with the reference path's to
  GRAD_RTOL = 1e-4 of its norm (measured: <= 6.2e-6).  A planted bug, the op's dg halved,
  puts it at 0.5 for every gated member;
- the two training curves agree to LOSS_TOL = 3e-5 nats at each of 3 steps (measured:
  <= 4.8e-7; with dg halved 3e-4 for GDN, KDA, GLA, but only 1.4e-6 for Mamba2-style, whose
  op output is small next to its D skip at initialization: the gradient check is the sharp one);
- "falls": the held-out loss after 3 steps at a high learning rate is at least MIN_DROP =
  0.5 nats under the initial one (measured drops 1.3-1.4 nats).
"""
import copy
import csv
import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gdn.layers import MEMBERS, FamilyMixer  # noqa: E402
from gdn.lm import ByteLM, Corpus, gradient_gap, heldout_loss, stdlib_bytes, train  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TINY = dict(d_model=32, layers=1, heads=1, head_dim=16)
STEPS, BATCH, SEQ, LR = 3, 1, 32, 3e-2
LOSS_TOL = 3e-5
GRAD_RTOL = 1e-4
MIN_DROP = 0.5
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the models are tiny: torch's worker threads only spin against the interpreter
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def corpus():
    return Corpus.from_bytes(stdlib_bytes(1 << 18))


def _heldout(model, corpus):
    # evaluated through the reference forward: fast, and the weights are what is being judged
    m = copy.deepcopy(model)
    m.set_backend("reference")
    return heldout_loss(m, corpus, batch=8, seq_len=SEQ, device=DEV, max_windows=8)


@pytest.mark.parametrize("member", list(MEMBERS))
def test_member_trains_alike_through_both_backends(member, corpus):
    torch.manual_seed(0)
    model0 = ByteLM(member, **TINY).to(DEV)
    before = _heldout(model0, corpus)
    gaps = gradient_gap(model0, next(corpus.batches(1, BATCH, SEQ, seed=1)), DEV)
    worst = max(gaps, key=gaps.get)
    assert gaps[worst] <= GRAD_RTOL, f"{member}: d{worst} off by {gaps[worst]:.3e} (relative)"
    curves, after = {}, {}
    for backend in ("triton", "reference"):
        model = copy.deepcopy(model0)
        model.set_backend(backend)
        curves[backend] = [r.loss for r in train(model, corpus, steps=STEPS, batch=BATCH,
                                                 seq_len=SEQ, seed=0, device=DEV, lr=LR)]
        after[backend] = _heldout(model, corpus)
    t, r = curves["triton"], curves["reference"]
    assert len(t) == len(r) == STEPS and all(map(math.isfinite, t + r)), curves
    gap = max(abs(a - b) for a, b in zip(t, r))
    assert gap <= LOSS_TOL, f"{member}: curves differ by {gap:.3e} > {LOSS_TOL}: {curves}"
    assert abs(after["triton"] - after["reference"]) <= LOSS_TOL, after
    for backend, h in after.items():
        assert h < before - MIN_DROP, f"{member}/{backend}: held-out {before:.3f} -> {h:.3f}"


@pytest.mark.parametrize("member", list(MEMBERS))
def test_gates_stay_in_the_op_domain(member):
    """log gates <= 0 and finite, whatever the projections produce (large inputs too)."""
    torch.manual_seed(1)
    mixer = FamilyMixer(member, 32, 2, 16, backend="reference")
    x = torch.randn(2, 8, 32) * 100
    g, _ = mixer._gate_and_dt(x, 2, 8)
    if MEMBERS[member].gate is None:
        assert g is None
    else:
        assert g.shape == ((2, 8, 2) if MEMBERS[member].gate == "scalar" else (2, 8, 2, 16))
        assert torch.isfinite(g).all() and (g <= 0).all()


@pytest.mark.parametrize("member", list(MEMBERS))
def test_mixer_is_causal(member):
    """Changing the inputs from position t on leaves every output before t unchanged
    (the short convolution pads on the left only)."""
    torch.manual_seed(2)
    mixer = FamilyMixer(member, 32, 2, 16, backend="reference")
    x = torch.randn(1, 20, 32)
    y = x.clone()
    y[:, 11:] = torch.randn(1, 9, 32)
    a, b = mixer(x), mixer(y)
    assert torch.equal(a[:, :11], b[:, :11])
    assert not torch.allclose(a[:, 11:], b[:, 11:])


def test_mixer_refuses_bad_configuration():
    with pytest.raises(ValueError, match="unknown GDN family member"):
        FamilyMixer("mamba3", 32, 2, 16)
    with pytest.raises(ValueError, match="head_dim"):
        FamilyMixer("deltanet", 32, 2, 8)
    with pytest.raises(ValueError, match="backend"):
        FamilyMixer("deltanet", 32, 2, 16, backend="cuda")


def _tool():
    spec = importlib.util.spec_from_file_location("train_family", ROOT / "tools" / "train_family.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


CLI_TINY = ["--members", "mamba2", "--steps", "2", "--seq-len", "32", "--batch", "1",
            "--d-model", "32", "--layers", "1", "--heads", "2", "--head-dim", "16",
            "--data-bytes", "100000", "--heldout-windows", "2", "--device", DEV]


def test_tool_writes_csv_plot_and_table(tmp_path, capsys):
    assert _tool().main(CLI_TINY + ["--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "losses.csv")))
    assert [(r["backend"], r["step"]) for r in rows] == [
        ("triton", "1"), ("triton", "2"), ("reference", "1"), ("reference", "2")]
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    table = (tmp_path / "summary.md").read_text()
    assert "| mamba2 |" in table and table.rstrip().endswith("| none |")
    assert "| mamba2 |" in capsys.readouterr().out


def test_tool_fails_on_a_nonfinite_loss(tmp_path):
    """A learning rate of 1e30 blows the weights up after one step: the loss goes
    non-finite, the run stops there, and the tool says so and exits 1."""
    assert _tool().main(CLI_TINY + ["--lr", "1e30", "--out", str(tmp_path)]) == 1
    table = (tmp_path / "summary.md").read_text()
    assert "triton at step 2" in table and "reference at step 2" in table


def test_tool_refuses_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _tool().main(["--members", "mamba3", "--out", str(tmp_path)])
    assert e.value.code == 2 and "mamba3" in capsys.readouterr().err
