"""Rank bodies for ``test_elastic_live_heal.py`` (module-level: ``run_ranks`` pickles them)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import stalwart


def _state(seed: int) -> stalwart.TrainingState:
    torch.manual_seed(seed)  # RNG is replicated state: seed every generator alike
    random.seed(seed)
    np.random.seed(seed)
    model = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return stalwart.TrainingState(model=model, optimizer=opt)


def _train(state: stalwart.TrainingState, steps: int) -> None:
    for s in range(steps):
        state.optimizer.zero_grad()
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(s))
        state.model(x).square().sum().backward()
        state.optimizer.step()
        torch.rand(1)  # the global RNG moves with the steps too: the heal must carry it


def sliced_heal(rank: int, world_size: int, holders: int, chunk_bytes: int) -> dict[str, Any]:
    """Ranks below ``holders`` trained 3 steps alike; the others are fresh newcomers (AdamW
    without state yet). Every holder sends a slice, in chunks of ``chunk_bytes``, and every
    newcomer must end with the holders' digest, optimizer moments and RNG included."""
    from stalwart.elastic.heal import heal
    from stalwart.elastic.state import digest

    state = _state(0 if rank < holders else 100 + rank)
    step = 0
    if rank < holders:
        _train(state, 3)
        step = 3
    before = digest(state, step)
    got = heal(state, step, rank, list(range(holders)), dist.group.WORLD, chunk_bytes=chunk_bytes)
    after = digest(state, got)
    _train(state, 1)  # the healed optimizer steps on like the others (its moments are real)
    return {"step": got, "before": before, "after": after, "next": digest(state, got + 1)}


def reconciled_heal(rank: int, world_size: int, holders: int) -> dict[str, Any]:
    """A parity check that heals: holders trained alike (an agreed copy recorded after their
    first step), newcomers fresh with none. Returns what each member's agreed copy holds
    after the heal, and what restoring it gives once the live state moved on."""
    from stalwart.elastic.parity import reconcile
    from stalwart.elastic.state import AgreedState, digest

    state, agreed, step = _state(0 if rank < holders else 100 + rank), AgreedState(), 0
    kept = None
    if rank < holders:
        _train(state, 1)
        agreed.record(state, 1)
        kept = digest(state, 1)
        _train(state, 2)
        step = 3
    step, found = reconcile(state, step, rank, dist.group.WORLD, agreed)
    healed = digest(state, step)
    assert state.optimizer is not None
    moments = [t.data_ptr() for s in state.optimizer.state.values() for t in s.values()]
    _train(state, 1)  # the live state moves on: an adopted copy must not move with it
    copy_step = agreed.restore(state)
    return {"step": step, "received": found.received, "healed": healed, "kept": kept,
            "copy_step": copy_step, "restored": digest(state, copy_step),
            "aliased": any(t.data_ptr() in moments for t in agreed._leaves.values())}  # fmt: skip


def _bn_state(seed: int) -> stalwart.TrainingState:
    """An MLP with BatchNorm (float buffers the mean carries, an integer one it does not) and
    dropout (the global RNG moves at every forward), AdamW."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = nn.Sequential(nn.Linear(64, 96), nn.BatchNorm1d(96), nn.Tanh(), nn.Dropout(0.2),
                          nn.Linear(96, 3))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return stalwart.TrainingState(model=model, optimizer=opt)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(6, 64, generator=torch.Generator().manual_seed(1000 * rank + step))


def _contribute(state: stalwart.TrainingState, step: int, rank: int, group: Any,
                contributors: int | None) -> None:  # fmt: skip
    """One committed step of a contributor: its share's gradients, the mean, the update."""
    from stalwart.elastic.reduce import average_

    assert state.optimizer is not None
    state.optimizer.zero_grad()
    state.model(_batch(step, rank)).square().sum().backward()
    buffers = [b for b in state.model.buffers() if b.is_floating_point()]
    params = list(state.model.parameters())
    average_(params, buffers, torch.zeros(1), group, contributors=contributors)
    state.optimizer.step()


