"""gc never robs a save or a load in flight, and a retired step is reported as retired.

Issue 23, item 4: ``gc --grace-s 0`` deleted the temporaries (leases, packs) of saves and loads
in flight, and a step retired while it was being loaded came out as a corrupt checkpoint.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import stalwart
from stalwart.checkpoint.durable.lease import Lease
from stalwart.checkpoint.durable.manifest import manifest_key
from stalwart.checkpoint.policy import KeepLast
from stalwart.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StepRetiredError,
)
from stalwart.storage import LocalStorage
from stalwart.storage.base import Buffer, ObjectInfo, Storage

pytestmark = pytest.mark.timeout(120)

OPTS = stalwart.CheckpointOptions(chunk_bytes=4096)


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    frozen = torch.full((1024,), float(step % 2))  # every other step dedups against it
    return {"w": torch.randn(2048, generator=g), "frozen": frozen, "step": step}


class HookedStorage:
    """Delegates to ``inner``; ``before(op, key)`` runs first (once per armed hook)."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self.hooks: dict[str, Any] = {}

    def _run(self, op: str, key: str) -> None:
        for prefix in [p for p in self.hooks if f"{op} {key}".startswith(p)]:
            self.hooks.pop(prefix)()

    def write(self, key: str, data: Iterable[Buffer]) -> int:
        self._run("write", key)
        return self.inner.write(key, data)

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        self._run("read_into", key)
        return self.inner.read_into(key, offset, out)

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        self._run("read", key)
        return self.inner.read(key, offset, length)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self.inner.list(prefix)

    def close(self) -> None:
        self.inner.close()


def _retire(store: Storage, step: int) -> None:
    """What retention or ``ckpt rm`` + gc do to ``step``: manifest first, then its packs."""
    ck = stalwart.Checkpointer(store)
    doomed = ck.manifest(step).packs()
    store.delete(manifest_key(step))
    for p in doomed - set().union(*(ck.manifest(s).packs() for s in ck.steps())):
        store.delete(p)


def _hooked(tmp_path: Path) -> tuple[HookedStorage, stalwart.Checkpointer]:
    with stalwart.Checkpointer(tmp_path, OPTS) as ck:
        for s in (1, 2):
            ck.save(s, _state(s))
    store = HookedStorage(LocalStorage(tmp_path))
    return store, stalwart.Checkpointer(store, OPTS)


def test_a_step_retired_before_the_readers_lease_is_reported_retired(tmp_path: Path) -> None:
    store, ck = _hooked(tmp_path)
    store.hooks["write leases/"] = lambda: _retire(store.inner, 1)  # between manifest and lease
    with pytest.raises(StepRetiredError, match="step 1 was deleted while it was being loaded"):
        ck.load(None, 1)
    assert torch.equal(ck.load(None, 2)["w"], _state(2)["w"])


def test_a_step_retired_during_the_read_is_reported_retired(tmp_path: Path) -> None:
    # Packs vanish under the reader's lease (a tool that ignores leases, or one that expired).
    store, ck = _hooked(tmp_path)
    store.hooks["read_into packs/"] = lambda: _retire(store.inner, 1)
    with pytest.raises(StepRetiredError, match="committed steps now: 2") as e:
        ck.load(None, 1)
    assert isinstance(e.value, CheckpointNotFoundError)


def test_fallback_moves_past_a_step_retired_during_the_read(tmp_path: Path) -> None:
    store, ck = _hooked(tmp_path)
    store.hooks["read_into packs/"] = lambda: _retire(store.inner, 2)  # the newest goes
    target = {"w": torch.zeros(2048), "frozen": torch.zeros(1024), "step": 0}
    ck.load(target, 2, fallback=True)
    assert target["step"] == 1 and torch.equal(target["w"], _state(1)["w"])


def test_a_step_replaced_and_collected_during_the_read_is_reported(tmp_path: Path) -> None:
    store, ck = _hooked(tmp_path)

    def replace() -> None:
        old = stalwart.Checkpointer(store.inner).manifest(1).packs()
        with stalwart.Checkpointer(store.inner, OPTS) as other:
            other.save(1, {"w": torch.zeros(2048), "frozen": torch.zeros(8)}, overwrite=True)
        for p in old - stalwart.Checkpointer(store.inner).manifest(1).packs():
            store.inner.delete(p)

    store.hooks["read_into packs/"] = replace
    with pytest.raises(StepRetiredError, match="replaced by another save"):
        ck.load(None, 1)


