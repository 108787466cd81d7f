"""Fusion into flat buffers and back, and the finiteness check on synchronised results."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spardl_grace.fusion import assign_grads, flatten_grads
from spardl_grace.api import all_finite


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3000), bad=st.lists(st.tuples(st.integers(0, 2999),
                                                      st.sampled_from([float("nan"), float("inf"),
                                                                       -float("inf")])), max_size=3),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
def test_all_finite_is_isfinite_all(n, bad, dtype):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    for position, value in bad:
        if position < n:
            x[position] = value
    assert all_finite(x) == bool(torch.isfinite(x).all())


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))


def test_assign_grads_copies_into_existing_grads_and_is_the_inverse_of_flatten():
    model = _model()
    model(torch.randn(2, 5)).sum().backward()
    params = list(model.parameters())
    before = [p.grad for p in params]
    flat = torch.arange(sum(p.numel() for p in params), dtype=torch.float32)
    assign_grads(params, flat)
    assert all(p.grad is g for p, g in zip(params, before))  # no new tensors
    assert torch.equal(flatten_grads(params), flat)
    flat.zero_()
    assert flatten_grads(params).sum() > 0  # the grads are copies, not views of flat


def test_assign_grads_makes_new_grads_where_it_cannot_copy():
    model = _model()
    params = list(model.parameters())
    params[0].grad = torch.zeros(5, 4).t()  # right shape, not contiguous
    flat = torch.randn(sum(p.numel() for p in params))
    assign_grads(params, flat)  # params[1..] have no grad yet
    assert params[0].grad.is_contiguous()
    assert torch.equal(flatten_grads(params), flat)
    with pytest.raises(ValueError, match="flat buffer has 3 entries"):
        assign_grads(params, torch.zeros(3))
