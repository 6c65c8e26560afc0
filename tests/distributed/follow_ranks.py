"""Rank bodies for ``test_elastic_follow.py`` (module-level: ``run_ranks`` pickles them)."""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import stalwart


def _state(seed: int) -> stalwart.TrainingState:
    """An MLP with BatchNorm (float buffers the mean carries, an integer one it does not),
    dropout (the global RNG moves at every forward), AdamW and a scheduler that changes the
    learning rate at every step (the follower must apply each step's rate)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = nn.Sequential(nn.Linear(64, 96), nn.BatchNorm1d(96), nn.Tanh(), nn.Dropout(0.2),
                          nn.Linear(96, 3))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)
    return stalwart.TrainingState(model=model, optimizer=opt, scheduler=sched)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(6, 64, generator=torch.Generator().manual_seed(1000 * rank + step))


def _parts(state: stalwart.TrainingState) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    params = list(state.model.parameters())
    return params, [b for b in state.model.buffers() if b.is_floating_point()]


def _commit(state: stalwart.TrainingState, step: int, rank: int, group: Any, feed: Any = None,
            ready: bool = False, until: int = 0) -> bool:  # fmt: skip
    """One committed step on ``group``: the share's gradients, the mean (with the pusher's
    ready flag in the control vector), the push, the update and the scheduler. Whether this
    step is the promotion boundary (every member agrees: the flag was in the all-reduce)."""
    from stalwart.elastic.reduce import average_

    assert state.optimizer is not None and state.scheduler is not None
    params, buffers = _parts(state)
    state.optimizer.zero_grad()
    state.model(_batch(step, rank)).square().sum().backward()
    flag = False
    if ready and feed is not None:  # past ``until``, the pusher waits for the follower
        flag = feed.wait_ready(step + 1, 20.0) if step + 1 >= until else feed.ready(step + 1)
    control = average_(params, buffers, torch.tensor([float(flag)]), group)
    promote = float(control[0]) > 0 and step + 1 >= until
    if feed is not None:
        feed.push(step + 1, params, buffers, state.optimizer, promote=promote)
    state.optimizer.step()
    state.scheduler.step()
    return promote


def followed(rank: int, world_size: int, least: int, most: int, bare: bool) -> dict[str, Any]:
    """Ranks 0 and 1 trained 2 steps alike and record the agreed copy of step 2; rank 2 is a
    fresh newcomer. The survivors lend the copy and commit on their own group (rank 0
    pushes each step) from step 2 until the follower is ready, at step ``least`` or later
    (at most ``most``); the follower applies the pushed steps as they come, then everyone
    meets on the whole group for the rest and the digests, and commits one more step as
    three. ``bare``: the survivors commit ``least`` steps without promoting, then promote at
    a boundary where no step commits (``promote_now``), once the follower applied them all."""
    from stalwart.elastic.catchup import Lender, send_rest, take_rest
    from stalwart.elastic.feed import Feed
    from stalwart.elastic.follow import Follower
    from stalwart.elastic.state import AgreedState, digest

    world = dist.group.WORLD
    survivors = dist.new_group([0, 1])
    survivor = rank < 2
    state = _state(0 if survivor else 100 + rank)
    assert state.optimizer is not None and state.scheduler is not None
    params, buffers = _parts(state)
    step = 2
    if survivor:
        for s in range(step):  # alike on both: the same batch, no reduction
            _commit(state, s, 0, None)
    fresh = digest(state, step)
    agreed = AgreedState()
    opts = {"streams": 2, "chunk_bytes": 1000}
    if survivor:
        agreed.record(state, step)
        Lender(agreed, rank, [2], world, **opts)
        feed = Feed.connect(2, rank == 0, world, params, buffers)
        promoted = False
        while not promoted and step < most:
            promoted = _commit(state, step, rank, survivors, feed, not bare, least)
            step += 1
            if bare and step == least:
                ready = torch.tensor([float(feed.wait_ready(step + 1, 20.0, lag=0))])
                dist.all_reduce(ready, group=survivors)  # every survivor agrees
                promoted = float(ready[0]) > 0 and (rank != 0 or feed.promote_now(step))
        out: dict[str, Any] = {"promoted": promoted}
        if rank == 0:
            send_rest(state, step, state.optimizer, params, buffers, 0, world)
        else:
            take_rest(state, state.optimizer, params, buffers, 0, world, load=False)
        feed.close()
    else:
        follower = Follower(2, world, **opts)
        step = follower.follow(state, state.optimizer, params, buffers)
        out = {"followed_to": step, "over": follower.over}
        assert take_rest(state, state.optimizer, params, buffers, 0, world) == step
    final = digest(state, step)
    _commit(state, step, rank % 2, world)  # a contributor now: the mean over three
    out.update({"fresh": fresh, "final": final, "next": digest(state, step + 1), "step": step,
                "lr": state.optimizer.param_groups[0]["lr"]})  # fmt: skip
    return out


def _lone_pusher(state: stalwart.TrainingState, params: list[torch.Tensor],
                 buffers: list[torch.Tensor]) -> tuple[Any, Any]:  # fmt: skip
    """Rank 0 of two: its copy of step 0 lent to rank 1, and its feed to it."""
    from stalwart.elastic.catchup import Lender
    from stalwart.elastic.feed import Feed
    from stalwart.elastic.state import AgreedState

    agreed = AgreedState()
    agreed.record(state, 0)
    lender = Lender(agreed, 0, [1], dist.group.WORLD)
    return lender, Feed.connect(1, True, dist.group.WORLD, params, buffers)


def _broken(feed: Any) -> str | None:
    """Why the feed broke, waiting up to 20 s for it to notice."""
    deadline = time.monotonic() + 20
    while feed.broken is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return feed.broken


def abandoned(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 follows with a bound of one step and applies nothing until rank 0 has pushed
    three: it stops; rank 0's feed breaks, its pushes return False, it commits on."""
    from stalwart.elastic.follow import Follower
    from stalwart.errors import DistributedError

    world, solo = dist.group.WORLD, dist.new_group([0])
    state = _state(rank)
    assert state.optimizer is not None
    params, buffers = _parts(state)
    if rank == 0:
        lender, feed = _lone_pusher(state, params, buffers)
        for step in range(3):
            _commit(state, step, 0, solo, feed)
        dist.barrier()
        lender.wait()
        broken = _broken(feed)
        return {"broken": broken, "pushed_after": feed.push(3, params, buffers, state.optimizer)}
    follower = Follower(1, world, max_steps=1)
    dist.barrier()
    try:
        follower.follow(state, state.optimizer, params, buffers)
    except DistributedError as e:
        return {"refused": str(e)}
    return {"refused": None}


