"""The call contract's namespace snapshot against torch's own lazy state (kfuzz.contract)."""
import pytest
import torch

import kfuzz.contract
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


@pytest.mark.parametrize("tags", [True, False], ids=["version-tags", "every-value"])
def test_a_replaced_function_is_named_and_put_back_with_or_without_version_tags(monkeypatch, tags):
    """The snapshot reads CPython's dict version tags where it can and compares every value
    elsewhere: both name a replacement, put the original back, and see nothing in a clean call."""
    if not tags:
        monkeypatch.setattr(kfuzz.contract, "_version", None)
    monkeypatch.setattr(kfuzz.contract, "_cache", [])
    assert (kfuzz.contract._watched()[3] is None) is (not tags)
    original = torch.softmax
    snapshot = NamespaceSnapshot()
    torch.softmax = lambda *a, **k: None
    assert snapshot.undo() == ["torch.softmax"] and torch.softmax is original
    snapshot = NamespaceSnapshot()
    torch.ones(2).sum()
    assert snapshot.undo() == []


def test_a_replacement_after_clean_calls_is_named_whether_made_inside_or_between_calls():
    """Clean calls in a row reuse the last snapshot's listing while no namespace moved; a
    replacement made inside a later call is still named, and one made between calls (by
    kfuzz's own code, say) is part of the next snapshot, not that call's doing."""
    original = torch.softmax
    for _ in range(3):
        snapshot = NamespaceSnapshot()
        torch.ones(2).sum()
        assert snapshot.undo() == []
    snapshot = NamespaceSnapshot()
    torch.softmax = lambda *a, **k: None
    assert snapshot.undo() == ["torch.softmax"] and torch.softmax is original
    replacement = torch.softmax = lambda *a, **k: None
    try:
        snapshot = NamespaceSnapshot()
        assert snapshot.undo() == [] and torch.softmax is replacement
        snapshot = NamespaceSnapshot()
        torch.softmax = original
        assert snapshot.undo() == ["torch.softmax"] and torch.softmax is replacement
    finally:
        torch.softmax = original
