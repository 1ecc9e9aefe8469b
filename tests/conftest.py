import os

import torch

# Triton kernels run under the interpreter when there is no GPU; it must be chosen before
# any harness module is imported (triton.jit reads it when it decorates).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
