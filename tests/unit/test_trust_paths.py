"""Nothing outside a checkpoint root is read, written or deleted, whatever links lie in it.

The layouts of issue 23, item 2, each with canary files outside the root whose bytes and mtime
must survive: two roots whose ``packs/`` link to one shared folder, then gc; a link nested in
``packs/`` named by a re-sealed manifest; a linked ``manifests/`` with ``steps()`` and
``ckpt rm``; a linked top-level folder holding an old temporary, then gc. Decision: every link
below the root is refused with ``UnsafePathError`` (see ``docs/format.md`` §1).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import blake3
import pytest
import torch
from typer.testing import CliRunner

import stalwart
from bench.fuzz_manifest import reseal
from stalwart.checkpoint.durable.manifest import manifest_key
from stalwart.cli.main import app
from stalwart.errors import StalwartError, UnsafePathError
from stalwart.storage import LocalStorage

pytestmark = pytest.mark.timeout(120)

TEN_DAYS_AGO = time.time() - 10 * 86400
Snapshot = dict[str, tuple[bytes, int]]


def _age(folder: Path) -> None:
    for p in folder.rglob("*"):
        os.utime(p, (TEN_DAYS_AGO, TEN_DAYS_AGO), follow_symlinks=False)


def _snapshot(folder: Path) -> Snapshot:
    """Every file under ``folder``: its bytes and mtime (ns), to prove nothing changed."""
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _move_and_link(folder: Path, target: Path) -> None:
    """Move ``folder``'s files into ``target`` and leave a link to ``target`` in its place."""
    target.mkdir(parents=True, exist_ok=True)
    for p in folder.iterdir():
        p.rename(target / p.name)
    folder.rmdir()
    folder.symlink_to(target, target_is_directory=True)


def test_two_roots_sharing_a_linked_packs_folder_lose_nothing_to_gc(tmp_path: Path) -> None:
    shared = tmp_path / "big-disk" / "packs"
    roots = [tmp_path / "a", tmp_path / "b"]
    for i, root in enumerate(roots):
        with stalwart.Checkpointer(root) as ck:
            ck.save(1, {"x": torch.full((256,), float(i))})
            ck.save(2, {"x": torch.full((256,), float(i + 10))})
        _move_and_link(root / "packs", shared)
    (shared / f".tmp-{uuid.uuid4().hex}-step-00000000000000000009-rank00000-0.pack").write_bytes(
        b"b's save in flight"
    )
    with stalwart.Checkpointer(roots[0]) as ck:
        ck.delete(1)  # a's step 1 is garbage now; b's packs are not a's to judge
    _age(shared)
    before = _snapshot(shared)

    with stalwart.Checkpointer(roots[0]) as ck:
        with pytest.raises(UnsafePathError, match="packs is a symbolic link"):
            ck.gc(grace_s=0)
        with pytest.raises(UnsafePathError, match="put the whole root there"):
            ck.load(None)
        with pytest.raises(UnsafePathError):
            ck.save(3, {"x": torch.zeros(256)})
    env = {"NO_COLOR": "1", "COLUMNS": "200", "TERM": "dumb"}
    r = CliRunner().invoke(app, ["ckpt", "gc", str(roots[0]), "--grace-s", "0"], env=env)
    assert r.exit_code != 0 and "symbolic link" in r.output, r.output

    assert _snapshot(shared) == before


def test_a_manifest_naming_a_file_behind_a_nested_link_reads_nothing(tmp_path: Path) -> None:
    root, outside = tmp_path / "ck", tmp_path / "outside"
    with stalwart.Checkpointer(root) as ck:
        ck.save(1, {"x": torch.zeros(64)})
    outside.mkdir()
    secret = torch.arange(64, dtype=torch.float32).numpy().tobytes()
    (outside / "secret.bin").write_bytes(secret)
    (root / "packs" / "sub").symlink_to(outside, target_is_directory=True)
    # A re-sealed manifest (valid checksum) whose chunk is the outside file, hash and all:
    # following the link would return its bytes as verified data.
    doc = json.loads((root / manifest_key(1)).read_bytes())
    ref = [blake3.blake3(secret).hexdigest(), 256, "packs/sub/secret.bin", 0, 256, "none"]
    doc["tensors"]["x"]["shards"][0]["chunks"] = [ref]
    (root / manifest_key(1)).write_bytes(reseal(doc))
    _age(outside)
    before = _snapshot(outside)

    with stalwart.Checkpointer(root) as ck:
        with pytest.raises(UnsafePathError, match="sub is a symbolic link"):
            ck.load(None)
        with pytest.raises(StalwartError):
            ck.read_tensor(1, "x")
        ck.gc(grace_s=0)  # the link is never listed, followed or deleted
    store = LocalStorage(root)
    with pytest.raises(UnsafePathError):
        store.read("packs/sub/secret.bin")
    with pytest.raises(UnsafePathError):
        store.delete("packs/sub/secret.bin")
    with pytest.raises(UnsafePathError):
        store.write("packs/sub/secret.bin", [b"overwritten"])
    assert not [i.key for i in store.list("packs/") if i.key.startswith("packs/sub")]
    assert (root / "packs" / "sub").is_symlink() and _snapshot(outside) == before


