"""GDN_DEVICE_PRODUCTS=1: under Triton's interpreter the GDN kernels' products take a GPU's
operand types, so a CPU run reproduces what a GPU computes (`gdn.common.EXACT_PRODUCTS`)."""
import os
import subprocess
import sys

import pytest
import torch

ONE_TOKEN_BF16 = """
import torch
from kfuzz.target import prepare_triton
prepare_triton()
from gdn.chunk_bwd import chunk_gdn_bwd
bf = torch.bfloat16
one = lambda x, *s: torch.tensor([x]).view(*s)
q, k, v = one(-0.40234375, 1, 1, 1, 1).to(bf), one(-1.0, 1, 1, 1, 1).to(bf), one(-0.3671875, 1, 1, 1, 1).to(bf)
g, beta = one(-0.6890875101089478, 1, 1, 1), one(0.546875, 1, 1, 1).to(bf)
h0, do, dht = one(-4.0, 1, 1, 1, 1), one(3.875, 1, 1, 1, 1).to(bf), one(1.502206802368164, 1, 1, 1, 1)
print(repr(chunk_gdn_bwd(q, k, v, g, beta, do, dht, initial_state=h0)[3].item()))
"""


def under_interpreter(script: str, device_products: bool) -> list[str]:
    """The lines ``script`` prints under Triton's interpreter, with or without the setting."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("GDN_DEVICE_PRODUCTS", None)
    if device_products:
        env["GDN_DEVICE_PRODUCTS"] = "1"
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip().splitlines()


def dg_under_interpreter(device_products: bool) -> float:
    return float(under_interpreter(ONE_TOKEN_BF16, device_products)[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the setting applies under the interpreter")
def test_device_products_reproduce_the_gpus_bf16_gradient():
    """gdn_bwd, bf16, one token (q -0.40234375, k -1, v -0.3671875, g -0.68909, beta 0.546875,
    h0 -4, do 3.875, dht 1.50221): on an H100 dg is 0.04932938516139984, its bf16 products
    rounding a term of a sum that cancels (1.502 + q do = -0.057); the interpreter's exact
    products give 0.0517424 (the oracle's is 0.0517528). With GDN_DEVICE_PRODUCTS=1 the CPU
    gives the H100's value."""
    exact, device = dg_under_interpreter(False), dg_under_interpreter(True)
    assert abs(exact - 0.0517424) < 1e-6, exact
    assert device == pytest.approx(0.04932938516139984, rel=1e-6), device


ONE_TOKEN_CASE = "crashes/gdn_bwd/bound-dg/c13c1afdb6106cc0.case.zst"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the setting applies under the interpreter")
def test_the_gpus_bf16_rounding_of_the_state_gradient_is_within_the_bound():
    """The case above as a campaign drew it: the bf16 product k dS rounds the state gradient
    dht (1.50221 -> 1.5), and the trusted reference rounds the state gradient where its state
    update's products take it (`gdn.reference._RoundGradient`), so its error, and the bound, is
    bf16's there too (without that rounding the H100's dg reads 7.36x the bound). Replayed with
    the GPU's products, it passes."""
    replays_with_device_products(ONE_TOKEN_CASE)


def replays_with_device_products(case: str) -> None:
    """``kfuzz replay`` of the kept case (recorded ``expect: pass``) with the GPU's products."""
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / case
    env = dict(os.environ, GDN_DEVICE_PRODUCTS="1")
    run = subprocess.run([sys.executable, "-c", "from kfuzz.cli import main; main()", "replay", "--device", "cpu",
                          str(path)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "1 as expected" in run.stdout + run.stderr, run.stdout + run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the setting applies under the interpreter")
def test_a_key_decayed_onto_the_fp16_grid_by_luck_does_not_set_the_bound():
    """gdn_fwd_mamba2, fp16, T 31, K 1, V 2, a key of 65504 at token 27 (found by a CPU campaign
    with the GPU's products): the state update's term is 65504 v exp(G_C - G_27). The trusted
    reference decays the key (352.7515, which fp16 holds to 0.0015: ht 2.5e-3 off), the kernel
    the value, whose tf32 rounding costs up to 2^-11 of the term (ht 0.113 off: 2.53x the
    bound). Both placements are honest; the trusted variants with an odd seed decay the values
    (`gdn.reference.chunked`), and the bound is the farther realization's."""
    replays_with_device_products("crashes/gdn_fwd_mamba2/bound-ht/3fc06ed5da8dd193.case.zst")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the setting applies under the interpreter")
def test_a_subnormal_output_gradient_takes_the_exact_path():
    """gdn_bwd, bf16, B1 T17 H1 K=V=1, do among bf16's subnormals, q scaled by 1e4 (an H100
    campaign's B4 T38 H9 K65 V17, minimized with the GPU's products): a tensor core reads do
    as tf32 parts and flushes them, so dh0 = sum of decayed q do^T lost do (12.7x its bound
    here, 4.2x on the H100). The backward's chunk checks hold do, k, v and beta to
    `PRODUCT_MIN` as the forward's hold q, k, v and beta: the chunk takes the exact path."""
    replays_with_device_products("crashes/gdn_bwd/bound-dh0/99d9c1aff981e484.case.zst")


SUBNORMAL_DO = """
from kfuzz.target import prepare_triton
prepare_triton("cpu")
from kfuzz.case import ArgCase, Case, Dist
from kfuzz.execute import execute
from kfuzz.target import get_target
for name in ("gdn_bwd_mamba2", "gdn_bwd_varlen"):
    t = get_target(name)
    dims = {**{k: 1 for k in t.dims}, "T": 17}
    args = {"do": ArgCase(dist=Dist("subnormal")), "g": ArgCase(dist=Dist("shifted")),
            "q": ArgCase(dist=Dist("scaled", (("factor", 10000.0),)))}
    print(name, execute(Case.make(name, "bfloat16", 0, dims, args), t).kind)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the setting applies under the interpreter")
def test_the_family_backward_sends_a_subnormal_output_gradient_to_the_exact_path():
    """The same inputs for the scalar-gate members that share the chunk checks: with the GPU's
    products their dh0 was 6.4x (mamba2) and 12.7x (varlen) off without the checks on do."""
    assert under_interpreter(SUBNORMAL_DO, True)[-2:] == ["gdn_bwd_mamba2 pass", "gdn_bwd_varlen pass"]


TENSOR_CORE_OPERANDS = """
import torch, triton
import triton.language as tl
from kfuzz.target import prepare_triton
prepare_triton()
from gdn.common import fdot

@triton.jit
def product(a, b, out, PREC: tl.constexpr):
    r = tl.arange(0, 16)
    x = tl.load(a + r[:, None] * 16 + r[None, :])
    y = tl.load(b + r[:, None] * 16 + r[None, :])
    tl.store(out + r[:, None] * 16 + r[None, :], fdot(x, y, PREC))

a = torch.zeros(16, 16)
a[:4, 0] = torch.tensor([0.3, 2.0 ** -120 * 1.2345, 2.0 ** -130, 2.0 ** -100 * 1.2345])
eye = torch.eye(16)
for prec in ("tf32x3", "tf32"):
    out = torch.empty(16, 16)
    product[(1,)](a, eye, out, PREC=prec)
    print(prec, *[repr(x) for x in out[:4, 0].tolist()])
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the setting applies under the interpreter")
def test_device_products_lose_the_tf32_parts_a_tensor_core_flushes():
    """A tensor core reads an fp32 operand as tf32 parts and flushes those among fp32's
    subnormals: tf32x3 keeps 0.3 and 1.2345 x 2^-100 whole (their remainders are normal),
    1.2345 x 2^-120 to its high tf32 part only (its remainder is subnormal), and 2^-130 not at
    all; tf32 rounds to 10 fraction bits and flushes 2^-130. Without the setting the
    interpreter's products are exact."""
    def run(device_products):
        lines = under_interpreter(TENSOR_CORE_OPERANDS, device_products)
        return {line.split()[0]: [float(x) for x in line.split()[1:]] for line in lines}
    f32 = lambda x: torch.tensor(x, dtype=torch.float32).item()   # noqa: E731
    exact = [f32(0.3), f32(2.0 ** -120 * 1.2345), f32(2.0 ** -130), f32(2.0 ** -100 * 1.2345)]
    assert run(False)["tf32x3"] == exact
    device = run(True)
    high = torch.tensor(exact[1]).view(torch.int32).bitwise_and(-8192).view(torch.float32).item()
    assert device["tf32x3"] == [exact[0], high, 0.0, exact[3]] and high != exact[1]
    assert device["tf32"][2] == 0.0 and device["tf32"][0] != exact[0] and abs(device["tf32"][0] - 0.3) < 0.3 * 2 ** -11
