"""Recovery from peers' memory: lost ranks rebuilt bit-exactly by erasure decoding."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.testing import run_ranks

from . import tier_ranks

pytestmark = pytest.mark.timeout(240)


def test_4_plus_1_rebuilds_a_lost_rank_from_peers_memory(tmp_path: Path) -> None:
    results = run_ranks(
        tier_ranks.lose_and_recover, 5, str(tmp_path / "ck"), (4, 1), [2], timeout_s=180
    )
    assert all(r == {"source": "memory+erasure", "step": 3, "rebuilt": [2]} for r in results)


def test_4_plus_2_rebuilds_two_lost_ranks(tmp_path: Path) -> None:
    results = run_ranks(
        tier_ranks.lose_and_recover, 6, str(tmp_path / "ck"), (4, 2), [1, 4], timeout_s=180
    )
    assert all(r == {"source": "memory+erasure", "step": 3, "rebuilt": [1, 4]} for r in results)


def test_more_losses_than_parity_fall_back_to_disk(tmp_path: Path) -> None:
    results = run_ranks(
        tier_ranks.lose_and_recover, 5, str(tmp_path / "ck"), (4, 1), [0, 3], timeout_s=180
    )
    assert all(r == {"source": "local", "step": 2, "rebuilt": []} for r in results)


def test_a_failed_rebuild_falls_back_to_disk_on_every_rank(tmp_path: Path) -> None:
    # The survivors' parity is damaged: the lost rank's rebuilt snapshot fails its digest.
    # That failure is agreed by every rank, and recovery goes on to the disk tier (it raised).
    results = run_ranks(
        tier_ranks.lose_and_recover, 3, str(tmp_path / "ck"), (2, 1), [1], True, timeout_s=180
    )
    assert all(r == {"source": "local", "step": 2, "rebuilt": []} for r in results)


def test_closed_erasure_checkpointers_give_their_group_back() -> None:
    # Each TieredCheckpointer with erasure coding made a gloo group over every rank (a
    # connection to each) and never destroyed it: one more set of sockets per object.
    counts = run_ranks(tier_ranks.erasure_checkpointers_share_groups, 3, timeout_s=120)
    for rank_counts in counts:
        assert rank_counts[0] == rank_counts[1] == rank_counts[2], counts
