"""The audit's kernel programs, registered in ``kfuzz.programs.PROGRAMS`` when kfuzz.kernelbench is
imported (a worker that runs them preloads it, or resolves a ``kb:`` target through it):

- ``weights``: a solution's weights contract (``Bench.solution_model``), its status and the
  backend flags the solution changed (``n/a: ...`` where ``ModelNew`` does not construct);
- ``standard``: the standard test that accepted the solution (``standard_test``);
- ``build``: the build of the solution's ``load_inline`` extensions (``build.build_solution``).

All three run the solution, so they are kernel-side; what they report is the kernel process's
word (an audit records it as such).
"""
from __future__ import annotations

from kfuzz.kernelbench.build import build_solution
from kfuzz.kernelbench.standard import standard_test
from kfuzz.programs import register_program


def weights(target, program, inputs, device):
    bench = target.options["bench"]
    try:
        model = bench.solution_model(dict(bench.contract.dims), device)
    except Exception:
        if bench.init_error is None:    # the load raised: the contract's failure, as the solution made it
            raise
        # no ModelNew to load weights into (its standard test and gates say why): not applicable
        return None, {}, {"status": f"n/a: ModelNew(*get_init_inputs()) raises {bench.init_error}",
                          "flags": sorted(bench.flags_changed)}
    del model
    return None, {}, {"status": bench.weights_status or "", "flags": sorted(bench.flags_changed)}


def build(target, program, inputs, device):
    return None, {}, build_solution(target.options["pair"], device=str(device))


def standard(target, program, inputs, device):
    pair = target.options["pair"] if "pair" in target.options else target.options["bench"].pair
    return None, {}, standard_test(pair, device=str(device)).to_json()


for _name, _program in (("weights", weights), ("standard", standard), ("build", build)):
    register_program(_name, _program)