def refused(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 follows rank 0 with a model of another shape: refused before anything is
    applied; then with its own model, abandoned while nothing is pushed. Rank 0's feed then
    breaks (the follower shut its socket), and nothing waited for the follower."""
    from stalwart.elastic.follow import Follower
    from stalwart.errors import ConfigError, DistributedError

    world = dist.group.WORLD
    state = _state(rank)
    assert state.optimizer is not None
    params, buffers = _parts(state)
    if rank == 0:
        lender, feed = _lone_pusher(state, params, buffers)
        dist.barrier()
        lender.wait()
        return {"broken": _broken(feed)}
    follower = Follower(1, world)
    other = nn.Linear(64, 4)
    out: dict[str, Any] = {}
    try:
        follower.follow(state, state.optimizer, list(other.parameters()), buffers)
    except ConfigError as e:
        out["mismatch"] = str(e)
    asked = []
    try:
        follower.follow(state, state.optimizer, params, buffers,
                        abandon=lambda: asked.append(1) or len(asked) > 2, poll_s=0.05)  # fmt: skip
    except DistributedError as e:
        out["abandoned"] = str(e)
    dist.barrier()
    return out


def group_ask(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """A replacement group of two ranks (0, 1; workers 10, 11) asks to follow at its start
    (``FollowHeal.ask_in_group``); rank 2 plays the survivors' rank of shard 0 and answers its
    ask, while shard 1's key is held by another replacement's token: the group must not
    follow half-way. Rank 0 withdraws (its pusher's feed breaks, its key is freed) and both
    ranks announce themselves, to heal at the epoch change as one group."""
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore

    from stalwart.elastic.catchup import Lender
    from stalwart.elastic.feed import Feed
    from stalwart.elastic.follow_job import FollowHeal
    from stalwart.elastic.groups import build_group
    from stalwart.elastic.membership import Membership
    from stalwart.elastic.protocol import WorkerEnv, keys
    from stalwart.elastic.state import AgreedState

    shard_group = dist.new_group([0, 1])
    state = _state(rank)
    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                     timeout=timedelta(seconds=20))  # fmt: skip
    if rank == 2:  # the pusher of shard 0, as FollowHeal.boundary starts a follow
        deadline = time.monotonic() + 20
        while not (store.check([keys.follow(0)]) and store.get(keys.follow(0))):
            assert time.monotonic() < deadline, "no replacement asked"
            time.sleep(0.01)
        token = bytes(store.get(keys.follow(0))).decode()
        pair = build_group(PrefixStore(f"follow/{token}", store), 0, 2,
                           device=torch.device("cpu"), timeout=timedelta(seconds=20))  # fmt: skip
        copy = AgreedState()
        copy.record(state, 7)
        Lender(copy, 0, [1], pair)
        feed = Feed.connect(1, True, pair, *_parts(state))
        deadline = time.monotonic() + 20
        while feed.broken is None and time.monotonic() < deadline:
            time.sleep(0.01)
        dist.barrier()  # the replacement ranks are alive until here: the withdrawal broke it
        return {"token": token, "broken": feed.broken}
    env = WorkerEnv("127.0.0.1", port, 10 + rank, None, timeout_s=20, hang_s=0)
    membership = Membership(env, 1, announce=False)
    heal = FollowHeal(state, membership, timedelta(seconds=20))
    heal.ask_in_group(shard_group)
    out = {
        "announced": membership.announced,
        "ready": store.check([keys.ready(10 + rank)]),
        "following": heal.following,
        "key": bytes(store.get(keys.follow(rank))).decode(),
    }
    dist.barrier()
    return out
