"""The pusher's side of a follow (``elastic/follow.py``) on one socket pair, in one process."""

from __future__ import annotations

import socket

import pytest
import torch
from torch import nn

from stalwart.elastic.feed import Feed, hyper_parameters
from stalwart.errors import ConfigError


def _model(width: int = 4) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(width, width)
    return model, torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), betas=(0.8, 0.9))


def _backward(model: nn.Module, set_to_none: bool = True) -> None:
    model.zero_grad(set_to_none=set_to_none)
    model(torch.ones(2, model.in_features)).sum().backward()


def test_hyper_parameters_are_numbers_a_scheduler_may_change() -> None:
    _, opt = _model()
    (row,) = hyper_parameters(opt)
    assert row["lr"] == pytest.approx(0.01) and row["betas"] == [0.8, 0.9]
    assert "params" not in row and all(not isinstance(v, torch.Tensor) for v in row.values())


def test_gradients_zeroed_in_place_are_refused_at_the_second_push() -> None:
    model, opt = _model()
    mine, theirs = socket.socketpair()
    feed = Feed(mine)
    try:
        _backward(model, set_to_none=False)
        assert feed.push(1, list(model.parameters()), [], opt)
        _backward(model, set_to_none=False)  # the same tensors, zeroed then refilled
        with pytest.raises(ConfigError, match="set_to_none"):
            feed.push(2, list(model.parameters()), [], opt)
        copying = Feed(None, copy=True)
        assert copying.broken == "not the pusher"
        assert not copying.push(2, list(model.parameters()), [], opt)
    finally:
        feed.close()
        theirs.close()


def test_a_follower_too_far_behind_breaks_the_feed_and_push_never_waits() -> None:
    model, opt = _model(1024)  # 4 MiB of gradients: more than a socket pair's buffers hold
    mine, theirs = socket.socketpair()  # nobody reads ``theirs``: the first send blocks
    feed = Feed(mine, max_queue=1)
    try:
        _backward(model)
        assert feed.push(1, list(model.parameters()), [], opt)
        _backward(model)
        assert not feed.push(2, list(model.parameters()), [], opt)
        assert feed.broken is not None and "behind" in feed.broken
        assert not feed.ready(3)
    finally:
        feed.close()
        theirs.close()


def test_a_feed_needs_every_gradient_and_a_queue() -> None:
    model, opt = _model()
    with pytest.raises(ConfigError, match="at least 1"):
        Feed(None, max_queue=0)
    mine, theirs = socket.socketpair()
    feed = Feed(mine)
    try:
        with pytest.raises(ConfigError, match="gradient"):
            feed.push(1, list(model.parameters()), [], opt)  # no backward yet
    finally:
        feed.close()
        theirs.close()


def test_follow_with_backup_workers_is_refused_with_the_fix() -> None:
    # Job(follow=True) hands the optimizer over in job.optimizer(opt, backup=...): backup
    # workers commit without some members' gradients, which a follower cannot replay.
    from datetime import timedelta

    from stalwart.elastic.follow_job import FollowHeal

    heal = FollowHeal(None, None, timedelta(seconds=1))  # type: ignore[arg-type]  # never reached
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="backup workers: use one or the other"):
        heal.use(opt, None, backups=True)  # type: ignore[arg-type]
    assert heal.optimizer is None
