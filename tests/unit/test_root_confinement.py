"""gc and reads stay inside what stalwart wrote, whatever else lies in a root.

Decision (issue 23): nothing below a root may be a symbolic link. A ``packs/`` on a bigger disk
shared by two roots let one root's gc delete the other's packs, so a linked folder or object is
refused with ``UnsafePathError`` (put the whole root on the bigger disk instead). gc deletes a
file only when its name is one stalwart gives its packs, no manifest or live lease references
it, and it is older than the grace; a temporary only when its name is of the exact form stalwart
writes and no live writer holds it. More link layouts: ``test_trust_paths.py``.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.errors import StorageError, UnsafePathError
from stalwart.storage import LocalStorage

pytestmark = pytest.mark.timeout(120)

OLD = time.time() - 7200


def _age(*paths: Path) -> None:
    for p in paths:
        os.utime(p, (OLD, OLD), follow_symlinks=False)


def _pack_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".pack"))


def test_a_linked_packs_folder_is_refused_and_gc_deletes_nothing(tmp_path: Path) -> None:
    disk, root = tmp_path / "big-disk", tmp_path / "ckpt"
    ckpt = stalwart.Checkpointer(root)
    ckpt.save(1, {"x": torch.ones(100)})
    disk.mkdir()
    for p in (root / "packs").iterdir():
        p.rename(disk / p.name)
    (root / "packs").rmdir()
    (root / "packs").symlink_to(disk, target_is_directory=True)
    others = [disk / n for n in ("notes.txt", "model.bin", "step-1.pack", ".tmp-theirs")]
    for p in others:
        p.write_bytes(b"not stalwart's")
    ours = disk / f".tmp-{uuid.uuid4().hex}-step-00000000000000000003-rank00000-0.pack"
    ours.write_bytes(b"a crashed write")
    ckpt.delete(1)
    _age(*disk.iterdir())
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in disk.iterdir()}

    with pytest.raises(UnsafePathError, match="mount that disk at the root"):
        ckpt.gc(grace_s=0)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        ckpt.save(2, {"x": torch.zeros(100)})

    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in disk.iterdir()} == before
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