def test_a_linked_manifests_folder_is_neither_listed_nor_deleted_from(tmp_path: Path) -> None:
    root, outside = tmp_path / "ck", tmp_path / "elsewhere" / "manifests"
    with stalwart.Checkpointer(root) as ck:
        ck.save(1, {"x": torch.ones(8)})
    _move_and_link(root / "manifests", outside)
    (outside / "step-00000000000000000007.json").write_bytes(b"someone else's file")
    _age(outside)
    before = _snapshot(outside)

    with stalwart.Checkpointer(root) as ck:
        with pytest.raises(UnsafePathError, match="manifests is a symbolic link"):
            ck.steps()
        with pytest.raises(UnsafePathError):
            ck.delete(7)
        with pytest.raises(UnsafePathError):
            ck.gc(grace_s=0)
    env = {"NO_COLOR": "1", "COLUMNS": "200", "TERM": "dumb"}
    r = CliRunner().invoke(app, ["ckpt", "rm", str(root), "7"], env=env)
    assert r.exit_code != 0, r.output

    assert _snapshot(outside) == before


def test_gc_never_cleans_temporaries_behind_a_linked_folder(tmp_path: Path) -> None:
    root, scratch = tmp_path / "ck", tmp_path / "scratch"
    with stalwart.Checkpointer(root) as ck:
        ck.save(1, {"x": torch.ones(8)})
    scratch.mkdir()
    (scratch / f".tmp-{uuid.uuid4().hex}-data.bin").write_bytes(b"not ours, 10 days old")
    (scratch / "deep").mkdir()
    (scratch / "deep" / f".tmp-{uuid.uuid4().hex}-x").write_bytes(b"neither")
    (root / "other").symlink_to(scratch, target_is_directory=True)
    ours = root / "packs" / f".tmp-{uuid.uuid4().hex}-step-1.pack"
    ours.write_bytes(b"a crashed write inside the root")
    _age(scratch)
    os.utime(ours, (TEN_DAYS_AGO, TEN_DAYS_AGO))
    before = _snapshot(scratch)

    with stalwart.Checkpointer(root) as ck:
        report = ck.gc(grace_s=0)

    assert report.temps_removed == 1 and not ours.exists()
    assert (root / "other").is_symlink() and _snapshot(scratch) == before


@pytest.mark.parametrize("op", ["read", "read_into", "read_view", "write", "delete", "list"])
def test_every_store_call_refuses_a_linked_folder(tmp_path: Path, op: str) -> None:
    root, outside = tmp_path / "ck", tmp_path / "outside"
    outside.mkdir()
    (outside / "obj").write_bytes(b"canary")
    _age(outside)
    before = _snapshot(outside)
    store = LocalStorage(root)
    (root / "dir").symlink_to(outside, target_is_directory=True)
    calls = {
        "read": lambda: store.read("dir/obj"),
        "read_into": lambda: store.read_into("dir/obj", 0, memoryview(bytearray(6))),
        "read_view": lambda: store.read_view("dir/obj", 0, 6).__enter__(),
        "write": lambda: store.write("dir/new", [b"x"]),
        "delete": lambda: store.delete("dir/obj"),
        "list": lambda: store.list("dir/"),
    }
    with pytest.raises(UnsafePathError, match="dir is a symbolic link"):
        calls[op]()
    assert _snapshot(outside) == before and sorted(os.listdir(outside)) == ["obj"]


def test_the_root_itself_may_be_a_link(tmp_path: Path) -> None:
    disk = tmp_path / "big-disk" / "run"
    disk.mkdir(parents=True)
    (tmp_path / "ck").symlink_to(disk, target_is_directory=True)
    with stalwart.Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"x": torch.ones(8)})
        assert torch.equal(ck.load(None)["x"], torch.ones(8))
        ck.gc(grace_s=0)
    assert (disk / manifest_key(1)).is_file()


def test_fsspec_refuses_local_paths(tmp_path: Path) -> None:
    from stalwart.errors import ConfigError
    from stalwart.storage import FsspecStorage

    with pytest.raises(ConfigError, match="LocalStorage"):
        FsspecStorage(f"file://{tmp_path}")
