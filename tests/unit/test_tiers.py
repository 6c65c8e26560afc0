"""Tiers on one process: schedules, retention, and recovery from the fastest tier that has it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stalwart.checkpoint.durable.manifest import manifest_key
from stalwart.checkpoint.memory.tiers import Tier, TieredCheckpointer
from stalwart.checkpoint.policy import AnyOf, EveryNSeconds, EveryNSteps, KeepLast
from stalwart.errors import CheckpointNotFoundError, ConfigError

pytestmark = pytest.mark.timeout(120)


def state_at(step: int) -> dict:
    return {"w": torch.full((64, 64), float(step)), "step": step}


def blank() -> dict:
    return {"w": torch.zeros(64, 64), "step": 0}


def make(tmp_path: Path, name: str = "run") -> TieredCheckpointer:
    return TieredCheckpointer(
        [
            Tier(name="memory", every=EveryNSteps(1), keep=KeepLast(2)),
            Tier(name="local", root=tmp_path / "local", every=EveryNSteps(2), keep=KeepLast(2)),
            Tier(name="remote", root=f"memory://{tmp_path.name}-{name}", every=EveryNSteps(4)),
        ]
    )


def test_each_tier_saves_on_its_schedule_and_keeps_its_own(tmp_path: Path) -> None:
    tc = make(tmp_path)
    for step in range(1, 9):
        tc.save(step, state_at(step))
    assert [s.step for s in tc.snapshots] == [7, 8]
    assert tc.durable["local"].steps() == [6, 8]
    assert tc.durable["remote"].steps() == [4, 8]


def test_recovery_prefers_memory_then_local_then_remote(tmp_path: Path) -> None:
    tc = make(tmp_path)
    for step in range(1, 8):
        tc.save(step, state_at(step))
    target = blank()
    report = tc.recover(target)
    assert (report.source, report.step) == ("memory", 7) and target["w"][0, 0].item() == 7.0

    tc.drop_memory()  # the process restarted: its memory tier is gone
    target = blank()
    report = tc.recover(target)
    assert (report.source, report.step) == ("local", 6) and target["w"][0, 0].item() == 6.0
    assert report.attempts[0][0] == "memory"

    for p in (tmp_path / "local" / "packs").iterdir():
        p.unlink()  # the local disk lost its data: local fails, remote serves step 4
    target = blank()
    report = tc.recover(target)
    assert (report.source, report.step) == ("remote", 4) and target["w"][0, 0].item() == 4.0
    assert [name for name, _ in report.attempts] == ["memory", "local", "local"]  # 6, then 4


def test_nothing_anywhere_is_a_clear_error(tmp_path: Path) -> None:
    tc = make(tmp_path, "empty")
    with pytest.raises(CheckpointNotFoundError, match="no tier holds a recoverable step"):
        tc.recover(blank())


def test_async_tiers_and_guard(tmp_path: Path) -> None:
    tc = make(tmp_path, "async")
    layer = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    tc.guard(opt)
    for step in range(1, 5):
        before = layer.weight.detach().clone()
        tc.save_async(step, {"layer": layer}, lazy=True)
        layer(torch.randn(2, 32)).sum().backward()
        opt.step()
        tc.wait()
        if step % 2 == 0:
            loaded = tc.durable["local"].load(None, step)
            assert torch.equal(loaded["layer"]["weight"], before)
    # the lazy memory snapshot of the last step holds the pre-step weights too
    restored = torch.nn.Linear(32, 32)
    report = tc.recover({"layer": restored})
    assert (report.source, report.step) == ("memory", 4)
    assert torch.equal(restored.weight, before)
    tc.close()


def test_time_based_policy() -> None:
    every = EveryNSeconds(10.0)
    assert every.due(1, 100.0, None, None)
    assert not every.due(2, 105.0, 1, 100.0)
    assert every.due(3, 110.0, 1, 100.0)
    either = AnyOf(EveryNSteps(100), EveryNSeconds(10.0))
    assert either.due(200, 101.0, 199, 100.0) and not either.due(201, 101.0, 200, 100.0)
    with pytest.raises(ConfigError):
        EveryNSeconds(0)
    with pytest.raises(ConfigError, match="unique"):
        TieredCheckpointer([Tier(name="a"), Tier(name="a", root="memory://x")])
    with pytest.raises(ConfigError, match="one memory tier"):
        TieredCheckpointer([Tier(name="a"), Tier(name="b")])


def test_damaged_newest_local_step_falls_back_within_the_tier(tmp_path: Path) -> None:
    tc = make(tmp_path, "fallback")
    for step in range(1, 7):
        tc.save(step, state_at(step))
    (tmp_path / "local" / manifest_key(6)).write_text("garbage")
    restarted = make(tmp_path, "fallback")  # a new process: empty memory, no cached manifests
    target = blank()
    report = restarted.recover(target)
    assert (report.source, report.step) == ("local", 4) and target["w"][0, 0].item() == 4.0


def test_recovery_takes_the_newest_step_of_any_tier(tmp_path: Path) -> None:
    def tiers() -> TieredCheckpointer:  # the slower tier saves more often (a time policy)
        return TieredCheckpointer(
            [
                Tier(name="memory", every=EveryNSteps(1), keep=KeepLast(2)),
                Tier(name="local", root=tmp_path / "l", every=EveryNSteps(10), keep=KeepLast(2)),
                Tier(name="remote", root=tmp_path / "r", every=EveryNSteps(3), keep=KeepLast(2)),
            ]
        )

    tc = tiers()
    for step in range(1, 13):
        tc.save(step, state_at(step))
    tc.close()
    assert tc.durable["local"].steps() == [10] and tc.durable["remote"].steps() == [9, 12]
    restarted, target = tiers(), blank()
    report = restarted.recover(target)
    assert (report.source, report.step) == ("remote", 12) and target["w"][0, 0].item() == 12.0
    restarted.save(13, state_at(13))  # training goes on from there
    restarted.close()

    (tmp_path / "r" / manifest_key(12)).write_text("garbage")  # the newest step is damaged:
    again, target = tiers(), blank()  # the next newest, in whichever tier holds it
    report = again.recover(target)
    assert (report.source, report.step) == ("local", 10) and target["w"][0, 0].item() == 10.0
    assert report.attempts[-1][0] == "remote" and "step 12" in report.attempts[-1][1]
    again.close()


KEEPER_CHILD = """
import os, signal, sys, torch
from stalwart.checkpoint.policy import EveryNSteps, KeepLast
from stalwart.checkpoint.memory.tiers import Tier, TieredCheckpointer
tc = TieredCheckpointer([Tier(name="memory", every=EveryNSteps(1), keep=KeepLast(2),
                              keep_in=sys.argv[1])])
