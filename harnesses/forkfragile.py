"""A target whose module, once imported, makes every forked copy of its process unusable, as a
library that initialises CUDA at import does ("Cannot re-initialize CUDA in forked
subprocess"): ``forkfragile`` is a correct row sum that ends its process (exit 1) when it runs
in a fork of the process that imported it. Workers that import their target themselves,
after they are forked, run it without a crash."""
import os

from kfuzz.target import Arg, Dim, Output, target

_forked = []
os.register_at_fork(after_in_child=lambda: _forked.append(True))


@target("forkfragile", reference=lambda x: x.sum(dim=-1),
        args={"x": Arg(("N", "D"))}, outputs={"out": Output(("N",))},
        dims={"N": Dim(1, 8), "D": Dim(1, 64)},
        description="row sum, PyTorch; its module's state breaks in a forked copy of its process")
def forkfragile(x):
    if _forked:
        os._exit(1)     # what a CUDA context inherited through fork does to its process
    return x.double().sum(dim=-1).to(x.dtype)
