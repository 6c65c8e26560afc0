"""Two writers on one root, in two real processes: nothing a committed step needs goes.

The order that lost data (issue 9, item 1): A saves step 2; B saves step 1, then step 2 again,
deduplicated entirely against step 1's pack; A saves step 3 with ``KeepLast(2)``. A's retention
must read the step 2 that is on disk (B's), keep step 1's pack that it references, and A must
load B's step 2, not the copy it wrote and cached.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

import stalwart
from stalwart.checkpoint.durable.lease import Lease, read_leases
from stalwart.checkpoint.durable.manifest import manifest_key
from stalwart.checkpoint.policy import KeepLast
from stalwart.storage import LocalStorage

pytestmark = pytest.mark.timeout(120)


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4096, generator=g), "seed": seed}


def _writer(root: str, keep_last: int | None, conn: Connection) -> None:
    """A process that owns one Checkpointer and runs the commands it receives, in order."""
    keep = KeepLast(keep_last) if keep_last else stalwart.CheckpointOptions().keep
    ckpt = stalwart.Checkpointer(root, stalwart.CheckpointOptions(keep=keep))
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "save":
                ckpt.save(args[0], _state(args[1]), overwrite=True)  # B replaces A's step 2
                conn.send(("ok", None))
            elif cmd == "saves":  # a run of steps, while another process does the same
                for step in range(*args[0]):
                    ckpt.save(step, _state(step))
                conn.send(("ok", None))
            elif cmd == "load":
                tree = ckpt.load(None, args[0])
                conn.send(("ok", (tree["w"].numpy().tobytes(), tree["seed"])))
            elif cmd == "lease":  # hold a lease, then die without releasing it
                Lease(ckpt.storage, steps=args[0], packs=[], lease_s=3600).__enter__()
                conn.send(("ok", None))
                os._exit(0)
            else:
                ckpt.close()
                conn.send(("ok", None))
                return
        except Exception as e:
            conn.send(("error", repr(e)))


class _Process:
    """A writer process driven step by step, so that the interleaving is deterministic."""

    def __init__(self, root: Path, keep_last: int | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_writer, args=(str(root), keep_last, child), daemon=True)
        self.proc.start()

    def __call__(self, *cmd: Any) -> Any:
        self.send(*cmd)
        return self.result()

    def send(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def result(self) -> Any:
        status, value = self.conn.recv()
        assert status == "ok", value
        return value

    def close(self) -> None:
        if self.proc.is_alive():
            self("close")
        self.proc.join(30)


def _packs_of(root: Path, step: int) -> set[str]:
    return stalwart.Checkpointer(root).manifest(step).packs()


def test_second_writer_cannot_make_the_first_delete_its_packs(tmp_path: Path) -> None:
    a, b = _Process(tmp_path, keep_last=2), _Process(tmp_path)
    try:
        a("save", 2, 20)
        b("save", 1, 10)
        step1_packs = _packs_of(tmp_path, 1)
        b("save", 2, 10)  # same tensors as step 1: fully deduplicated against its pack
        assert _packs_of(tmp_path, 2) == step1_packs, "scenario: B's step 2 reuses step 1's pack"
        expected = _state(10)["w"].numpy().tobytes()
        a("save", 3, 30)  # KeepLast(2): step 1 goes, but its pack is step 2's too

        assert stalwart.Checkpointer(tmp_path).steps() == [2, 3]
        assert all((tmp_path / p).is_file() for p in step1_packs)
        assert a("load", 2) == (expected, 10)  # A sees the step 2 on disk, not its own copy
        fresh = stalwart.Checkpointer(tmp_path)
        loaded = fresh.load(None, 2)
        assert loaded["w"].numpy().tobytes() == expected and loaded["seed"] == 10
        assert fresh.verify(2).ok and fresh.verify(3).ok
        # gc afterwards (A's old step-2 pack is garbage now) must not hurt either step.
        report = fresh.gc(grace_s=0)
        assert not set(report.deleted_packs) & (_packs_of(tmp_path, 2) | _packs_of(tmp_path, 3))
        assert fresh.verify(2).ok and fresh.verify(3).ok
    finally:
        a.close()
        b.close()


def test_a_dead_writers_lease_on_this_host_holds_nothing_back(tmp_path: Path) -> None:
    ckpt = stalwart.Checkpointer(tmp_path, stalwart.CheckpointOptions(keep=KeepLast(1)))
    ckpt.save(1, _state(1))
    dead = _Process(tmp_path)
    dead("lease", [1])  # the process exits right after writing its lease
    dead.proc.join(30)
    store = LocalStorage(tmp_path)
    assert len(store.list("leases/")) == 1 and read_leases(store).steps == set()
    ckpt.save(2, _state(2))  # retention may delete step 1 at once: its lease's owner is gone
    assert ckpt.steps() == [2]
    ckpt.gc(grace_s=0)
    assert store.list("leases/") == []


def test_a_live_lease_keeps_its_step(tmp_path: Path) -> None:
    ckpt = stalwart.Checkpointer(tmp_path, stalwart.CheckpointOptions(keep=KeepLast(1)))
    ckpt.save(1, _state(1))
    with Lease(ckpt.storage, steps=[1], packs=[], lease_s=60):  # held by this live process
        ckpt.save(2, _state(2))
        assert ckpt.steps() == [1, 2]
    ckpt.save(3, _state(3))
    assert ckpt.steps() == [3]


def test_a_step_committed_during_retention_keeps_its_packs(tmp_path: Path) -> None:
    # Another writer commits step 5, deduplicated against step 1's pack, right after our
    # retention read the manifests and before it deletes step 1's packs.
    ckpt = stalwart.Checkpointer(tmp_path)
    ckpt.save(1, _state(1))
    ckpt.save(2, _state(2))
    m1 = ckpt.manifest(1)
    store = ckpt.storage
    real_delete = store.delete

    def delete(key: str) -> None:
        real_delete(key)
        if key == manifest_key(1):  # the un-commit: now someone commits a step using pack 1
            store.write(manifest_key(5), [dataclasses.replace(m1, step=5).to_bytes()])

    store.delete = delete  # type: ignore[method-assign]
    from stalwart.checkpoint.durable.gc import apply_retention

    report = apply_retention(store, KeepLast(1), [1, 2], ckpt.manifest)
    assert report.deleted_steps == [1] and report.deleted_packs == []
    assert ckpt.verify(5).ok


def test_a_deleted_root_is_recreated_by_the_next_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil

    root = tmp_path / "ckpt"
    ckpt = stalwart.Checkpointer(root)
    ckpt.save(1, _state(1))
    shutil.rmtree(root)
    ckpt.save(2, _state(2))
    assert "was deleted while this Checkpointer was open" in caplog.text
    assert ckpt.steps() == [2] and ckpt.load(None)["seed"] == 2


class _CountingStorage(LocalStorage):
    reads = 0

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        self.reads += 1
        return super().read(key, offset, length)


def test_manifest_cache_trusts_size_and_mtime_only_outside_the_racy_window(
    tmp_path: Path,
) -> None:
    from stalwart.checkpoint.durable.manifest_cache import RACY_S, ManifestCache

    stalwart.Checkpointer(tmp_path).save(1, _state(1))
    store, cache, key = _CountingStorage(tmp_path), ManifestCache(), manifest_key(1)
    base = stalwart.Checkpointer(tmp_path).manifest(1)
    x, y = (dataclasses.replace(base, metadata={"v": v}).to_bytes() for v in "xy")
    assert len(x) == len(y)

    def put(data: bytes, mtime: float) -> Any:
        store.write(key, [data])
        os.utime(tmp_path / key, (mtime, mtime))
        (info,) = store.list("manifests/")
        return info

    now = os.stat(tmp_path / key).st_mtime
    assert cache.get(store, 1, listed=put(x, now)).metadata == {"v": "x"}
    # Replaced within the same timestamp tick, same size: identical (size, mtime), yet seen.
    assert cache.get(store, 1, listed=put(y, now)).metadata == {"v": "y"}
    old = now - 10 * RACY_S
    assert cache.get(store, 1, listed=put(x, old)).metadata == {"v": "x"}
    reads = store.reads
    (info,) = store.list("manifests/")
    assert cache.get(store, 1, listed=info).metadata == {"v": "x"} and store.reads == reads
    assert cache.get(store, 1).metadata == {"v": "x"} and store.reads == reads + 1
    store.write(key, [y])  # a real replacement gets a new mtime: the listing made after sees it
    (info,) = store.list("manifests/")
    assert cache.get(store, 1, listed=info).metadata == {"v": "y"}


def _unreferenced_bytes(root: Path) -> tuple[int, int]:
    """(bytes of packs no manifest references, bytes of all packs)."""
    ck = stalwart.Checkpointer(root)
    referenced = set().union(set(), *(ck.manifest(s).packs() for s in ck.steps()))
    packs = LocalStorage(root).list("packs/")
    return sum(i.size for i in packs if i.key not in referenced), sum(i.size for i in packs)


def test_packs_retention_left_to_a_lease_are_reclaimed_by_gc(tmp_path: Path) -> None:
    # Why two writers left most of their bytes behind (issue 23): each one's retention runs
    # while the other's save holds a lease on every pack it may deduplicate against, so the
    # retired steps' packs are kept, and nothing remembers them. They are garbage the moment
    # the lease ends; leases now protect saves in flight, so gc with no grace reclaims them.
    ckpt = stalwart.Checkpointer(tmp_path, stalwart.CheckpointOptions(keep=KeepLast(1)))
    ckpt.save(1, _state(1))
    step1 = _packs_of(tmp_path, 1)
    with Lease(ckpt.storage, steps=[], packs=step1, lease_s=60):  # the other writer's dedup
        ckpt.save(2, _state(2))
        assert ckpt.steps() == [2] and all((tmp_path / p).exists() for p in step1)
        assert not set(ckpt.gc(grace_s=0).deleted_packs) & step1  # still leased
    assert ckpt.gc().deleted_packs == []  # the default grace still waits for lease-less writers
    assert sorted(ckpt.gc(grace_s=0).deleted_packs) == sorted(step1)
    assert _unreferenced_bytes(tmp_path)[0] == 0 and ckpt.verify(2).ok


def test_two_concurrent_writers_leave_no_garbage_after_a_final_gc(tmp_path: Path) -> None:
    a, b = _Process(tmp_path, keep_last=2), _Process(tmp_path, keep_last=2)
    try:
        a.send("saves", (0, 40, 2))
        b.send("saves", (1, 41, 2))
        a.result()
        b.result()
        left, total = _unreferenced_bytes(tmp_path)
        report = stalwart.Checkpointer(tmp_path).gc(grace_s=0)  # no writer runs now
        assert report.bytes_freed == left and _unreferenced_bytes(tmp_path)[0] == 0, (left, total)
        fresh = stalwart.Checkpointer(tmp_path)
        assert fresh.steps() == [38, 39]
        for step in fresh.steps():
            assert fresh.load(None, step)["seed"] == step and fresh.verify(step).ok
    finally:
        a.close()
        b.close()
