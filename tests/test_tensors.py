"""Materialization: deterministic bits, layouts, per-dtype special values, domain rules."""
import math

import pytest
import torch

from kfuzz.case import ArgCase, Case, Dist, Layout, encode
from kfuzz.corpus import load_checked
from kfuzz.dtypes import special_value_table
from kfuzz.errors import CaseError, KfuzzError
from kfuzz.target import check_storage, get_target
from kfuzz.tensors import decode_payload, encode_payload, lay_out, materialize, raw_bytes

SOFTMAX = get_target("softmax")


def make(dtype="float32", dims=None, **arg):
    return Case.make("softmax", dtype, 7, dims or {"N": 5, "D": 9}, {"x": ArgCase(**arg)})


def bits(t):
    return t.contiguous().view(torch.uint8 if t.element_size() == 1 else torch.int16 if t.element_size() == 2
                               else torch.int32 if t.element_size() == 4 else torch.int64)


def test_same_case_same_bits_and_seed_changes_them():
    a = materialize(make(dtype="bfloat16"), SOFTMAX)["x"]
    b = materialize(make(dtype="bfloat16"), SOFTMAX)["x"]
    assert torch.equal(bits(a), bits(b))
    c = materialize(make(dtype="bfloat16").with_(seed=8), SOFTMAX)["x"]
    assert not torch.equal(a, c)


def test_known_values_pin_the_stream():
    # PCG64 from numpy: if this changes, old corpus cases no longer mean what they meant
    x = materialize(make(), SOFTMAX)["x"]
    assert x.dtype == torch.float32
    assert x.reshape(-1)[:3].tolist() == pytest.approx(_first_three(), rel=1e-6)


def _first_three():
    import numpy as np, zlib
    rng = np.random.Generator(np.random.PCG64([7, zlib.crc32(b"x")]))
    return rng.standard_normal(3).tolist()


@pytest.mark.parametrize("layout, check", [
    (Layout("permuted", perm=(1, 0)), lambda t: t.stride() == (1, 5)),
    (Layout("strided", step=(2, 3)), lambda t: t.stride() == (54, 3)),
    (Layout("offset", offset=5), lambda t: t.storage_offset() == 5),
    (Layout("expanded", dims=(0,)), lambda t: t.stride()[0] == 0),
])
def test_layouts_keep_logical_values(layout, check):
    plain = materialize(make(), SOFTMAX)["x"]
    laid = materialize(make(layout=layout), SOFTMAX)["x"]
    assert check(laid) and laid.shape == plain.shape
    if layout.kind == "expanded":
        assert torch.equal(laid, plain[:1].expand_as(plain))
    else:
        assert torch.equal(laid, plain)


def test_storage_outside_the_view_is_nan():
    t = materialize(make(layout=Layout("strided", step=(1, 2))), SOFTMAX)["x"]
    storage = torch.empty(0).set_(t.untyped_storage())
    assert torch.isnan(storage).sum() == t.numel()   # every gap element is NaN


@pytest.mark.parametrize("dtype, name, expected", [
    ("float16", "max", 65504.0), ("bfloat16", "max", 3.3895313892515355e38),
    ("float16", "subnormal", 2.0 ** -24), ("bfloat16", "subnormal", 2.0 ** -133),
    ("float32", "tiny", 2.0 ** -126), ("float16", "-inf", -math.inf),
])
def test_injection_uses_the_dtype_table(dtype, name, expected):
    x = materialize(make(dtype=dtype, inject=((4, name),)), SOFTMAX)["x"]
    assert x.reshape(-1)[4].item() == expected


def test_fp8_e4m3_has_no_inf():
    table = special_value_table("float8_e4m3fn")
    assert table["inf"] is None and table["max"] == 448.0


def test_negative_zero_keeps_its_sign():
    x = materialize(make(inject=((0, "-0"),)), SOFTMAX)["x"]
    assert math.copysign(1.0, x.reshape(-1)[0].item()) == -1.0


def test_injection_into_expanded_dim_lands_on_the_stored_copy():
    x = materialize(make(layout=Layout("expanded", dims=(0,)), inject=((9 * 3 + 2, "nan"),)), SOFTMAX)["x"]
    assert torch.isnan(x[:, 2]).all() and torch.isnan(x).sum() == 5


