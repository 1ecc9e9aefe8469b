"""The GDN family as kfuzz targets: ``gdn_fwd*`` (forward) and ``gdn_bwd*`` (gradients).

Members (DESIGN.md, "GDN family"), one target each, named by suffix:

| suffix      | gate              | delta | member                     |
| ----------- | ----------------- | ----- | -------------------------- |
| (none)      | scalar [B,T,H]    | on    | Gated DeltaNet             |
| ``_delta``  | none              | on    | DeltaNet                   |
| ``_kda``    | vector [B,T,H,K]  | on    | KDA (per-key gate + delta) |
| ``_mamba2`` | scalar            | off   | Mamba2-SSD-style decay     |
| ``_gla``    | vector            | off   | GLA                        |
| ``_linear`` | none              | off   | linear attention           |
| ``_varlen`` | scalar            | on    | Gated DeltaNet, N sequences packed by cu_seqlens |

Domain rules (applied before injection, so injections may still break them on
purpose): gates in log space, g = -softplus(x) <= 0 (an injected -inf is a
complete forget, exp(g) = 0); beta = sigmoid(x) in (0, 1); keys L2-normalized
over K. The initial state is float32, as is the final state.

The oracle is ``gdn.oracle.recurrence`` (float64, step by step), and for the
backward targets float64 autograd through it; it is evaluated by
``gdn.oracle_fast.fast_recurrence``, the same values to float64 rounding by a chunked
closed form where the inputs are finite and in the domain, step by step elsewhere (and
wherever a gradient comes out non-finite). The trusted implementation is
``gdn.reference.chunked`` at the kernel's own precision and chunk length
(`gdn.common.chunk_tokens`: the state crosses each chunk boundary in float32 in
both): float32 arithmetic with every matrix product's operands rounded to the
input dtype (bf16/fp16), as a GPU's matrix units see them, and for gradients torch autograd through it with
the gradients rounded the same way; for bf16 the gate's gradient through a chunk's decay of its
entering state sees that state as the kernels store it between launches, in bf16
(`gdn.reference._DecayStored`).
The backward kernel is ``gdn.op.gdn_attention``'s Triton backward: cotangents
``do`` (of o) and ``dht`` (of the final state) are arguments of the case.

The forward's state pass is autotuned for users; the kernels here run with ``CONFIG``, whose
``state_pick`` is "spread" (`gdn.config`), passed on every call: each shape takes one of the
tuner's configs, picked from the autotune key (the first, in an order the key's CRC starts,
that fits the GPU), so that a case runs the same config in every process (a failure replays
and minimizes; a timing-picked config need not come back), compiles one config instead of all
of them, and a campaign's shapes exercise every config.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from gdn.config import DEFAULT
from gdn.oracle import recurrence
from gdn.oracle_fast import fast_recurrence
from gdn.reference import chunked
from kfuzz.schedule import integer_key
from kfuzz.target import Arg, Dim, Output, add_target, Target

# the kernels' launch choices: deterministic per shape ("spread"), so a case replays
CONFIG = dataclasses.replace(DEFAULT, state_pick="spread")
CONTIGUOUS_ONLY = ("contiguous",)
# G07 (accumulation) is n/a: the domain sends every case value through softplus, sigmoid or
# the L2 normalization of the keys, so no output is exact by construction, and where the
# float64 oracle's value happens to be representable and the trusted implementation happens
# to round to it, a kernel with another (right) order of operations is one ulp off (e.g.
# gdn_bwd, fp32 B4 T4 H16 K=V=256, smallint inputs: 2 of 4391424 gradient entries
# qualified, dv 1.1567103862762451 against 1.1567105054855347)
NO_EXACT_ANSWERS = ("the domain maps every case value through softplus, sigmoid or L2 "
                    "normalization, so no output is exact by construction (an output the oracle "
                    "gives exactly is exact by the luck of one order of operations)")

# The chunked kernels and the trusted chunked reference are different algorithms, so the
# honest kernel's error can be ~10-20x the trusted one's: in a sweep of 40 random plain cases
# of gdn_bwd on the CPU the largest error/bound ratio at C = 8 was 1.22 (fp32, K = 1, dg), and
# a random campaign minimized a case to 2.25 (fp32, K = 1, T = 48, dk). C = 8 * 4 = 32 passes
# both (0.31, 0.56); an fp16 running total or a dropped term is off by orders more.
# `tools/calibrate.py --family gdn` (docs/calibration.md; seeds 0-2, G01-G04 and G12 on gdn_fwd,
# gdn_bwd, gdn_fwd_kda, ratios against C x 4 = 32) puts every cell at most 0.524 (G03). The
# real bugs the bound catches (crashes/gdn_*/bound-*) read 1.09 (dv), 2.02 (dg), 2.29 (ht),
# 27.5 (dq) and more: a scale of 8 would miss the first, 10 three of them. 4 keeps a margin of
# about 2x on either side.
BOUND_SCALE = 4.0

# Where an output fails the bound, the trusted reference runs again with its operand roundings
# stochastic, from these many seeds (kfuzz's trusted variants; at fp32 each operand moved within
# its rounding's half unit first, `gdn.reference.round_to`; an odd seed puts a scalar gate's
# in-chunk decay of the state update on the values, as the kernels do, not the keys, one of
# which can land on its dtype's grid by luck): on an output of one or two elements
# its roundings to nearest can cancel (gdn_bwd_kda dg, bf16 one token, V 16: 2.2e-5 from the
# oracle, where the kernel's two roundings, h0 and v_new, leave 7.2e-4 and four stochastic
# realizations 1.1e-4 to 1.2e-2; gdn_bwd_kda dbeta, fp32, one finite element, a state the
# chunk's transitions shrink 4e7x below its decay: the nearest roundings 1.5e-15 from the
# oracle, 32 fp32 realizations 4.1e-15 to 1.6e-13 off, the kernel 8.7e-14; gdn_bwd dh0, bf16,
# B=T=H=K=V=1: the kernel's W = beta exp(g) k stored in bf16 leaves 5.95e-4, the roundings to
# nearest 7.4e-6 (W's rounding up and the state gradient's rounding down cancel), and seeds 0-3
# all land there too, while 12 of seeds 4-31 land 1.95e-3 to 3.9e-3 off).  A kernel as close as
# the farthest of them passes.  Each runs only where an output fails the bound.
TRUSTED_VARIANTS = 16

MEMBERS = {  # suffix: (gate, delta)
    "": ("scalar", True), "_delta": (None, True), "_kda": ("vector", True),
    "_mamba2": ("scalar", False), "_gla": ("vector", False), "_linear": (None, False),
}


def _dims(varlen: bool) -> dict[str, Dim]:
    # cpu_hi: the Triton interpreter runs a T=64, K=V=32 backward in seconds, not minutes
    dims = {"B": Dim(1, 1 if varlen else 4, cpu_hi=2), "T": Dim(1, 8192, cpu_hi=64),
            "H": Dim(1, 16, cpu_hi=2), "K": Dim(1, 256, cpu_hi=32), "V": Dim(1, 256, cpu_hi=32)}
    if varlen:
        dims["N"] = Dim(1, 64, cpu_hi=3)
    return dims


# the float64 recurrence's work, B*T*H*K*V, past which a drawn case is kept with the chance
# JUDGE_WORK / work (``Target.keep_chance``): drawn without it at the GPU's sizes, the 3.9% of the
# draws over 1e8 hold 86% of the draws' summed work, the 0.5% over 1e9 half of it; the CPU's
# sizes (cpu_hi) stay under it, every draw kept
JUDGE_WORK = 1e8


def keep(dims: dict[str, int]) -> float:
    """The chance that the random engine keeps a draw at ``dims`` (see JUDGE_WORK)."""
    return min(1.0, JUDGE_WORK / (dims["B"] * dims["T"] * dims["H"] * dims["K"] * dims["V"]))


def specialization(dims: dict[str, int], dtype: str, layouts: dict[str, str]) -> tuple:
    """The kernels' JIT specialization at ``dims`` (``kfuzz.schedule``): the dtype; K and V
    (tile widths, and the state pass's config, picked from its autotune key); H (a constexpr
    of the forward's kernels); the sequence-heads rounded up to a power of 2 (in that key);
    and for each integer the kernels take (T, B*T, the sequences, the 16- and 64-token chunk
    counts of a sequence and of the batch) whether it is 1 or a multiple of 16, as Triton
    specializes it. Other T and B run kernels already compiled; so do other ``layouts`` (the
    op copies an input that is not contiguous). With ``cu_seqlens`` the batch's chunk count
    follows the sequences' lengths, which no dim gives: a varlen campaign can meet a new
    specialization within a key (counted as a miss, docs/campaign.md)."""
    T, H, B = dims["T"], dims["H"], dims["B"]
    n = dims.get("N", B)
    counts = (T, B * T, n, -(-T // 16), -(-T // 64), B * -(-T // 16), B * -(-T // 64))
    return (dtype, dims["K"], dims["V"], H, 1 << max(0, n * H - 1).bit_length(), tuple(map(integer_key, counts)))


def _args(gate, delta, varlen, backward) -> dict[str, Arg]:
    nstate = "N" if varlen else "B"
    args = {"q": Arg(("B", "T", "H", "K")), "k": Arg(("B", "T", "H", "K")), "v": Arg(("B", "T", "H", "V"))}
    if gate == "scalar":
        args["g"] = Arg(("B", "T", "H"), dtype="float32")
    elif gate == "vector":
        args["g"] = Arg(("B", "T", "H", "K"), dtype="float32")
    if delta:
        args["beta"] = Arg(("B", "T", "H"))
    args["h0"] = Arg((nstate, "H", "K", "V"), dtype="float32")
    if varlen:
        args["cu_seqlens"] = Arg(("N+1",), dtype="int64", layouts=CONTIGUOUS_ONLY, differentiable=False,
                                 specials=False)
    if backward:
        args["do"] = Arg(("B", "T", "H", "V"), differentiable=False)
        args["dht"] = Arg((nstate, "H", "K", "V"), dtype="float32", differentiable=False)
    return args


def domain(x: dict[str, torch.Tensor], dims: dict[str, int]) -> dict[str, torch.Tensor]:
    out = dict(x)
    if "g" in x:
        out["g"] = -F.softplus(x["g"])
    if "beta" in x:
        out["beta"] = torch.sigmoid(x["beta"])
    norm = x["k"].norm(dim=-1, keepdim=True)
    out["k"] = torch.where(norm > 0, x["k"] / norm, x["k"])
    if "cu_seqlens" in x:
        out["cu_seqlens"] = cut_points(x["cu_seqlens"], dims["T"])
    return out


def cut_points(u: torch.Tensor, T: int) -> torch.Tensor:
    """N + 1 sorted offsets from 0 to T, from N + 1 drawn numbers (empty sequences allowed)."""
    inner = torch.sort((torch.sigmoid(u[1:-1]) * T).floor()).values if u.numel() > 2 else u[:0]
    return torch.cat([u.new_zeros(1), inner, u.new_full((1,), float(T))])


def _call(fn, x, delta, **kw):
    return fn(x["q"], x["k"], x["v"], x.get("g"), x.get("beta"), initial_state=x["h0"],
              output_final_state=True, cu_seqlens=x.get("cu_seqlens"), delta=delta, **kw)


def _grads(fn, x, delta, wide=None):
    """Gradients of (o, final state) against (do, dht) by torch autograd through ``fn``."""
    names = [n for n in ("q", "k", "v", "g", "beta", "h0") if n in x]
    leaves = {n: (x[n].to(wide) if wide and x[n].is_floating_point() and x[n].element_size() < 4 else x[n])
              .detach().clone().requires_grad_(True) for n in names}
    with torch.enable_grad():
        o, ht = _call(fn, {**x, **leaves}, delta)
        grads = torch.autograd.grad((o, ht), [leaves[n] for n in names],
                                    (x["do"].to(o.dtype), x["dht"].to(ht.dtype)), allow_unused=True)
    return tuple(torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(names, grads))


def _oracle_grads(x, delta):
    """The float64 gradients, by the closed form where it applies; step by step where they
    are not all finite (the NaN/Inf pattern is the definition's)."""
    grads = _grads(fast_recurrence, x, delta)
    if all(bool(torch.isfinite(t).all()) for t in grads):
        return grads
    return _grads(recurrence, x, delta)


def _same_precision(x, variant=None):
    """The chunked reference with matrix operands rounded to the kernel's dtype, at the
    kernels' chunk length (where the state is handed over in fp32); ``variant`` i: those
    roundings stochastic, from seed i (kfuzz's trusted variants)."""
    from gdn.common import chunk_tokens
    vector = x.get("g") is not None and x["g"].dim() == 4
    return functools.partial(chunked, operand_dtype=x["q"].dtype, chunk_size=chunk_tokens(vector),
                             rounding_seed=variant)


def _register(suffix: str, gate, delta, varlen: bool) -> None:
    from gdn.op import gdn_attention

    fwd_outputs = {"o": Output(("B", "T", "H", "V")),
                   "ht": Output(("N" if varlen else "B", "H", "K", "V"), dtype="float32")}
    grad_names = [n for n in ("q", "k", "v", "g", "beta", "h0") if n in _args(gate, delta, varlen, False)]
    bwd_outputs = {f"d{n}": Output(_args(gate, delta, varlen, False)[n].shape,
                                   _args(gate, delta, varlen, False)[n].dtype) for n in grad_names}
    dims = _dims(varlen)
    member = f"gate={gate or 'none'}, delta={'on' if delta else 'off'}" + (", varlen" if varlen else "")

    kernel_op = functools.partial(gdn_attention, config=CONFIG)

    def fwd_kernel(**x):
        o, ht = _call(kernel_op, x, delta)
        return o, ht

    def bwd_kernel(**x):
        return _grads(kernel_op, x, delta)

    for name, kernel, reference, trusted, outputs, backward in (
        (f"gdn_fwd{suffix}", fwd_kernel, lambda **x: _call(fast_recurrence, x, delta),
         lambda variant=None, **x: _call(_same_precision(x, variant), x, delta), fwd_outputs, False),
        (f"gdn_bwd{suffix}", bwd_kernel, lambda **x: _oracle_grads(x, delta),
         lambda variant=None, **x: _grads(_same_precision(x, variant), x, delta, wide=torch.float32),
         bwd_outputs, True),
    ):
        args = _args(gate, delta, varlen, backward)
        t = Target(name=name, kernel=kernel, reference=reference, trusted=trusted, args=args,
                   outputs=outputs, dims=dict(dims), domain=domain, bound_scale=BOUND_SCALE,
                   trusted_variants=TRUSTED_VARIANTS,
                   description=f"GDN family {'backward' if backward else 'forward'} ({member}), Triton",
                   options={"no_exact_answers": NO_EXACT_ANSWERS, "specialization": specialization,
                            "keep": keep})
        add_target(t)


for _suffix, (_gate, _delta) in MEMBERS.items():
    _register(_suffix, _gate, _delta, varlen=False)
_register("_varlen", "scalar", True, varlen=True)
