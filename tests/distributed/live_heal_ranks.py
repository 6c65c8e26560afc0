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
