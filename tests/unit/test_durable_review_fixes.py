"""Review of the durable engine: reads on a full disk, space a failed or killed save kept, and a
save that deduplicated against a pack an overwrite and a gc took from under it.

Full disks come from wrappers (``FlakyStorage`` raising ``StorageFullError``), killed writers
from a child process that ``SIGKILL``s itself mid-write, races from hooks on a store wrapper.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import stalwart
from stalwart.checkpoint import Tier, TieredCheckpointer
from stalwart.checkpoint.durable.gc import collect_garbage
from stalwart.errors import StorageError, StorageFullError
from stalwart.storage import LocalStorage
from stalwart.storage.base import Buffer, ObjectInfo, Storage
from stalwart.storage.temps import CLAIMED_NAME, TEMP_NAME, create_claimed
from stalwart.testing import FlakyStorage

pytestmark = pytest.mark.timeout(120)

OPTS = stalwart.CheckpointOptions(chunk_bytes=4096)
HOUR_AGO = time.time() - 3600


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(2048, generator=g), "frozen": torch.zeros(1024), "step": step}


def _saved(root: Path, steps: Iterable[int] = (1, 2)) -> None:
    with stalwart.Checkpointer(root, OPTS) as ck:
        for s in steps:
            ck.save(s, _state(s))


def _age(root: Path) -> None:
    """Files saved an hour ago: neither the grace nor a live lease's age keeps them."""
    for f in root.rglob("*"):
        if f.is_file():
            os.utime(f, (HOUR_AGO, HOUR_AGO))


def _packs(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "packs").iterdir())


def _full(root: Path, where: str = "") -> FlakyStorage:
    """The store of ``root`` on a full disk: every write under ``where`` fails, as ENOSPC does."""
    return FlakyStorage(
        LocalStorage(root),
        fail_on=lambda op, key: op == "write" and key.startswith(where),
        error=StorageFullError,
    )


class Hooked:
    """Delegates to ``inner``; an armed hook runs once, before the first call that matches."""

    def __init__(self, inner: Storage) -> None:
        self.inner, self.url = inner, inner.url
        self.hooks: list[tuple[str, Callable[[], object]]] = []

    def _run(self, call: str) -> None:
        for hook in [h for h in self.hooks if call.startswith(h[0])]:
            self.hooks.remove(hook)
            hook[1]()

    def write(self, key: str, data: Iterable[Buffer]) -> int:
        self._run(f"write {key}")
        return self.inner.write(key, data)

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        return self.inner.read_into(key, offset, out)

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        return self.inner.read(key, offset, length)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        self._run(f"list {prefix}")
        return self.inner.list(prefix)

    def close(self) -> None:
        self.inner.close()


def _pause(reached: threading.Event, go: threading.Event) -> Callable[[], None]:
    def hook() -> None:
        reached.set()
        assert go.wait(60)

    return hook


# -- 1. reads on a full disk ---------------------------------------------------------------


