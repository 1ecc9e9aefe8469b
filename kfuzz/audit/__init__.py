"""The audit: accepted KernelBench kernels through the standard test and the gates, one record each.

A corpus is a file or folder of KernelBench pairs, read by ``kfuzz.kernelbench.read_corpus``
(its formats are described there); ``run_audit`` audits it into a results folder. One module a
concept:

- ``run``: the audit over a corpus (``run_audit``), several kernels at once, builds ahead of
  their judging, and what it refuses before any kernel runs;
- ``process``: a kernel's oracle process, forked from the audit's forkserver, and the audit's
  handle on it (its deadline, its record so far);
- ``kernel``: what that process does (``audit_kernel``): the solution's build, the standard
  test, the weights contract and the gates, each in a sandboxed worker, each result handed on
  as it ends;
- ``builds``: the extension cache, torch's precompiled header, Triton's driver stubs, and the
  build step alone (``build_kernels``, ``check_build_step``);
- ``policy``: the kernels' sandbox policies and what this machine's OS layers enforce of them
  (``confinement``);
- ``results``: the results file, one record a kernel, each line signed under a key kept
  outside the results folder (``read_results``, ``append_record``);
- ``verdicts``: a record judged (``judge_record``, ``outcome``).

Kernels that misbehave are never errors: they are records.
"""
from kfuzz.audit.builds import (PCH_FOLDER, build_kernels, check_build_step, default_cache, default_max_jobs,
                                driver_stubs, precompile_headers)
from kfuzz.audit.kernel import (CASES, KERNEL_PRELOAD, MINIMIZE_EXECUTIONS, MINIMIZE_SECONDS, audit_kernel, case_path,
                                finding, judged_resolve, lenient_check, run_one_gate, save_gate_case, weights_checks)
from kfuzz.audit.policy import KERNEL_MEMORY, OS_LAYERS, build_policy, confinement, kernel_policy, unconfined_layers
from kfuzz.audit.process import base_record
from kfuzz.audit.results import (KEY_ENV, RESULTS, Results, append_record, done_keys, key_path, needs_retry,
                                 read_results, results_key)
from kfuzz.audit.run import GPU_JOBS, default_jobs, run_audit
from kfuzz.audit.verdicts import (BROKEN_RATIO, EXCUSED, TOLERANCE_FREE_KINDS, WEIGHTS_CHECKS, ended_by_gpu_state,
                                  excused_class, first_failure, judge_record, kfuzz_errors, outcome,
                                  shares_memory, weights_failures)

__all__ = ["BROKEN_RATIO", "CASES", "EXCUSED", "GPU_JOBS", "KERNEL_MEMORY", "KERNEL_PRELOAD", "KEY_ENV",
           "MINIMIZE_EXECUTIONS", "MINIMIZE_SECONDS", "OS_LAYERS", "PCH_FOLDER", "RESULTS", "TOLERANCE_FREE_KINDS",
           "WEIGHTS_CHECKS", "Results", "append_record", "audit_kernel", "base_record", "build_kernels",
           "build_policy", "case_path", "check_build_step", "confinement", "default_cache", "default_jobs",
           "default_max_jobs", "done_keys", "driver_stubs", "ended_by_gpu_state", "excused_class", "finding",
           "first_failure", "judge_record", "judged_resolve", "kernel_policy", "key_path", "kfuzz_errors",
           "lenient_check", "needs_retry", "outcome", "precompile_headers", "read_results", "results_key", "run_audit",
           "run_one_gate", "save_gate_case", "shares_memory", "unconfined_layers", "weights_checks",
           "weights_failures"]
