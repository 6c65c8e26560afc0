"""gc and reads stay inside what stalwart wrote, whatever else lies in (or is linked from) a root.

Decision: ``packs/`` may be a symbolic link to a folder on a bigger disk (a common setup), so
that folder may hold other people's files. gc deletes a file only when its name is one stalwart
gives its packs, no manifest or live lease references it, and it is older than the grace; a
temporary only when its name is of the exact form stalwart writes. An object that is itself a
link is never listed, read or deleted.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.errors import StorageError
from stalwart.storage import LocalStorage

pytestmark = pytest.mark.timeout(120)

OLD = time.time() - 7200


def _age(*paths: Path) -> None:
    for p in paths:
        os.utime(p, (OLD, OLD), follow_symlinks=False)


def _pack_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".pack"))


def test_gc_through_a_linked_packs_folder_deletes_only_its_own_garbage(tmp_path: Path) -> None:
    disk, root = tmp_path / "big-disk", tmp_path / "ckpt"
    disk.mkdir()
    root.mkdir()
    (root / "packs").symlink_to(disk, target_is_directory=True)
    others = [disk / n for n in ("notes.txt", "model.bin", "step-1.pack", ".tmp-theirs")]
    for p in others:
        p.write_bytes(b"not stalwart's")
    ckpt = stalwart.Checkpointer(root)
    ckpt.save(1, {"x": torch.ones(100)})
    ckpt.save(2, {"x": torch.zeros(100)})
    ours = disk / f".tmp-{uuid.uuid4().hex}-step-00000000000000000003-rank00000-0.pack"
    ours.write_bytes(b"a crashed write")
    step1_pack = next(iter(ckpt.manifest(1).packs())).split("/")[1]
    ckpt.delete(1)
    _age(*others, ours, *disk.iterdir())

    report = ckpt.gc(grace_s=60)

    assert report.deleted_packs == [f"packs/{step1_pack}"] and report.temps_removed == 1
    assert all(p.read_bytes() == b"not stalwart's" for p in others)
    assert "packs/step-1.pack" in report.skipped and not ours.exists()
    assert torch.equal(ckpt.load(None, 2)["x"], torch.zeros(100))
    assert (root / "packs").is_symlink()  # the link itself is left as it was


def test_a_stray_file_in_packs_is_skipped_and_reported(tmp_path: Path) -> None:
    ckpt = stalwart.Checkpointer(tmp_path)
    ckpt.save(1, {"x": torch.ones(10)})
    stray = tmp_path / "packs" / "bad name (1).pack"
    stray.write_bytes(b"copied by hand")
    _age(stray)
    report = ckpt.gc(grace_s=0)
    assert report.skipped == ["packs/bad name (1).pack"] and report.deleted_packs == []
    assert stray.exists() and torch.equal(ckpt.load(None)["x"], torch.ones(10))


def test_a_linked_pack_is_never_read_listed_or_deleted(tmp_path: Path) -> None:
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    outside.mkdir()
    ckpt = stalwart.Checkpointer(root)
    ckpt.save(1, {"x": torch.arange(10.0)})
    (key,) = ckpt.manifest(1).packs()
    pack = root / key
    target = outside / "secret.bin"
    target.write_bytes(pack.read_bytes())  # the same bytes, so only the link is wrong
    pack.unlink()
    pack.symlink_to(target)
    _age(target, pack)

    with pytest.raises(StorageError, match="symbolic link"):
        stalwart.Checkpointer(root).load(None)
    assert LocalStorage(root).list("packs/") == []
    stalwart.Checkpointer(root).gc(grace_s=0)
    assert target.exists() and pack.is_symlink()


def test_gc_removes_stale_temporaries_of_killed_writers(tmp_path: Path) -> None:
    ckpt = stalwart.Checkpointer(tmp_path)
    ckpt.save(1, {"x": torch.ones(10)})
    stale = tmp_path / "packs" / f".tmp-{uuid.uuid4().hex}-step-1.pack"
    fresh = tmp_path / "manifests" / f".tmp-{uuid.uuid4().hex}-step-2.json"
    stale.write_bytes(b"killed mid-write")
    fresh.write_bytes(b"in flight")
    _age(stale)
    report = ckpt.gc(grace_s=60)
    assert report.temps_removed == 1 and not stale.exists() and fresh.exists()
    assert _pack_names(tmp_path / "packs") == [Path(k).name for k in ckpt.manifest(1).packs()]


def test_cli_gc_reports_the_files_it_left(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from stalwart.cli.main import app

    stalwart.Checkpointer(tmp_path).save(1, {"x": torch.ones(10)})
    (tmp_path / "packs" / "bad name (1).pack").write_bytes(b"copied by hand")
    env = {"NO_COLOR": "1", "COLUMNS": "200", "TERM": "dumb"}
    r = CliRunner().invoke(app, ["ckpt", "gc", str(tmp_path), "--grace-s", "0"], env=env)
    assert r.exit_code == 0, r.output
    assert "left 1 file(s) under packs/ that stalwart did not write" in r.output
    assert "bad name (1).pack" in r.output
