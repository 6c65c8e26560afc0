"""The recovery ladder on one process: real checkpoints on tmp folders, real corruption.

The collective agreement (3 ranks, steps held by some ranks only, a failure on one rank
moving every rank) is tested in ``tests/distributed/test_ladder_dist.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stalwart.checkpoint import Checkpointer, EveryNSteps, KeepLast, Tier, TieredCheckpointer
from stalwart.elastic.ladder import LadderReport, RecoveryLadder, RejectedStep
from stalwart.elastic.sampler import ElasticSampler
from stalwart.errors import CheckpointNotFoundError, StateMismatchError

pytestmark = pytest.mark.timeout(120)


def tree_at(step: int) -> dict:
    return {"w": torch.full((32, 8), float(step)), "b": torch.arange(5.0) + step}


def blank() -> dict:
    return {"w": torch.zeros(32, 8), "b": torch.zeros(5)}


def flip_pack_byte(root: Path, step: int) -> None:
    (pack,) = sorted((root / "packs").glob(f"step-{step:020d}-*.pack"))
    raw = bytearray(pack.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    pack.write_bytes(bytes(raw))


def test_newest_step_wins_and_lost_steps_are_counted(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "ck")
    for step in (10, 20, 30):
        ck.save(step, tree_at(step))
    state = blank()
    report = RecoveryLadder(ck).resume(state, last_committed=34)
    assert report == LadderReport(step=30, tier="durable", steps_lost=4, last_known=34)
    assert torch.equal(state["w"], tree_at(30)["w"]) and torch.equal(state["b"], tree_at(30)["b"])
    unknown = RecoveryLadder(ck).resume(blank())  # no record of the last commit: the newest
    assert unknown is not None and (unknown.steps_lost, unknown.last_known) == (0, 30)


def test_a_corrupt_newest_step_falls_back_to_the_previous(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "ck")
    for step in (10, 20, 30):
        ck.save(step, tree_at(step))
    flip_pack_byte(tmp_path / "ck", 30)
    state = blank()
    report = RecoveryLadder(ck).resume(state, last_committed=30)
    assert report is not None and (report.step, report.steps_lost) == (20, 10)
    (rejected,) = report.rejected
    assert (rejected.step, rejected.tier, rejected.ranks) == (30, "durable", (0,))
    assert "does not match its hash" in rejected.reason
    assert torch.equal(state["w"], tree_at(20)["w"])


def test_memory_first_then_the_same_step_from_disk_when_the_snapshot_is_bad(
    tmp_path: Path,
) -> None:
    tc = TieredCheckpointer(
        [
            Tier.memory(every=EveryNSteps(1), keep=KeepLast(2)),
            Tier.durable("local", tmp_path / "local", every=EveryNSteps(2)),
        ]
    )
    for step in range(1, 5):
        tc.save(step, tree_at(step))
    ladder = RecoveryLadder(tc)
    assert ladder.tiers == ["memory", "local"]
    assert ladder.listing() == ({"memory": [3, 4], "local": [2, 4]}, {})
    state = blank()
    report = ladder.resume(state)
    assert report is not None and (report.step, report.tier) == (4, "memory")
    tc.memory.find(4).data.view(-1)[0] ^= 0x01  # one flipped bit in host memory
    state = blank()
    report = ladder.resume(state)
    assert report is not None and (report.step, report.tier, report.steps_lost) == (4, "local", 0)
    assert [(r.step, r.tier) for r in report.rejected] == [(4, "memory")]
    assert "fails its digest" in report.rejected[0].reason
    assert torch.equal(state["w"], tree_at(4)["w"])
    tc.close()


def test_nothing_stored_is_a_fresh_start_unless_the_job_had_committed(tmp_path: Path) -> None:
    ladder = RecoveryLadder(Checkpointer(tmp_path / "empty"))
    assert ladder.resume(blank()) is None
    with pytest.raises(CheckpointNotFoundError, match=r"the job committed step 8.*no tier holds"):
        ladder.resume(blank(), last_committed=8)


def test_every_copy_corrupt_names_what_was_tried(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "ck")
    for step in (1, 2):
        ck.save(step, tree_at(step))
        flip_pack_byte(tmp_path / "ck", step)
    with pytest.raises(CheckpointNotFoundError) as info:
        RecoveryLadder(ck).resume(blank())
    msg = str(info.value)
    assert "step 2 (durable) on rank(s) [0]: CorruptCheckpointError" in msg
    assert "step 1 (durable)" in msg and "check the checkpoint roots" in msg


def test_a_state_that_does_not_fit_stops_instead_of_climbing(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "ck")
    ck.save(1, {"w": torch.zeros(32, 8), "data": ElasticSampler(100, 10, seed=1)})
    ck.save(2, {"w": torch.zeros(32, 8), "data": ElasticSampler(100, 10, seed=1)})
    other = {"w": torch.zeros(32, 8), "data": ElasticSampler(100, 20, seed=1)}
    with pytest.raises(StateMismatchError, match="another data stream"):
        RecoveryLadder(ck).resume(other)
    same = {"w": torch.zeros(32, 8), "data": ElasticSampler(100, 10, seed=1)}
    report = RecoveryLadder(ck).resume(same)
    assert report is not None and report.step == 2
    assert same["data"].position(report.step).cursor == 20  # where the data resumes


def test_rejected_steps_read_as_sentences() -> None:
    assert str(RejectedStep(4, "local", (1, 2), "gone")) == "step 4 (local) on rank(s) [1, 2]: gone"
    assert str(RejectedStep(None, "remote", (0,), "down")).startswith("listing (remote)")
    with pytest.raises(TypeError, match="Checkpointer or a TieredCheckpointer"):
        RecoveryLadder("/tmp/somewhere")  # type: ignore[arg-type]
