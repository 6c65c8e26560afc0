"""A healed member loads the received leaves into the tensors it already holds, and its agreed
copy adopts those leaves instead of copying the state once more (``state.live_targets``,
``state.load_leaves``, ``AgreedState.record``): the state and the copy stay bit-identical to
the sender's, and the copy never moves with the live state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stalwart
from stalwart.elastic.state import (
    AgreedState,
    digest,
    live_targets,
    load_leaves,
    local_part,
    state_header,
)

pytestmark = pytest.mark.timeout(60)


def _state(seed: int, steps: int) -> stalwart.TrainingState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 24), nn.BatchNorm1d(24), nn.Linear(24, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = stalwart.TrainingState(model=model, optimizer=opt, rng=False)
    _train(state, steps)
    return state


def _train(state: stalwart.TrainingState, steps: int) -> None:
    assert state.model is not None and state.optimizer is not None
    for s in range(steps):
        state.optimizer.zero_grad()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(s))
        state.model(x).square().sum().backward()  # type: ignore[operator]
        state.optimizer.step()


def _received(sender: stalwart.TrainingState) -> tuple[dict, list[torch.Tensor]]:
    header, tensors = state_header(sender, 3)
    return header, [local_part(t).detach().clone() for t in tensors]  # as the heal allocates


@pytest.mark.parametrize("fresh_optimizer", [True, False])
def test_received_leaves_land_in_the_receivers_tensors_and_the_copy_adopts_them(
    fresh_optimizer: bool,
) -> None:
    sender = _state(0, 3)
    header, leaves = _received(sender)
    receiver = _state(1, 0 if fresh_optimizer else 1)
    assert receiver.model is not None and receiver.optimizer is not None
    params = [p.data_ptr() for p in receiver.model.parameters()]
    into = live_targets(receiver, header)
    assert load_leaves(receiver, header, leaves, into) == 3
    assert digest(receiver, 3) == digest(sender, 3)
    assert [p.data_ptr() for p in receiver.model.parameters()] == params  # filled in place
    by_name = {h[0]: t for h, t in zip(header["leaves"], leaves, strict=True)}
    assert {n for n in by_name if n.startswith("model.")} <= set(into)
    moments = {n for n in by_name if "exp_avg" in n}
    # a fresh optimizer had no moments to fill: they are handed over as received
    assert (moments & set(into)) == (set() if fresh_optimizer else moments)
    spare = {n: by_name[n] for n in into}  # received, copied in, never handed to the state
    agreed = AgreedState()
    agreed.record(receiver, 3, spare)
    _train(receiver, 2)  # the live state moves on
    assert digest(receiver, 3) != digest(sender, 3)
    assert agreed.restore(receiver) == 3
    assert digest(receiver, 3) == digest(sender, 3)
