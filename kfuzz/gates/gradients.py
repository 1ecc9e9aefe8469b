"""G12 gradients: every differentiable input's gradient within the bound of float64
autograd through the oracle, its NaN/Inf pattern exact.

A target has a backward when its kernel's outputs carry an autograd graph for
inputs that require grad (a torch kernel, or an ``autograd.Function`` around a
Triton forward and backward). The cotangent of each output is drawn from the
case seed. The bound's scale is the trusted implementation's gradient at the
kernel's precision, against the same float64 autograd.

Reports n/a for a target whose kernel returns outputs without a graph (no backward),
and for a target with no differentiable floating-point argument.
"""
from __future__ import annotations

import numpy as np
import torch

from kfuzz.compare import BOUND_C, compare
from kfuzz.execute import _storage_bytes, as_outputs, call_kernel
from kfuzz.gates.base import Gate, float_args, gate_seed, make_case, nominal_dims
from kfuzz.case import ArgCase
from kfuzz.tensors import materialize, rng_for
from kfuzz.verdict import Verdict


def differentiable(target, dtype: str) -> list[str]:
    return [n for n in float_args(target, dtype) if target.args[n].differentiable]


def _leaves(inputs, names, dtype=None):
    out = {}
    for k, v in inputs.items():
        v = v.detach()
        if k in names:
            v = (v.to(dtype) if dtype is not None else v.clone()).requires_grad_(True)
        out[k] = v
    return out


def cotangents(target, case, dims) -> dict[str, torch.Tensor]:
    cots = {}
    for name, spec in target.outputs.items():
        shape = target.shape_of(spec.shape, dims)
        values = rng_for(case.seed, f"cotangent:{name}").standard_normal(shape)
        cots[name] = torch.from_numpy(np.ascontiguousarray(values))
    return cots


def _grads(outputs, leaves, names, cots):
    outs, gs = [], []
    for name, out in outputs.items():
        if out.requires_grad:
            outs.append(out)
            gs.append(cots[name].to(out.dtype).to(out.device))
    grads = torch.autograd.grad(outs, [leaves[n] for n in names], gs, allow_unused=True)
    return dict(zip(names, grads))


class Gradients(Gate):
    id, name, tolerance_free = "G12", "gradients", False
    property = ("every differentiable input's gradient within the bound of float64 autograd on the oracle; "
                "its NaN/Inf pattern exact")

    def not_applicable(self, target):
        if not any(differentiable(target, dt) for dt in target.dtypes):
            return "no differentiable floating-point argument"
        case = next(iter(self.cases(target, 0)))
        inputs = materialize(case, target)
        names = differentiable(target, case.dtype)
        with torch.enable_grad():
            outputs, verdict = call_kernel(target, case, _leaves(inputs, names), torch.device("cpu"))
        if verdict is not None:
            return None          # the gate's own cases will report the failure
        if not any(o.requires_grad for o in outputs.values()):
            return "the kernel has no backward (its outputs carry no autograd graph)"
        return None

    def cases(self, target, seed):
        dims = nominal_dims(target)
        i = 0
        for dtype in target.dtypes:
            for _ in range(2):
                yield make_case(target, dtype, gate_seed(seed, self.id, i), dims)
                i += 1
            first = differentiable(target, dtype)[0]
            yield make_case(target, dtype, gate_seed(seed, self.id, i), dims,
                            {first: ArgCase(inject=((target.numel(first, dims) // 3, "nan"),))})
            i += 1

    def check(self, target, case, device="cpu", c=BOUND_C):
        dev = torch.device(device)
        inputs = materialize(case, target, dev)
        names = differentiable(target, case.dtype)
        cots = cotangents(target, case, case.dim)
        leaves = _leaves(inputs, names)
        snapshot = {k: _storage_bytes(v) for k, v in leaves.items()}
        with torch.enable_grad():
            outputs, verdict = call_kernel(target, case, leaves, dev)
            if verdict is not None:
                return verdict
            if not any(o.requires_grad for o in outputs.values()):
                return Verdict(target.name, "contract", detail="outputs carry no autograd graph: no backward")
            try:
                kernel = _grads(outputs, leaves, names, cots)
            except Exception as e:
                return Verdict(target.name, "exception", detail=f"backward: {type(e).__name__}: {e}"[:2000],
                               exc_type=type(e).__name__, frame="backward")
            for name, t in leaves.items():
                if not torch.equal(_storage_bytes(t), snapshot[name]):
                    return Verdict(target.name, "mutation", output=name,
                                   detail=f"input {name!r} changed during the forward or backward call")
            wide = _leaves(inputs, names, torch.float64)
            oracle = _grads(as_outputs(target.reference(**wide), target), wide, names, cots)
            low = _leaves(inputs, names)
            trusted_out = as_outputs(target.call_trusted(low), target)
            trusted = _grads(trusted_out, low, names, cots)
        worst, metrics = 0.0, {}
        for name in names:
            want = oracle[name] if oracle[name] is not None else torch.zeros_like(wide[name])
            got = kernel[name]
            if got is None:
                if bool((want != 0).any()):
                    return Verdict(target.name, "bound", output=f"grad.{name}",
                                   detail=f"no gradient for {name!r}, the oracle's is nonzero")
                continue
            tr = trusted[name]
            f = compare(got, want, tr if tr is not None else None,
                        target.arg_dtype(name, case.dtype), c * target.bound_scale)
            metrics.update({f"grad.{name}.{k}": v for k, v in f.metrics})
            if f.kind is not None:
                return Verdict(target.name, f.kind, output=f"grad.{name}", detail=f.detail,
                               ratio=f.ratio, metrics=metrics)
            worst = max(worst, f.ratio)
        return Verdict(target.name, "pass", ratio=worst, metrics=metrics)
