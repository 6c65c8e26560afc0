"""A Checkpointer made per save reuses the process's background group and staging buffer.

Two real gloo ranks build a new Checkpointer for every save_async of one root (as a script
or an integration may); after the first one, none of them makes a gloo group or a host
buffer (the process-wide pools' own counters), and every step loads back exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.checkpoint.buffer_pool import HOST_BUFFERS
from stalwart.checkpoint.collective import BACKGROUND_GROUPS
from stalwart.testing import run_ranks

pytestmark = pytest.mark.timeout(180)


def _weight(step: int, rank: int) -> torch.Tensor:
    return torch.full((128, 128), float(step * 10 + rank))


def per_save_checkpointers(rank: int, world: int, root: str) -> tuple[list[int], list[int]]:
    """Save steps 1..6, each with a new Checkpointer; return groups and buffers made."""
    groups, buffers = [], []
    for step in range(1, 7):
        with stalwart.Checkpointer(root) as ck:
            ck.save_async(step, {f"w{rank}": _weight(step, rank)}).wait()
        groups.append(BACKGROUND_GROUPS.made)
        buffers.append(HOST_BUFFERS.made)
    with stalwart.Checkpointer(root) as ck:
        for step in range(1, 7):
            tree = ck.load(None, step)
            for r in range(world):
                assert torch.equal(tree[f"w{r}"], _weight(step, r)), (step, r)
    return groups, buffers


def test_a_checkpointer_per_save_makes_no_group_or_buffer_after_the_first(
    tmp_path: Path,
) -> None:
    results = run_ranks(per_save_checkpointers, 2, str(tmp_path / "ck"), timeout_s=150)
    for groups, buffers in results:
        assert groups == [groups[0]] * 6 and groups[0] >= 1, groups  # one group, reused
        assert buffers == [buffers[0]] * 6, buffers  # one staging buffer, reused
