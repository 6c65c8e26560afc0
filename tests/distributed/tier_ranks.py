"""Per-rank bodies for tiered recovery tests (spawned by run_ranks)."""

from __future__ import annotations

from typing import Any

import torch

from stalwart.checkpoint.memory.tiers import Tier, TieredCheckpointer
from stalwart.checkpoint.policy import EveryNSteps, KeepLast


def state_at(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    return {
        f"rank{rank}": {"w": torch.randn(96, 33, generator=g), "b": torch.randn(7, generator=g)},
        "step": step,
    }


def blank(rank: int) -> dict[str, Any]:
    return {f"rank{rank}": {"w": torch.zeros(96, 33), "b": torch.zeros(7)}, "step": -1}


def lose_and_recover(
    rank: int,
    world: int,
    root: str,
    erasure: tuple[int, int],
    lost: list[int],
    bad_parity: bool = False,
) -> dict[str, Any]:
    """Save steps 1-3 to memory (EC) and step 2 to disk; ``lost`` ranks forget their memory
    (and, with ``bad_parity``, the survivors' parity of step 3 is flipped: a wrong rebuild)."""
    tc = TieredCheckpointer(
        [
            Tier(name="memory", every=EveryNSteps(1), keep=KeepLast(2)),
            Tier(name="local", root=root, every=EveryNSteps(2), keep=KeepLast(2)),
        ],
        erasure=erasure,
    )
    for step in (1, 2, 3):
        tc.save(step, state_at(step, rank))
    if rank in lost:
        tc.drop_memory()  # this rank crashed and came back empty
    elif bad_parity:
        tc.wait()  # step 3 protected
        for piece in tc.memory.find(3).parity.values():
            piece.bitwise_not_()
    target = blank(rank)
    report = tc.recover(target)
    expected = state_at(report.step, rank)
    for k in ("w", "b"):
        assert torch.equal(target[f"rank{rank}"][k], expected[f"rank{rank}"][k]), (rank, k)
    tc.close()
    return {"source": report.source, "step": report.step, "rebuilt": report.rebuilt_ranks}


def erasure_checkpointers_share_groups(rank: int, world: int) -> list[int]:
    """Three erasure-coded TieredCheckpointers one after the other, each saving and closed:
    the process groups registered after each (its erasure group comes from the process's
    pool and goes back to it at close)."""
    from torch.distributed.distributed_c10d import _world

    counts = []
    for step in (1, 2, 3):
        tc = TieredCheckpointer([Tier.memory(keep=KeepLast(1))], erasure=(world - 1, 1))
        tc.save(step, state_at(step, rank))
        tc.close()
        counts.append(len(_world.pg_map))
    return counts
