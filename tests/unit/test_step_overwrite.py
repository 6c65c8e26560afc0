"""Saving a committed step is refused unless asked for; ``overwrite=True`` replaces it atomically.

Covers ``save``, ``save_async`` (refused in the blocking phase, before anything is staged),
the tiered checkpointer (durable tiers refuse, the memory tier replays), the DCP writer and
``import_dcp``. Real disk; faults come from ``FlakyStorage``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.checkpoint.durable.manifest import manifest_key
from stalwart.errors import StepExistsError, TransientStorageError
from stalwart.storage.local import LocalStorage
from stalwart.testing import FlakyStorage


def _packs(root: Path) -> set[str]:
    return {p.name for p in (root / "packs").iterdir()}


def test_saving_a_committed_step_is_refused_and_says_what_to_do(tmp_path: Path) -> None:
    with stalwart.Checkpointer(tmp_path) as ck:
        ck.save(1, {"w": torch.ones(4)})
        ck.save(2, {"w": torch.ones(4) * 2})
        with pytest.raises(StepExistsError, match="overwrite=True") as info:
            ck.save(1, {"w": torch.zeros(4)})
        assert isinstance(info.value, FileExistsError)
        msg = str(info.value)
        assert "step 1 is already committed" in msg and "--overwrite" in msg
        assert "latest is 2" in msg and "from step 3" in msg
        assert torch.equal(ck.load(None, 1)["w"], torch.ones(4))  # untouched


def test_overwrite_replaces_the_step_and_old_chunks_become_garbage_after(tmp_path: Path) -> None:
    with stalwart.Checkpointer(tmp_path) as ck:
        ck.save(1, {"w": torch.ones(1000)})
        old = _packs(tmp_path)
        ck.save(1, {"w": torch.full((1000,), 7.0)}, overwrite=True)
        assert ck.steps() == [1]
        assert torch.equal(ck.load(None)["w"], torch.full((1000,), 7.0))
        report = ck.gc(grace_s=0)  # the old pack is referenced by no manifest any more
        assert report is not None and not old & _packs(tmp_path)
        assert torch.equal(ck.load(None)["w"], torch.full((1000,), 7.0))


def test_a_crash_before_the_commit_of_an_overwrite_leaves_the_old_step(tmp_path: Path) -> None:
    flaky = FlakyStorage(
        LocalStorage(tmp_path), fail_on=lambda op, key: op == "write" and key == manifest_key(1)
    )
    with stalwart.Checkpointer(tmp_path) as ck:
        ck.save(1, {"w": torch.ones(1000)})
    with stalwart.Checkpointer(flaky) as ck, pytest.raises(TransientStorageError):
        ck.save(1, {"w": torch.zeros(1000)}, overwrite=True)
    with stalwart.Checkpointer(tmp_path) as ck:
        assert torch.equal(ck.load(None, 1)["w"], torch.ones(1000))
        ck.gc(grace_s=0)  # the new, never committed pack may go; the old one must stay
        assert torch.equal(ck.load(None, 1)["w"], torch.ones(1000))
        assert ck.verify(1).ok


def test_save_async_refuses_before_anything_is_staged(tmp_path: Path) -> None:
    with stalwart.Checkpointer(tmp_path) as ck:
        ck.save(3, {"w": torch.ones(8)})
        with pytest.raises(StepExistsError, match="step 3 is already committed"):
            ck.save_async(3, {"w": torch.zeros(8)})
        assert not ck._async.pending  # nothing submitted, nothing staged
        ck.save_async(3, {"w": torch.zeros(8)}, overwrite=True).wait()
        assert torch.equal(ck.load(None, 3)["w"], torch.zeros(8))


def test_save_async_refuses_a_step_still_being_saved(tmp_path: Path) -> None:
    with stalwart.Checkpointer(tmp_path, stalwart.CheckpointOptions(max_inflight_saves=2)) as ck:
        first = ck.save_async(5, {"w": torch.ones(8)})
        if not first.done():
            with pytest.raises(StepExistsError):
                ck.save_async(5, {"w": torch.zeros(8)})
        first.wait()
        with pytest.raises(StepExistsError):
            ck.save_async(5, {"w": torch.zeros(8)})
        assert torch.equal(ck.load(None, 5)["w"], torch.ones(8))


def test_tiered_durable_tiers_refuse_and_the_memory_tier_replays(tmp_path: Path) -> None:
    from stalwart.checkpoint.memory.tiers import Tier, TieredCheckpointer
    from stalwart.checkpoint.policy import EveryNSteps, KeepLast

    tiers = [
        Tier(name="memory", every=EveryNSteps(1), keep=KeepLast(2)),
        Tier(name="disk", root=str(tmp_path), every=EveryNSteps(1)),
    ]
    with TieredCheckpointer(tiers) as tc:
        tc.save(1, {"w": torch.ones(4)})
        with pytest.raises(StepExistsError):
            tc.save(1, {"w": torch.zeros(4)})
        tc.save(1, {"w": torch.full((4,), 3.0)}, overwrite=True)
        assert torch.equal(tc.durable["disk"].load(None, 1)["w"], torch.full((4,), 3.0))
    memory_only = [Tier(name="memory", every=EveryNSteps(1), keep=KeepLast(2))]
    with TieredCheckpointer(memory_only) as tc:
        tc.save(1, {"w": torch.ones(4)})
        tc.save(1, {"w": torch.zeros(4)})  # a replayed step after a rollback: no error


def test_dcp_writer_refuses_a_committed_step_unless_overwrite(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from stalwart.integrations.dcp import StalwartWriter

    def save(value: float, **kw: bool) -> None:
        writer = StalwartWriter(tmp_path, **kw)
        dcp.save({"w": torch.full((4,), value)}, checkpoint_id=1, storage_writer=writer)
        writer.close()

    with pytest.warns(UserWarning):  # no process group: DCP says it runs alone
        save(1.0)
        with pytest.raises(CheckpointException, match=r"StepExistsError|already committed"):
            save(2.0)
        save(3.0, overwrite=True)
    with stalwart.Checkpointer(tmp_path) as ck:
        assert torch.equal(ck.load(None, 1)["w"], torch.full((4,), 3.0))


def test_import_dcp_refuses_a_committed_step_unless_overwrite(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from stalwart.integrations.dcp import import_dcp

    src = tmp_path / "dcp"
    with pytest.warns(UserWarning):
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(src), no_dist=True)
    root = tmp_path / "root"
    with stalwart.Checkpointer(root) as ck:
        ck.save(4, {"w": torch.zeros(4)})
    with pytest.raises(StepExistsError):
        import_dcp(src, root, 4)
    import_dcp(src, root, 4, overwrite=True)
    with stalwart.Checkpointer(root) as ck:
        assert torch.equal(ck.load(None, 4)["w"], torch.arange(4.0))
    assert json.loads((root / manifest_key(4)).read_bytes())["step"] == 4
