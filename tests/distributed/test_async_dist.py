"""Asynchronous saves in a real gloo job: a group of their own, no deadlock, exact bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.testing import run_ranks

from . import async_ranks

pytestmark = pytest.mark.timeout(180)


def test_lazy_saves_run_beside_training_collectives(tmp_path: Path) -> None:
    results = run_ranks(
        async_ranks.lazy_saves_beside_training_collectives, 2, str(tmp_path / "ck"), timeout_s=120
    )
    assert results == [[1, 2, 3, 4, 5]] * 2
