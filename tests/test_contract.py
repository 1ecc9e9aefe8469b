"""The call contract's namespace snapshot against torch's own lazy state (kfuzz.contract)."""
import torch

from kfuzz.contract import NamespaceSnapshot


def test_cuda_initialization_during_a_call_is_not_a_replacement():
    """The first CUDA call in a process fills torch.cuda.default_generators (empty before): a
    snapshot taken before it must not call that a replacement, nor put the empty tuple back
    (on the H200 that broke every later torch.cuda.manual_seed with an IndexError)."""
    was = torch.cuda.default_generators
    torch.cuda.default_generators = ()
    try:
        snapshot = NamespaceSnapshot()
        filled = (torch.Generator(),)
        torch.cuda.default_generators = filled        # what torch._C._cuda_init does
        assert snapshot.undo() == []
        assert torch.cuda.default_generators is filled
        # once filled, replacing it is a replacement like any other
        snapshot = NamespaceSnapshot()
        torch.cuda.default_generators = (torch.Generator(),)
        assert snapshot.undo() == ["torch.cuda.default_generators"]
        assert torch.cuda.default_generators is filled
    finally:
        torch.cuda.default_generators = was
