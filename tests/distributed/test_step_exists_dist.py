"""A committed step is refused on every rank alike: rank 0 lists, every rank decides on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.testing import run_ranks

from . import step_exists_ranks

pytestmark = pytest.mark.timeout(180)


def test_every_rank_refuses_a_committed_step_and_overwrite_replaces_it(tmp_path: Path) -> None:
    results = run_ranks(
        step_exists_ranks.refuse_then_overwrite, 2, str(tmp_path / "ck"), timeout_s=150
    )
    assert results == [["refused", "refused", "9.0"]] * 2
