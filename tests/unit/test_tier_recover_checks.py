"""recover() checks a memory snapshot against its digest before restoring it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stalwart.checkpoint.memory.tiers import Tier, TieredCheckpointer
from stalwart.checkpoint.policy import EveryNSteps, KeepLast

pytestmark = pytest.mark.timeout(120)


def test_a_flipped_bit_in_the_newest_snapshot_sends_recovery_to_disk(tmp_path: Path) -> None:
    tiers = [Tier.memory(keep=KeepLast(2)), Tier.durable("disk", tmp_path, every=EveryNSteps(1))]
    with TieredCheckpointer(tiers) as tc:
        for step in (1, 2):
            tc.save(step, {"w": torch.full((4,), float(step))})
        tc.snapshots[-1].data[1] ^= 0x40  # one bit of w[0] of step 2, in host memory
        state = {"w": torch.zeros(4)}
        report = tc.recover(state)  # was: memory, step 2, w[0] == 2.0039
    assert (report.source, report.step) == ("disk", 2)
    assert torch.equal(state["w"], torch.full((4,), 2.0))
    [(tier, why)] = report.attempts
    assert tier == "memory" and "step 2 on rank 0" in why and "fails its digest" in why


def test_an_intact_snapshot_is_restored_from_memory(tmp_path: Path) -> None:
    tiers = [Tier.memory(keep=KeepLast(2)), Tier.durable("disk", tmp_path, every=EveryNSteps(2))]
    with TieredCheckpointer(tiers) as tc:
        for step in (1, 2, 3):
            tc.save(step, {"w": torch.full((4,), float(step))})
        state = {"w": torch.zeros(4)}
        report = tc.recover(state)
    assert (report.source, report.step, report.attempts) == ("memory", 3, [])
    assert torch.equal(state["w"], torch.full((4,), 3.0))