def test_every_read_of_a_full_store_goes_ahead_without_its_lease(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _saved(tmp_path)
    full = _full(tmp_path)
    caplog.set_level(logging.WARNING, "stalwart.checkpoint.durable.lease")
    with stalwart.Checkpointer(full, OPTS) as ck:
        assert torch.equal(ck.load(None, 1)["w"], _state(1)["w"])
        assert ck.load(None, fallback=True)["step"] == 2
        tensor, _ = ck.read_tensor(2, "w")
        assert torch.equal(tensor, _state(2)["w"]) and ck.verify(2).ok
        with pytest.raises(StorageFullError):  # a save cannot write its packs either
            ck.save(3, _state(3))
    tiered = TieredCheckpointer([Tier.durable("disk", full)])
    state = _state(0)
    assert tiered.recover(state).step == 2 and torch.equal(state["w"], _state(2)["w"])
    tiered.close()
    warned = [r for r in caplog.records if "without a lease" in r.getMessage()]
    assert len(warned) == 1 and "gc" in warned[0].getMessage()  # once per store
    assert full.failures["write"] >= 5 and not list((tmp_path / "leases").iterdir())


# -- 2. space a killed or failed save kept -------------------------------------------------

_KILLED_WRITE = """
import os, signal, sys, time
from stalwart.storage.local import LocalStorage

def data():
    for _ in range(4):
        yield b"x" * (8 << 20)
    time.sleep(0.5)  # the bytes reach the file (buffers go out on a writer thread)
    os.kill(os.getpid(), signal.SIGKILL)  # mid-write: the temporary stays, its lock goes

LocalStorage(sys.argv[1]).write(sys.argv[2], data())
"""


def test_gc_removes_a_killed_saves_temporary_at_once_and_counts_its_bytes(tmp_path: Path) -> None:
    _saved(tmp_path)
    pack = "packs/step-00000000000000000003-rank00000-0123456789ab.pack"
    child = subprocess.run([sys.executable, "-c", _KILLED_WRITE, str(tmp_path), pack])
    assert child.returncode == -9
    (temp,) = [p for p in (tmp_path / "packs").iterdir() if p.name.startswith(".tmp-")]
    size = temp.stat().st_size
    assert size >= 1 << 20 and CLAIMED_NAME.match(temp.name)
    with stalwart.Checkpointer(tmp_path, OPTS) as ck:
        report = ck.gc()  # the default grace: an hour, and the temporary is seconds old
    assert not temp.exists() and report.temps_removed == 1
    assert report.temps_bytes_freed == size and report.bytes_freed == size


def _dead_claimed_temp(folder: Path, name: str, size: int = 0) -> str:
    """A temporary as a writer that died leaves it: claimed when made, nobody holds it now."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        fd, temp = create_claimed(dir_fd, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    finally:
        os.close(dir_fd)
    os.write(fd, b"y" * size)
    os.close(fd)  # the claim ends with the descriptor, as with its writer's death
    return temp


def test_cli_gc_shows_the_temporaries_it_removed(tmp_path: Path) -> None:
    from stalwart.cli.main import app

    _saved(tmp_path)
    temp = _dead_claimed_temp(tmp_path / "packs", "step-x.pack", 3000)
    env = {"COLUMNS": "400", "NO_COLOR": "1"}
    r = CliRunner().invoke(app, ["ckpt", "gc", str(tmp_path)], env=env)
    assert r.exit_code == 0 and "1 temporaries" in r.stdout and "freed 2.9 KiB" in r.stdout
    assert not (tmp_path / "packs" / temp).exists()
    r = CliRunner().invoke(app, ["ckpt", "gc", str(tmp_path), "--json"], env=env)
    assert json.loads(r.stdout)["temps_removed"] == 0


def test_claimed_temporaries_are_told_apart_from_those_of_writers_without_claims(
    tmp_path: Path,
) -> None:
    import uuid

    made = [_dead_claimed_temp(tmp_path, f"o{i}") for i in range(20)]
    assert all(CLAIMED_NAME.match(n) and TEMP_NAME.match(n) for n in made)  # the spec's form
    # what writers without claims named theirs: removed only past the caller's grace
    assert not any(CLAIMED_NAME.match(f".tmp-{uuid.uuid4().hex}-o") for _ in range(2000))


def test_a_save_that_fails_at_its_manifest_deletes_its_packs(tmp_path: Path) -> None:
    _saved(tmp_path)
    before = _packs(tmp_path)
    state = {"new": torch.randn(8192), "frozen": torch.zeros(1024)}
    full = _full(tmp_path, "manifests/")
    with stalwart.Checkpointer(full, OPTS) as ck, pytest.raises(StorageFullError):
        ck.save(3, state)
    assert _packs(tmp_path) == before  # nothing left for gc's grace to keep
    windowed = stalwart.CheckpointOptions(chunk_bytes=4096, max_staging_bytes=8192)
    full = _full(tmp_path, "manifests/")
    with stalwart.Checkpointer(full, windowed) as ck, pytest.raises(StorageFullError):
        ck.save_async(3, state).wait()
    assert full.calls["write"] >= 5 and _packs(tmp_path) == before  # a pack per window, gone
    with stalwart.Checkpointer(tmp_path, OPTS) as ck:
        assert ck.steps() == [1, 2] and ck.verify(1).ok and ck.verify(2).ok


class _LandsThenFails:
    """A manifest write that reaches the store and then reports an error (a folder flush that
    failed after the rename): the step is committed, whatever the save was told."""

    def __init__(self, inner: Storage) -> None:
        self.inner, self.url = inner, inner.url

    def write(self, key: str, data: Iterable[Buffer]) -> int:
        n = self.inner.write(key, data)
        if key.startswith("manifests/"):
            raise StorageError(f"fsync of the folder of {key} failed")
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_failed_save_keeps_the_packs_of_a_manifest_that_landed(tmp_path: Path) -> None:
    store = _LandsThenFails(LocalStorage(tmp_path))
    with stalwart.Checkpointer(store, OPTS) as ck, pytest.raises(StorageError, match="fsync"):
        ck.save(1, _state(1))
    with stalwart.Checkpointer(tmp_path, OPTS) as ck:
        assert ck.steps() == [1] and ck.verify(1).ok
        assert torch.equal(ck.load(None, 1)["w"], _state(1)["w"])


# -- 3. an overwrite and a gc while a save deduplicates ------------------------------------


def _overwrite_2(root: Path) -> None:
    with stalwart.Checkpointer(root, OPTS) as other:
        other.save(2, {**_state(1002), "step": 2}, overwrite=True)  # step 2's pack: garbage


def _step_3() -> dict[str, Any]:
    return {**_state(2), "new": torch.randn(4096), "step": 3}  # step 2's chunks, and new ones


def _check_3(root: Path) -> None:
    with stalwart.Checkpointer(root, OPTS) as ck:
        assert ck.verify(3).ok, ck.verify(3).damaged
        assert torch.equal(ck.load(None, 3)["w"], _state(2)["w"])
        ck.gc(grace_s=0)
        assert ck.verify(3).ok and ck.verify(2).ok


def test_a_save_does_not_reference_a_pack_an_overwrite_and_gc_took_while_it_read(
    tmp_path: Path,
) -> None:
    _saved(tmp_path)
    _age(tmp_path)
    store = Hooked(LocalStorage(tmp_path))
    deleted: list[list[str]] = []

    def overwrite_and_gc() -> None:  # another process, between the manifests' read and lease
        _overwrite_2(tmp_path)
        with stalwart.Checkpointer(tmp_path) as other:
            deleted.append(other.gc(grace_s=0).deleted_packs)

    # the first lease is the listing's; the hook fires before the second, the packs' lease
    store.hooks.append(
        ("write leases/", lambda: store.hooks.append(("write leases/", overwrite_and_gc)))
    )
    with stalwart.Checkpointer(store, OPTS) as ck:
        result = ck.save(3, _step_3())
    assert len(deleted[0]) == 1 and result.bytes_reused > 0  # "frozen": still in step 1's pack
    _check_3(tmp_path)


def test_gc_sees_the_pack_lease_a_save_took_while_it_read_the_manifests(tmp_path: Path) -> None:
    _saved(tmp_path)
    _age(tmp_path)
    gc_store, save_store = Hooked(LocalStorage(tmp_path)), Hooked(LocalStorage(tmp_path))
    gc_paused, gc_go, save_paused, save_go = (threading.Event() for _ in range(4))
    gc_store.hooks.append(("list manifests/", _pause(gc_paused, gc_go)))  # leases read: none
    save_store.hooks.append(("write packs/", _pause(save_paused, save_go)))  # leased, re-read
    errors: list[BaseException] = []

    def run(fn: Callable[[], object]) -> threading.Thread:
        def body() -> None:
            try:
                fn()
            except BaseException as e:  # reported by the assertion below
                errors.append(e)

        t = threading.Thread(target=body)
        t.start()
        return t

    collector = run(lambda: collect_garbage(gc_store, grace_s=0))
    assert gc_paused.wait(60)
    saver = run(lambda: stalwart.Checkpointer(save_store, OPTS).save(3, _step_3()))
    assert save_paused.wait(60)
    _overwrite_2(tmp_path)  # after the save's second read: only its lease protects the pack
    gc_go.set()
    collector.join(60)
    save_go.set()
    saver.join(60)
    assert not errors, errors
    _check_3(tmp_path)


def test_gc_sees_a_save_that_began_and_committed_between_its_reads(tmp_path: Path) -> None:
    _saved(tmp_path)
    _age(tmp_path)
    gc_store, save_store = Hooked(LocalStorage(tmp_path)), Hooked(LocalStorage(tmp_path))
    events = {k: threading.Event() for k in ("gc1", "gc1_go", "gc2", "gc2_go", "save", "save_go")}
    gc_store.hooks.append(("list manifests/", _pause(events["gc1"], events["gc1_go"])))
    save_store.hooks.append(("write manifests/", _pause(events["save"], events["save_go"])))
    results: dict[str, Any] = {}

    def collect() -> None:
        results["gc"] = collect_garbage(gc_store, grace_s=0)

    def save() -> None:
        results["save"] = stalwart.Checkpointer(save_store, OPTS).save(3, _step_3())

    collector = threading.Thread(target=collect)
    collector.start()
    assert events["gc1"].wait(60)  # gc read the leases: none yet
    saver = threading.Thread(target=save)
    saver.start()
    assert events["save"].wait(60)  # the save leased, read twice, wrote: about to commit
    _overwrite_2(tmp_path)  # step 2's old pack: named only by the save's lease now

    def commit_first() -> None:  # the save commits and drops its leases before gc reads again
        events["save_go"].set()
        saver.join(60)

    gc_store.hooks.append(("list leases/", commit_first))
    events["gc1_go"].set()
    collector.join(60)
    assert "save" in results and "gc" in results, results
    _check_3(tmp_path)