@pytest.mark.parametrize("moment", ["write leases/", "read_into packs/"])
def test_read_tensor_and_verify_report_a_retired_step_as_retired(
    tmp_path: Path, moment: str
) -> None:
    store, ck = _hooked(tmp_path)  # before their lease, or under it by a tool that ignores it
    store.hooks[moment] = lambda: _retire(store.inner, 1)
    with pytest.raises(StepRetiredError, match="step 1 was deleted"):
        ck.read_tensor(1, "w")
    store.hooks[moment] = lambda: _retire(store.inner, 2)
    with pytest.raises(StepRetiredError, match="step 2 was deleted"):
        ck.verify(2)


def test_read_tensor_leases_what_it_reads(tmp_path: Path) -> None:
    store, ck = _hooked(tmp_path)
    other = stalwart.Checkpointer(store.inner)
    refused: list[str] = []

    def rm() -> None:
        with pytest.raises(CheckpointError, match="being read now") as e:
            other.delete(1)
        refused.append(str(e.value))

    store.hooks["read_into packs/"] = rm
    tensor, _ = ck.read_tensor(1, "w")
    assert refused and torch.equal(tensor, _state(1)["w"])


def test_a_missing_pack_of_a_committed_step_is_still_corruption(tmp_path: Path) -> None:
    store, ck = _hooked(tmp_path)
    packs = ck.manifest(1).packs()
    store.hooks["read_into packs/"] = lambda: [store.inner.delete(p) for p in packs]
    with pytest.raises(CorruptCheckpointError, match="pack file is missing"):
        ck.load(None, 1)


def test_a_pack_written_under_a_live_lease_survives_gc_without_grace(tmp_path: Path) -> None:
    with stalwart.Checkpointer(tmp_path, OPTS) as ck:
        ck.save(1, _state(1))
        store = ck.storage
        old = f"packs/step-{0:020d}-rank00000-{uuid.uuid4().hex[:12]}.pack"
        store.write(old, [b"a crashed save's pack"])
        os.utime(tmp_path / old, (time.time() - 60, time.time() - 60))
        with Lease(store, steps=[], packs=[], lease_s=60):  # as a save holds while it runs
            fresh = f"packs/step-{2:020d}-rank00000-{uuid.uuid4().hex[:12]}.pack"
            store.write(fresh, [b"a save's pack, before its manifest"])
            report = ck.gc(grace_s=0)
            assert report.deleted_packs == [old] and (tmp_path / fresh).exists()
        assert ck.gc(grace_s=0).deleted_packs == [fresh]  # that save died: now it is garbage


def test_a_step_deleted_while_a_save_dedups_against_it_keeps_its_packs(tmp_path: Path) -> None:
    # The writer leases the steps it lists, reads their manifests, then leases their packs.
    # `ckpt rm 1` + `ckpt gc` in that window used to delete the pack step 3 then committed.
    with stalwart.Checkpointer(tmp_path, OPTS) as ck:
        ck.save(1, _state(1))  # step 3 stores the same "frozen" chunks: it dedups against 1
    hour_ago = time.time() - 3600  # saved long ago: no grace and no in-flight rule keeps it
    for f in (tmp_path / "packs").iterdir():
        os.utime(f, (hour_ago, hour_ago))
    store = HookedStorage(LocalStorage(tmp_path))
    removed: list[list[str]] = []

    def rm_and_gc() -> None:  # another process, between the manifests' read and pack lease
        other = stalwart.Checkpointer(store.inner)
        other.delete(1)
        removed.append(other.gc(grace_s=0).deleted_packs)

    # the first lease is the listing's; the hook fires before the second, the packs' lease
    store.hooks["write leases/"] = lambda: store.hooks.update({"write leases/": rm_and_gc})
    ck = stalwart.Checkpointer(store, OPTS)
    assert ck.save(3, _state(3)).bytes_reused > 0
    assert removed == [[]] and ck.steps() == [3] and ck.verify(3).ok
    assert torch.equal(ck.load(None, 3)["frozen"], _state(3)["frozen"])
    assert ck.gc(grace_s=0).deleted_packs == []  # step 3 references step 1's pack now