for step in (1, 2, 3):
    tc.save(step, {"w": torch.full((64, 64), float(step)), "step": step})
os.kill(os.getpid(), signal.SIGKILL)  # the trainer dies; its snapshots stay in the tmpfs
"""


def test_kept_snapshots_outlive_a_killed_trainer(tmp_path: Path) -> None:
    import shutil
    import signal
    import subprocess
    import sys
    import uuid

    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    keep_in = shm / f"stalwart-test-{uuid.uuid4().hex[:8]}"
    try:
        proc = subprocess.run([sys.executable, "-c", KEEPER_CHILD, str(keep_in)], timeout=120)
        assert proc.returncode == -signal.SIGKILL
        restarted = TieredCheckpointer(
            [Tier(name="memory", every=EveryNSteps(1), keep=KeepLast(2), keep_in=keep_in)]
        )
        assert [s.step for s in restarted.snapshots] == [2, 3]
        target = blank()
        report = restarted.recover(target)
        assert (report.source, report.step) == ("memory", 3)
        assert torch.equal(target["w"], torch.full((64, 64), 3.0)) and report.tree["step"] == 3
        # a damaged blob is ignored, not restored
        blob = next(keep_in.glob("rank00000-slot*.buf"))
        data = bytearray(blob.read_bytes())
        data[0] ^= 0xFF
        blob.write_bytes(bytes(data))
        again = TieredCheckpointer(
            [Tier(name="memory", every=EveryNSteps(1), keep=KeepLast(2), keep_in=keep_in)]
        )
        assert len(again.snapshots) == 1
    finally:
        shutil.rmtree(keep_in, ignore_errors=True)


def test_recover_reports_its_source_to_the_event_listener(tmp_path: Path) -> None:
    from stalwart import CheckpointOptions
    from stalwart.checkpoint.events import CheckpointEvent

    seen: list[CheckpointEvent] = []
    tiers = [Tier(name="memory", keep=KeepLast(1)), Tier(name="disk", root=tmp_path / "d")]
    state = {"w": torch.arange(4.0)}
    with TieredCheckpointer(tiers, options=CheckpointOptions(on_event=seen.append)) as tc:
        tc.save(3, state)
        report = tc.recover({"w": torch.zeros(4)})
        tc.drop_memory()
        from_disk = tc.recover({"w": torch.zeros(4)})
    recovers = [e for e in seen if e.kind == "recover"]
    assert [e.metadata["source"] for e in recovers] == [report.source, from_disk.source]
    assert report.source == "memory" and from_disk.source == "disk"
    assert all(e.step == 3 for e in recovers)


def test_a_memory_tier_keeps_only_the_newest_snapshots() -> None:
    from stalwart.checkpoint.policy import KeepEvery

    with pytest.raises(ConfigError, match=r"give keep=KeepLast\(n\)"):
        Tier(name="memory", keep=KeepEvery(100))  # was silently turned into KeepLast(2)


def test_a_resaved_step_replaces_it_and_the_abandoned_later_snapshots(tmp_path: Path) -> None:
    """A run that went back (resume, elastic rollback) re-saves a step the memory tier holds:
    the old copy and every later snapshot belong to the abandoned timeline."""
    tc = TieredCheckpointer([Tier(name="memory", every=EveryNSteps(1), keep=KeepLast(3))])
    for step in range(1, 5):
        tc.save(step, state_at(step))
    assert [s.step for s in tc.snapshots] == [2, 3, 4]
    tc.save(3, {"w": torch.full((64, 64), 30.0), "step": 3})
    assert [s.step for s in tc.snapshots] == [2, 3]
    target = blank()
    report = tc.recover(target)
    assert (report.source, report.step) == ("memory", 3) and target["w"][0, 0].item() == 30.0
    for step in (4, 5):  # the tier goes on as usual, reusing the forgotten buffers
        tc.save(step, state_at(step))
    assert [s.step for s in tc.snapshots] == [3, 4, 5]


def test_close_closes_every_tier_when_one_raises(tmp_path: Path) -> None:
    import threading

    from stalwart.errors import CheckpointError, StorageFullError
    from stalwart.storage import LocalStorage
    from stalwart.testing import FlakyStorage

    full = FlakyStorage(  # the first tier's disk is full: its save fails in the background
        LocalStorage(tmp_path / "local"),
        fail_on=lambda op, key: op == "write" and key.startswith("packs/"),
        error=StorageFullError,
    )
    before = set(threading.enumerate())
    tc = TieredCheckpointer(
        [
            Tier(name="local", root=full, every=EveryNSteps(1)),
            Tier(name="remote", root=tmp_path / "remote", every=EveryNSteps(1)),
        ]
    )
    tc.save_async(1, state_at(1))  # never waited on
    with pytest.raises(CheckpointError, match="step 1"):
        tc.close()  # the failure is raised, after every tier closed
    left = [t.name for t in set(threading.enumerate()) - before]
    assert not [n for n in left if n.startswith(("stalwart-persist", "stalwart-stage"))]
    assert tc.durable["remote"].steps() == [1]


def test_a_with_block_already_failing_keeps_its_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from stalwart.errors import StorageFullError
    from stalwart.storage import LocalStorage
    from stalwart.testing import FlakyStorage

    full = FlakyStorage(
        LocalStorage(tmp_path / "local"),
        fail_on=lambda op, key: op == "write" and key.startswith("packs/"),
        error=StorageFullError,
    )
    tiers = [Tier(name="local", root=full, every=EveryNSteps(1))]
    with pytest.raises(KeyError, match="the user's own"), TieredCheckpointer(tiers) as tc:
        tc.save_async(1, state_at(1))
        raise KeyError("the user's own")
    assert "step 1" in caplog.text  # the lost save is logged, not raised over the user's error
