"""keep_in + erasure: a restart that lost a node, and a protect that failed once."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.testing import run_ranks

from . import keeper_erasure_ranks

pytestmark = pytest.mark.timeout(240)


def test_a_restart_without_parity_recovers_from_disk_on_every_rank(tmp_path: Path) -> None:
    # Was: rank 0 passed its reloaded (parity-less) snapshot to the rebuild and crashed on
    # its missing protect_id; rank 1 then failed on the closed connection.
    results = run_ranks(
        keeper_erasure_ranks.restart_without_one_node, 2, str(tmp_path), timeout_s=180,
        pg_timeout_s=60,
    )  # fmt: skip
    assert results[0]["held"] == [("Snapshot", 2), ("Snapshot", 3)] and results[1]["held"] == []
    for r in results:
        assert (r["source"], r["step"]) == ("disk", 2)
        [(tier, why)] = r["why"]
        assert tier == "memory" and "step 3: ranks [1] lack it and ranks [0] hold it" in why
        assert "without parity" in why


def test_a_failed_protect_fails_its_step_only(tmp_path: Path) -> None:
    # Was: the slot of step 3 was recorded before protect raised; every later save then
    # failed with "min() arg is an empty sequence".
    results = run_ranks(keeper_erasure_ranks.one_failed_protect, 2, str(tmp_path), timeout_s=180)
    for r in results:
        assert list(r["errors"]) == [3] and "simulated transient encode failure" in r["errors"][3]
        assert r["kept"] == [4, 5] and r["source"] == "memory" and r["on_tmpfs"] == [4, 5]
