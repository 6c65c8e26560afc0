"""The agreed copy lent to a background sender (``AgreedState.lend``, ``elastic/catchup.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stalwart
from stalwart.elastic.state import AgreedState, digest
from stalwart.errors import DistributedError


def _state() -> stalwart.TrainingState:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return stalwart.TrainingState(model=model, optimizer=opt)


def _train(state: stalwart.TrainingState) -> None:
    assert state.optimizer is not None
    state.optimizer.zero_grad()
    state.model(torch.randn(3, 8)).sum().backward()
    state.optimizer.step()


def test_a_lent_copy_is_not_refilled_by_the_next_record() -> None:
    state, agreed = _state(), AgreedState()
    agreed.record(state, 1)
    _, step, leaves = agreed.lend()
    lent = list(leaves.values())
    assert step == 1
    before = [t.clone() for t in lent]
    _train(state)
    agreed.record(state, 2)  # a sender may still read the lent tensors: new ones
    assert all(torch.equal(a, b) for a, b in zip(lent, before, strict=True))
    now = list(agreed.lend()[2].values())
    assert not any(a.data_ptr() == b.data_ptr() for a, b in zip(lent, now, strict=True))
    assert digest(state, 2) != digest(state, 1)


def test_an_unlent_copy_is_refilled_in_place() -> None:
    state, agreed = _state(), AgreedState()
    agreed.record(state, 1)
    ptrs = {n: t.data_ptr() for n, t in agreed._leaves.items()}
    _train(state)
    agreed.record(state, 2)
    assert {n: t.data_ptr() for n, t in agreed._leaves.items()} == ptrs


def test_nothing_to_lend_before_a_record() -> None:
    with pytest.raises(DistributedError, match="record one first"):
        AgreedState().lend()