@pytest.mark.parametrize("dist, check", [
    (Dist("ones"), lambda x: (x == 1).all()),
    (Dist("binary01"), lambda x: ((x == 0) | (x == 1)).all()),
    (Dist("smallint"), lambda x: (x == x.round()).all() and x.abs().max() <= 4),
    (Dist("uniform01"), lambda x: ((x >= 0) & (x < 1)).all()),
    (Dist("nearmax"), lambda x: (x.abs() >= 65504 / 2).all() and x.isfinite().all()),
    (Dist("subnormal"), lambda x: (x.abs() < 2.0 ** -14).all() and (x != 0).all()),
])
def test_distributions(dist, check):
    assert check(materialize(make(dtype="float16", dims={"N": 8, "D": 64}, dist=dist), SOFTMAX)["x"].double())


def test_payload_replaces_generation():
    t = torch.arange(45, dtype=torch.float32).reshape(5, 9)
    case = Case.make("softmax", "float32", 0, {"N": 5, "D": 9}, payload={"x": encode_payload(t)})
    assert torch.equal(materialize(case, SOFTMAX)["x"], t)
    bad = Case.make("softmax", "float32", 0, {"N": 4, "D": 9}, payload={"x": encode_payload(t)})
    with pytest.raises(CaseError, match="payload for 'x'"):
        materialize(bad, SOFTMAX)


@pytest.mark.parametrize("case, message", [
    (Case.make("softmax", "float64", 0, {"N": 1, "D": 1}), "dtype 'float64' not admitted"),
    (Case.make("softmax", "float32", 0, {"N": 0, "D": 1}), "dim N=0 outside the contract"),
    (Case.make("softmax", "float32", 0, {"N": 1}), "dims"),
    (Case.make("softmax", "float32", 0, {"N": 2, "D": 2}, {"y": ArgCase(dist=Dist("ones"))}), "unknown argument 'y'"),
    (Case.make("softmax", "float32", 0, {"N": 2, "D": 2}, {"x": ArgCase(inject=((4, "nan"),))}), "outside argument"),
    (Case.make("softmax", "float32", 0, {"N": 2, "D": 2}, {"x": ArgCase(Layout("permuted", perm=(0, 0)))}), "not a permutation"),
])
def test_contract_refusals(case, message):
    with pytest.raises(CaseError, match=message):
        SOFTMAX.validate(case)


# the storage budget: refused from the shapes and layouts, before anything is allocated ------

def _payload(shape, data):
    return {"x": {"dtype": "float32", "shape": list(shape), "data": data}}


@pytest.mark.parametrize("case, message", [
    (make(layout=Layout("offset", offset=10**9)), r"spans 1000000045 storage elements; its contract admits at most"),
    (make(layout=Layout("strided", step=(10**5, 10**5))), "spans 450000000000 storage elements"),
    (make(dims={"N": 64, "D": 512}, layout=Layout("strided", step=(1, 17))), "its contract admits at most 528384"),
    (Case.make("softmax", "float32", 0, {"N": 4, "D": 4}, payload=_payload((4, 4), "AAAA")),
     "holds 4 base64 characters, \\[4, 4\\] float32 takes 88"),
    (Case.make("softmax", "float32", 0, {"N": 4, "D": 4}, payload=_payload((10**6, 10**6), "AAAA")),
     "payload for 'x' is \\[1000000, 1000000\\] float32, the contract wants \\[4, 4\\]"),
], ids=["offset", "strided", "step-past-room", "short-payload", "payload-shape"])
def test_layouts_and_payloads_past_the_contract_are_refused(case, message):
    with pytest.raises(CaseError, match=message):
        SOFTMAX.validate(case)