def background_heal(rank: int, world_size: int, listen: bool, steps: int,
                    replay_from: int) -> dict[str, Any]:  # fmt: skip
    """Ranks 0 and 1 trained 2 steps alike and record the agreed copy of step 2. With
    ``listen``, rank 2 is a fresh newcomer: the survivors lend their copy to a background
    sender and commit ``steps`` more steps (the mean over 2 contributors, each its own
    batch), while rank 2 listens (zeros in, the reduced gradients kept) and, from listened
    step ``replay_from`` on, replays one kept step per step once the copy landed; then it
    replays the rest and takes RNG, integer buffers and skeleton from rank 0. Without
    ``listen`` (2 ranks) the survivors train alone: their digests must be the same."""
    from stalwart.elastic.catchup import Catchup, Lender, send_rest, take_rest
    from stalwart.elastic.state import AgreedState, digest

    group = dist.group.WORLD
    survivor = rank < 2
    state = _bn_state(0 if survivor else 100 + rank)
    assert state.optimizer is not None
    params = list(state.model.parameters())
    buffers = [b for b in state.model.buffers() if b.is_floating_point()]
    step = 0
    if survivor:
        for s in range(2):  # alike on both: the same batch, no reduction
            state.optimizer.zero_grad()
            state.model(_batch(s, 0)).square().sum().backward()
            state.optimizer.step()
    agreed = AgreedState()
    fresh = digest(state, 2 if survivor else 0)
    step = 2  # the job's step at the boundary: the listener counts from it too
    if survivor:
        agreed.record(state, step)  # the parity check's copy at the boundary
    opts = {"streams": 2, "chunk_bytes": 1000}  # slices and chunks cut tensors in the middle
    lender = catchup = None
    if listen and survivor:
        pace = 1e6 if rank == 1 else 0.0  # one holder paced (bytes a second), one not
        lender = Lender(agreed, rank, [2], group, rate_bytes_s=pace, **opts)
    elif listen:
        catchup = Catchup(state, state.optimizer, params, buffers, [2], group, **opts)
    for i in range(steps):
        if catchup is None:
            _contribute(state, step, rank, group, 2 if listen else None)
        else:
            state.optimizer.zero_grad()  # its own forward and backward, thrown away
            state.model(_batch(step, rank)).square().sum().backward()
            catchup.reduce(torch.zeros(1), group)
            if i >= replay_from:
                catchup.replay(limit=1)
        step += 1
    replayed_early = None
    if catchup is not None:
        assert not catchup.over
        replayed_early = catchup._replayed
        assert catchup.replay()
        assert catchup.step == step
    if lender is not None:
        lender.wait()
    if listen:
        if survivor:
            take = rank != 0
            if take:
                take_rest(state, state.optimizer, params, buffers, 0, group, load=False)
            else:
                send_rest(state, step, state.optimizer, params, buffers, 0, group)
        else:
            assert take_rest(state, state.optimizer, params, buffers, 0, group) == step
    final = digest(state, step)
    _contribute(state, step, rank % 2, group, 3 if listen else None)  # a contributor now
    return {"fresh": fresh, "final": final, "next": digest(state, step + 1),
            "replayed_early": replayed_early, "copy_lent_step": agreed.step}  # fmt: skip


def bounded_catchup(rank: int, world_size: int, max_steps: int) -> dict[str, Any]:
    """Rank 0 lends its copy and commits 3 steps; rank 1 listens with a bound of
    ``max_steps`` steps: it stops keeping, and its replay refuses (a full heal follows)."""
    from stalwart.elastic.catchup import Catchup, Lender
    from stalwart.elastic.state import AgreedState
    from stalwart.errors import DistributedError

    group = dist.group.WORLD
    state = _bn_state(rank)
    assert state.optimizer is not None
    params = list(state.model.parameters())
    buffers = [b for b in state.model.buffers() if b.is_floating_point()]
    agreed = AgreedState()
    agreed.record(state, 0)
    catchup = None
    if rank == 0:
        lender = Lender(agreed, 0, [1], group)
    else:
        catchup = Catchup(state, state.optimizer, params, buffers, [1], group,
                          max_steps=max_steps)  # fmt: skip
    for step in range(3):
        if catchup is None:
            _contribute(state, step, rank, group, 1)
        else:
            catchup.reduce(torch.zeros(1), group)
    if catchup is None:
        lender.wait()
        return {"over": None}
    refused = False
    try:
        catchup.replay()
    except DistributedError:
        refused = True
    catchup.transfer.wait()  # the copy still lands (and is acknowledged) before this leaves
    return {"over": catchup.over, "kept": catchup.kept_bytes, "refused": refused}