def test_a_temporary_being_written_survives_gc_without_grace(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    started, go = threading.Event(), threading.Event()

    def slow() -> Iterator[bytes]:
        yield b"first half"
        started.set()
        assert go.wait(30)
        yield b"second half"

    t = threading.Thread(target=lambda: store.write("packs/p", slow()))
    t.start()
    assert started.wait(30)
    (temp,) = [p for p in (tmp_path / "packs").iterdir() if p.name.startswith(".tmp-")]
    os.utime(temp, (0, 0))  # very old by its mtime: only its writer's claim protects it
    dead = tmp_path / "packs" / f".tmp-{uuid.uuid4().hex}-q"
    dead.write_bytes(b"a killed writer's")  # nobody holds it: goes at once with no grace
    assert store.remove_stale_temps(0) == 1 and temp.exists() and not dead.exists()
    go.set()
    t.join(30)
    assert store.read("packs/p") == b"first halfsecond half"


def test_gc_without_grace_in_a_loop_fails_no_save_or_load(tmp_path: Path) -> None:
    rng = random.Random(23)
    stop = threading.Event()
    errors: list[str] = []
    committed: list[int] = []
    retired = [0]
    runs = {"loads": 0, "gcs": 0}
    opts = stalwart.CheckpointOptions(chunk_bytes=4096, keep=KeepLast(3))

    def guarded(body: Any) -> Any:
        def run() -> None:
            try:
                body()
            except Exception as e:  # every failure is reported by the assertion below
                errors.append(f"{body.__name__}: {type(e).__name__}: {e}")
                stop.set()

        return run

    @guarded
    def saves() -> None:
        with stalwart.Checkpointer(tmp_path, opts) as ck:
            for step in range(1, 61):
                ck.save(step, _state(step))
                committed.append(step)
                time.sleep(rng.random() * 0.01)
        stop.set()

    @guarded
    def loads() -> None:
        with stalwart.Checkpointer(tmp_path, opts) as ck:
            while not stop.is_set():
                steps = ck.steps()
                if not steps:
                    continue
                step = steps[rng.randrange(len(steps))]
                try:
                    tree = ck.load(None, step)
                except (StepRetiredError, CheckpointNotFoundError):
                    retired[0] += 1  # retention took it: said so, not called corrupt
                    continue
                assert torch.equal(tree["w"], _state(step)["w"]), f"step {step}: wrong data"
                runs["loads"] += 1

    @guarded
    def collects() -> None:
        while not stop.is_set():
            with stalwart.Checkpointer(tmp_path, opts) as ck:
                ck.gc(grace_s=0)
            runs["gcs"] += 1

    threads = [threading.Thread(target=f) for f in (saves, loads, collects)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not errors, errors
    assert runs["loads"] >= 5 and runs["gcs"] >= 5, runs  # the race was run, not skipped
    assert committed == list(range(1, 61))
    with stalwart.Checkpointer(tmp_path, opts) as ck:
        # Retention keeps a step a reader has leased (gc.apply_retention), so a load of step
        # 57 still running when step 60's retention ran leaves 57 for the next pass: the one
        # below, now that nothing reads.
        assert ck.steps()[-3:] == [58, 59, 60] and len(ck.steps()) <= 4
        ck.gc(grace_s=0)
        assert ck.steps() == [58, 59, 60]
        referenced = set().union(*(ck.manifest(s).packs() for s in ck.steps()))
        assert {i.key for i in ck.storage.list("packs/")} == referenced
        assert not [p for p in tmp_path.rglob(".tmp-*")] and not ck.storage.list("leases/")


def test_a_lease_a_crash_left_empty_is_kept_an_hour_then_removed(tmp_path: Path) -> None:
    """Leases are not flushed, so a host crash may leave one empty; gc's read of the leases
    drops it once it is an hour old, and never counts it as live."""
    from stalwart.checkpoint.durable.lease import UNREADABLE_S, read_leases

    store = LocalStorage(tmp_path)
    store.write("leases/0123456789abcdef0123456789abcdef.json", [b""])
    with Lease(store, steps=[4], packs=["packs/p"], lease_s=7200.0) as live:
        made = store.list("leases/")[0].mtime
        soon = read_leases(store, remove_expired=True, clock=lambda: made + 60)
        assert soon.steps == {4} and len(store.list("leases/")) == 2
        later = read_leases(store, remove_expired=True, clock=lambda: made + UNREADABLE_S + 1)
        assert later.steps == {4}
        assert [i.key for i in store.list("leases/")] == [live.key]
