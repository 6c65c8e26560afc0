"""Shared fixtures: a local moto S3 server for the whole session, a fresh bucket per test."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stalwart.testing.s3_server import S3Server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A moto S3 server on loopback (skips the test when moto[server] or s3fs is missing)."""
    pytest.importorskip("moto.server", reason="moto[server] is needed for S3 tests")
    pytest.importorskip("s3fs", reason="s3fs is needed for S3 tests")
    with S3Server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A new, empty bucket on ``s3_server``; returns its name."""
    return s3_server.make_bucket(f"stalwart-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Mount a tiny tmpfs (needs root / CAP_SYS_ADMIN); yields ``mount(options) -> Path``.

    Used for real ENOSPC and EROFS errors instead of simulated ones.
    """
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        target = tmp_path / f"mnt{len(mounted)}"
        target.mkdir()
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        subprocess.run(["umount", str(target)], check=False)
