"""Shared fixtures: a local moto S3 server for the whole session, a fresh bucket per test.

At the session's start the package's bytecode is written once: the distributed tests start
hundreds of processes, and where ``PYTHONDONTWRITEBYTECODE`` is set (these machines set it)
each would compile every stalwart module it imports again (an editable install has no
bytecode, unlike a wheel's, which pip compiles).

Property tests draw the same examples on every run (hypothesis's ``derandomize``, no example
database): a CI run tests what the last local run tested, and a failure is reproducible, not
one draw in thousands that the next run never sees again.
"""

from __future__ import annotations

import compileall
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

import stalwart
from stalwart.testing.s3_server import S3Server

settings.register_profile("stalwart", derandomize=True, database=None)
settings.load_profile("stalwart")


def pytest_sessionstart(session: pytest.Session) -> None:
    compileall.compile_dir(Path(stalwart.__file__).parent, quiet=1)


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
