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

from kfuzz.case import ArgCase
from kfuzz.compare import BOUND_C, compare
from kfuzz.execute import as_outputs, comparison_device, lazy_outputs, without_specials
from kfuzz.executor import executor_for
from kfuzz.gates.base import Gate, float_args, gate_seed, make_case, nominal_dims
from kfuzz.programs import Program, changed_input, grads, leaves, malformed, replicate
from kfuzz.tensors import materialize, rng_for
from kfuzz.verdict import Verdict


def differentiable(target, dtype: str) -> list[str]:
    return [n for n in float_args(target, dtype) if target.args[n].differentiable]


def cotangents(target, case, dims) -> dict[str, torch.Tensor]:
    cots = {}
    for name, spec in target.outputs.items():
        shape = target.shape_of(spec.shape, dims)
        values = rng_for(case.seed, f"cotangent:{name}").standard_normal(shape)
        cots[name] = torch.from_numpy(np.ascontiguousarray(values))
    return cots


class Gradients(Gate):
    id, name, tolerance_free = "G12", "gradients", False
    property = ("every differentiable input's gradient within the bound of float64 autograd on the oracle; "
                "its NaN/Inf pattern exact")

    def not_applicable(self, target, executor=None):
        if not any(differentiable(target, dt) for dt in target.dtypes):
            return "no differentiable floating-point argument"
        case = next(iter(self.cases(target, 0)))
        r = executor_for(target, "cpu", executor).run(Program(
            "backward", case, {"case": materialize(case, target)},
            {"names": differentiable(target, case.dtype), "probe": True}))
        if r.verdict is not None:
            return None          # the gate's own cases will report the failure
        if r.facts.get("graph") is False:
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

    def check(self, target, case, device="cpu", c=BOUND_C, executor=None):
        inputs = materialize(case, target)
        names = differentiable(target, case.dtype)
        cots = cotangents(target, case, case.dim)
        r = executor_for(target, device, executor).run(
            Program("backward", case, {"case": inputs, "cotangents": cots}, {"names": names}))
        verdict = r.verdict or changed_input(target.name, inputs, r.outputs.get("after:case", {}))
        if verdict is not None:
            return verdict
        if r.facts.get("graph") is False:
            return Verdict(target.name, "contract", detail="outputs carry no autograd graph: no backward")
        kernel = r.outputs.get("grads", {})
        for name, g in kernel.items():
            if name not in names or tuple(g.shape) != tuple(inputs[name].shape):
                return malformed(target.name, f"the kernel side returned a gradient {name!r} of shape "
                                              f"{list(g.shape)}, not one of {names} in its argument's shape")
        # the oracle's and the trusted implementation's gradients where the kernel ran
        here = inputs if device == "cpu" else {k: replicate(v, device) for k, v in inputs.items()}
        with torch.enable_grad():
            wide = leaves(here, names, torch.float64)
            oracle = grads(as_outputs(target.reference(**wide), target), wide, names, cots)
            low = leaves(here, names)
            trusted = grads(as_outputs(target.call_trusted(low), target), low, names, cots)
        clean = without_specials(here)

        def clean_grads():   # the trusted gradients on the inputs without their NaN and Inf
            with torch.enable_grad():
                low = leaves(clean, names)
                got = grads(as_outputs(target.call_trusted(low), target), low, names, cots)
            return {n: torch.zeros_like(low[n]) if g is None else g for n, g in got.items()}
        clean_of = lazy_outputs(clean_grads) if clean is not None else None
        worst, metrics = 0.0, {}
        where = comparison_device({n: g for n, g in oracle.items() if g is not None}, device)
        for name in names:
            want = oracle[name] if oracle[name] is not None else torch.zeros_like(wide[name])
            got = kernel.get(name)
            if got is None:
                if bool((want != 0).any()):
                    return Verdict(target.name, "bound", output=f"grad.{name}",
                                   detail=f"no gradient for {name!r}, the oracle's is nonzero")
                continue
            tr = trusted[name]
            f = compare(got, want, tr if tr is not None else None,
                        target.arg_dtype(name, case.dtype), c * target.bound_scale,
                        clean_of and clean_of(name), device=where)
            metrics.update({f"grad.{name}.{k}": v for k, v in f.metrics})
            if f.kind is not None:
                return Verdict(target.name, f.kind, output=f"grad.{name}", detail=f.detail,
                               ratio=f.ratio, metrics=metrics)
            worst = max(worst, f.ratio)
        return Verdict(target.name, "pass", ratio=worst, metrics=metrics)
