"""The solution's weights: ``Model``'s loaded into ``ModelNew``, a checkpoint of another seed, and
the reference's float weights.

- ``load_weights``: ``Model``'s parameters and buffers loaded into ``ModelNew``, by name or, where
  they are renamed with the same shapes in the same order, by position; not strictly, what does
  not load keeps its same-seed construction (``seed only``);
- ``load_shared``: ``Model``'s loaded with ``strict=False`` into a ``ModelNew`` that holds every
  one of its names at its shape and names of its own besides (``weights="lenient"``);
- ``trained``: a model's learned values moved off their initial ones, as training does: the
  checkpoint of ``RELOAD_SEED`` that ``weights="reload"`` and ``"lenient"`` load after a first
  forward;
- ``float_weights``: the reference's floating parameters, buffers and tensor attributes, through
  which G07 does not apply (``FLOAT_WEIGHTS``).

``WEIGHTS`` are the ways a target gives the solution its weights (``as_target``'s ``weights``).

Refuses (``WeightsContractError``, raised in the kernel's call): a ``ModelNew`` whose parameters
and buffers do not match ``Model``'s (a name missing or extra, another shape) or that refuses
``Model``'s state_dict, in a strict load; in ``load_shared``, a name of ``Model``'s that
``ModelNew`` lacks at its shape.
"""
from __future__ import annotations

import hashlib

import torch

from kfuzz.kernelbench.source import SEED, KernelBenchPair, pair_module, set_seed

# how the solution gets its weights (``as_target``)
WEIGHTS = ("strict", "seed", "none", "reload", "lenient")
# weights="reload": the seed of the checkpoint loaded after a first forward; weights="lenient":
# of the checkpoint loaded with strict=False (``load_shared``)
RELOAD_SEED = SEED + 1
# why G07 does not apply to a model with float weights (``float_weights``)
FLOAT_WEIGHTS = "outputs depend on float weights the case does not set; no exact answer by construction"


class WeightsContractError(RuntimeError):
    """``ModelNew``'s parameters and buffers do not match ``Model``'s (raised in the kernel's call)."""


def trained(model: torch.nn.Module, seed: int) -> None:
    """Move ``model``'s learned values off their initial ones in place, as training does, so that
    a checkpoint of another seed differs everywhere: each parameter that requires a gradient, and
    each norm layer's running mean, x -> x (1 + u/4) + (v/10) rms(x) (u, v uniform in (-1, 1)
    from ``seed``; rms 1 for an all-zero tensor), and each running variance x -> x (1 + u/4)
    (1 + v/10), which stays positive. BatchNorm starts its weight and variance at 1, its bias
    and mean at 0, whatever the seed: a solution that folds them once would otherwise answer
    right with a stale copy. Other buffers (a causal mask) keep their values."""
    gen = torch.Generator().manual_seed(seed)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)]
    learned = [p for p in model.parameters() if p.requires_grad] + \
        [m.running_mean for m in norms if isinstance(m.running_mean, torch.Tensor)]
    variances = [m.running_var for m in norms if isinstance(m.running_var, torch.Tensor)]
    with torch.no_grad():
        for x, variance in [(x, False) for x in learned] + [(x, True) for x in variances]:
            if not x.is_floating_point() or x.numel() == 0:
                continue
            u, v = (torch.rand(x.shape, generator=gen, dtype=torch.float64) * 2 - 1 for _ in range(2))
            d = x.double()
            moved = d * (1 + u / 4) * (1 + v / 10) if variance else \
                d * (1 + u / 4) + v / 10 * (d.square().mean().sqrt().item() or 1.0)
            x.copy_(moved.to(x.dtype))


def load_weights(model: torch.nn.Module, reference: torch.nn.Module, strict: bool = True) -> str:
    """Load ``reference``'s parameters and buffers into ``model``: ``exact`` (same names), ``by
    position`` (renamed, same shapes in order), or, when ``strict`` is False, ``seed only`` (the
    same-seed construction stays). A parameter missing or extra raises WeightsContractError."""
    want, have = reference.state_dict(), model.state_dict()
    detail = None
    try:
        if set(want) == set(have) and all(want[k].shape == have[k].shape for k in want):
            model.load_state_dict(want, strict=True)
            return "exact"
        if [v.shape for v in want.values()] == [v.shape for v in have.values()]:
            model.load_state_dict(dict(zip(have, want.values())), strict=True)
            return "by position"
    except RuntimeError as e:       # a custom load_state_dict hook that refuses
        detail = f"ModelNew refuses Model's state_dict ({str(e)[:300]})"
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    detail = detail or (f"ModelNew's state_dict does not match Model's: missing {missing[:6]}, extra {extra[:6]}"
                        if missing or extra else "ModelNew's state_dict has the same names with other shapes")
    if strict:
        raise WeightsContractError(detail)
    return f"seed only ({detail})"


def load_shared(model: torch.nn.Module, reference: torch.nn.Module) -> str:
    """Load ``reference``'s parameters and buffers into ``model`` with ``strict=False``, where
    ``model``'s state_dict holds every one of ``reference``'s names at its shape and names of its
    own besides (a user whose strict load fails on those extra names loads this way); the extra
    names keep their construction values. Returns what stayed; a name of ``reference`` missing
    from ``model`` or of another shape raises WeightsContractError."""
    want, have = reference.state_dict(), model.state_dict()
    missing = sorted(k for k in want if k not in have or have[k].shape != want[k].shape)
    if missing:
        raise WeightsContractError(f"Model's {missing[:6]} are not in ModelNew's state_dict at their shapes")
    model.load_state_dict(want, strict=False)
    return f"shared names loaded, ModelNew's own kept: {sorted(set(have) - set(want))[:6]}"


_FLOAT_WEIGHTS: dict[str, tuple[str, ...]] = {}    # sha256 of the reference -> its float weights


def float_weights(pair: KernelBenchPair) -> tuple[str, ...]:
    """The reference ``Model``'s floating parameters, buffers and plain tensor attributes (an
    LSTM's ``h0``), by name, at its own sizes. Their values come from the seed, not from the
    case, so an output that depends on them is exact only by the chance of one summation order:
    G07 does not apply (``FLOAT_WEIGHTS``). Built on the meta device (the CPU where ``__init__``
    needs values), once per reference text in a process."""
    key = hashlib.sha256(pair.ref_code.encode()).hexdigest()
    if key not in _FLOAT_WEIGHTS:
        ref = pair_module(pair, "ref")
        try:
            with torch.device("meta"):
                set_seed(SEED)
                model = ref.Model(*ref.get_init_inputs())
        except Exception:
            set_seed(SEED)
            model = ref.Model(*ref.get_init_inputs())
        names = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point()]
        for prefix, m in model.named_modules():
            names += [f"{prefix}.{k}".lstrip(".") for k, v in vars(m).items()
                      if isinstance(v, torch.Tensor) and v.is_floating_point()]
        _FLOAT_WEIGHTS[key] = tuple(names)
    return _FLOAT_WEIGHTS[key]
