"""KernelBench pairs: the standard test that accepted them, and the same pair as a kfuzz target.

A KernelBench problem is a reference file (``Model``, ``get_inputs``,
``get_init_inputs`` and module-level size constants such as ``batch_size =
16``); a generated solution is a file defining ``ModelNew``, a drop-in
replacement for ``Model``. One module a concept:

- ``corpus``: the pairs of a corpus file or folder (``read_corpus``, ``read_row``: CUDA-L1
  rows, a leaderboard, a folder of controls), one ``CorpusEntry`` a row;
- ``source``: the pair (``load_pair`` checks both sources' shape by parsing,
  without running them), its size constants (``size_constants``), and the
  sources run as modules (``pair_module``);
- ``standard``: ``standard_test``, the check that accepted the solution, run
  as the original harness ran it;
- ``programs``: the audit's kernel programs (``weights``, ``standard``, ``build``), added to
  ``kfuzz.programs.PROGRAMS`` when this package is imported;
- ``build``: the build step of a solution's ``load_inline`` extensions (``build_solution``), and
  loading what it built where no process may start (``prebuilt_only``); its compiles take
  torch's header precompiled (``pch``) and the CUDA files slimmed, after the host files
  (``cuda_compile``);
- ``target``: ``as_target``, the pair as a target that kfuzz's gates judge
  (the reference in float64 as the oracle, ``Model``'s weights loaded
  strictly, size constants as dims), and ``resolve``, which finds a pair by
  its target name ``kb:<corpus file>:<row>`` (``kfuzz.target.get_target``
  calls it for names starting ``kb:``, so a sandboxed worker finds its pair);
- ``weights``: ``Model``'s weights loaded into ``ModelNew`` (``load_weights``, ``load_shared``),
  the checkpoint of another seed (``trained``), and the reference's float weights
  (``float_weights``).

Generated code is untrusted: nothing here runs ``custom_code`` except the
kernel half of a target and ``standard_test``, which callers run in a
sandboxed worker.

Refuses (``KernelBenchError``): sources that do not parse or lack ``Model``,
``get_inputs``, ``get_init_inputs`` or ``ModelNew``; references whose inputs are
not tensors, or floating point other than float32.
"""
import kfuzz.kernelbench.programs  # noqa: F401  (registers the audit's kernel programs)
from kfuzz.kernelbench.corpus import CorpusEntry, read_corpus, read_row
from kfuzz.kernelbench.source import (PREFIX, SEED, KernelBenchError, KernelBenchPair, load_pair, pair_module,
                                      set_seed, size_constants, sized)
from kfuzz.kernelbench.standard import ATOL, RTOL, TRIALS, StandardVerdict, standard_test
from kfuzz.kernelbench.target import (MODEL_SETS, Bench, Contract, KernelBenchTarget, as_target, infer_contract,
                                      nominal, resolve)
from kfuzz.kernelbench.weights import FLOAT_WEIGHTS, WeightsContractError, float_weights, load_weights

__all__ = ["ATOL", "FLOAT_WEIGHTS", "MODEL_SETS", "PREFIX", "RTOL", "SEED", "TRIALS", "Bench", "Contract",
           "CorpusEntry", "KernelBenchError", "KernelBenchPair", "KernelBenchTarget", "StandardVerdict",
           "WeightsContractError", "as_target", "float_weights", "infer_contract", "load_pair", "load_weights",
           "nominal", "pair_module", "read_corpus", "read_row", "resolve", "set_seed", "size_constants", "sized",
           "standard_test"]