def test_the_contract_admits_kfuzzs_own_widest_layouts():
    """Steps of 3 on every dim and an offset of 17 (the most kfuzz's engines draw), at every
    dim's largest size, fit the room the contract gives; steps of 5 do not."""
    for name in ("softmax", "matmul", "gdn_bwd"):
        target = get_target(name)
        dims = {d: spec.hi for d, spec in target.dims.items()}
        for layout in ("strided", "offset"):
            args = {a: ArgCase(Layout("strided", step=(3,) * len(arg.shape)) if layout == "strided"
                               else Layout("offset", offset=17))
                    for a, arg in target.args.items() if layout in arg.layouts}
            target.validate(Case.make(name, target.dtypes[0], 0, dims, args))
        wider = {a: ArgCase(Layout("strided", step=(5,) * len(arg.shape)))
                 for a, arg in target.args.items() if "strided" in arg.layouts}
        with pytest.raises(CaseError, match="its contract admits at most"):
            target.validate(Case.make(name, target.dtypes[0], 0, dims, wider))


def test_the_global_cap_refuses_a_case_read_from_a_file_and_names_how_to_raise_it(tmp_path, monkeypatch):
    case = make(dims={"N": 64, "D": 512})           # 32768 elements: 128 KiB, drawn in float64 256 KiB
    assert check_storage(case, SOFTMAX) == 393216
    path = tmp_path / "big.case.zst"
    path.write_bytes(encode(case))
    load_checked(path)
    monkeypatch.setenv("KFUZZ_MAX_CASE_BYTES", "256K")
    SOFTMAX.validate(case)                          # the contract admits it; the cap is for what is read
    with pytest.raises(CaseError, match=r"big.case.zst: .* takes 384.0 KiB \(393216 bytes\), over the cap of "
                                        "256.0 KiB.*set KFUZZ_MAX_CASE_BYTES to raise it"):
        load_checked(path)
    monkeypatch.setenv("KFUZZ_MAX_CASE_BYTES", "lots")
    with pytest.raises(KfuzzError, match="KFUZZ_MAX_CASE_BYTES='lots' is not a size"):
        load_checked(path)


def test_span_is_what_lay_out_allocates():
    values = torch.zeros(5, 9)
    for layout in (Layout(), Layout("permuted", perm=(1, 0)), Layout("strided", step=(2, 3)),
                   Layout("offset", offset=17), Layout("expanded", dims=(0,)), Layout("expanded", dims=(1,))):
        held = lay_out(values, layout).untyped_storage().nbytes() // 4
        assert held <= layout.span((5, 9)), layout
        assert held == layout.span((5, 9)) or layout.kind == "expanded", layout


def test_raw_bytes_and_payloads_take_any_strides_a_layout_gives():
    # a size-1 dim keeps its stride through contiguous(): a case's strided layout at size 1
    # (gdn_bwd, beta step [1, 1, 3] at B=T=H=1) ended every GPU call's output check in a RuntimeError
    one = torch.tensor([1.5, 2.0, 3.0])[::3]
    assert one.stride() == (3,) and one.is_contiguous()
    assert torch.equal(raw_bytes(one), torch.tensor([1.5]).view(torch.uint8))
    nan = torch.tensor([float("nan"), -0.0, 7.0]).view(torch.int32)
    nan[0] |= 0x1234                                    # a NaN payload
    grid = torch.stack([nan.view(torch.float32)] * 2)[:, ::2]
    assert torch.equal(raw_bytes(grid), grid.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8))
    back = decode_payload(encode_payload(one), "x")
    assert back.shape == one.shape and torch.equal(raw_bytes(back), raw_bytes(one))


def test_a_0d_argument_is_drawn_0d_and_injected_there():
    """A scalar argument (shape ()) is drawn as a 0-d tensor, with the same value as the first
    element of a one-element draw from the same stream, and takes an injection at flat 0."""
    import dataclasses
    from kfuzz.target import Arg
    scaled = dataclasses.replace(SOFTMAX, args={**SOFTMAX.args, "s": Arg(shape=())})
    one = dataclasses.replace(SOFTMAX, args={**SOFTMAX.args, "s": Arg(shape=(1,))})
    case = Case.make("softmax", "float32", 7, {"N": 5, "D": 9}, {})
    s, s1 = materialize(case, scaled)["s"], materialize(case, one)["s"]
    assert s.shape == () and s1.shape == (1,) and torch.equal(s.reshape(1), s1)
    nan = Case.make("softmax", "float32", 7, {"N": 5, "D": 9}, {"s": ArgCase(inject=((0, "nan"),))})
    assert math.isnan(float(materialize(nan, scaled)["s"]))
