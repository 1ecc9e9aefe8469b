import os

import torch

# Triton kernels run under the interpreter when there is no GPU; it must be chosen before
# any harness module is imported (triton.jit reads it when it decorates).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the test suite's own targets (escapes, hacks, positive controls: the kfuzz.fixtures
# entry points) register only when asked; sandboxed workers inherit the setting
os.environ["KFUZZ_FIXTURES"] = "1"
