"""Erasure-coded in-memory redundancy across real gloo processes.

Ranks protect their snapshots, some ranks lose everything they held, and their group
rebuilds them bit-exactly (checked inside the rank bodies in ``erasure_ranks.py``); losing
more than ``m`` in a group raises the same clear error on every rank. Process start-up is
the slow part on a small machine, so one world of 8 runs every scenario, each on its own
gloo sub-group (4+1 needs 5 ranks, 4+2 six, two 3+1 groups eight), and the tests below
check that world's outcomes.
"""

from __future__ import annotations

from typing import Any

import pytest

from stalwart.testing import run_ranks

from . import erasure_ranks

pytestmark = pytest.mark.timeout(180)

WORLD = 8
SCENARIOS: dict[str, erasure_ranks.Scenario] = {
    # name: (k, m, codec, lost ranks of the sub-group, layout, first global rank, size)
    "xor_4+1": (4, 1, "auto", [2], "consecutive", 3, 5),
    "rs_4+1": (4, 1, "rs", [0], "consecutive", 0, 5),
    "xor_4+1_lose_2": (4, 1, "auto", [1, 3], "consecutive", 3, 5),
    "rs_4+2": (4, 2, "auto", [1, 4], "consecutive", 0, 6),
    "rs_vand_4+2": (4, 2, "rs:isa_l_rs_vand", [0, 5], "consecutive", 2, 6),
    "rs_4+2_lose_1": (4, 2, "auto", [3], "consecutive", 0, 6),
    "rs_4+2_lose_3": (4, 2, "auto", [0, 2, 5], "consecutive", 0, 6),
    "two_3+1": (3, 1, "auto", [1, 6], "consecutive", 0, 8),
    "two_3+1_strided": (3, 1, "auto", [0, 1], "strided", 0, 8),
}


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[tuple[str, Any]]]:
    """``scenario name -> outcome per global rank`` from one world of 8 processes."""
    names = list(SCENARIOS)
    per_rank = run_ranks(
        erasure_ranks.scenarios, WORLD, [SCENARIOS[n] for n in names], timeout_s=150
    )
    return {name: [per_rank[r][i] for r in range(WORLD)] for i, name in enumerate(names)}


def _members(name: str) -> range:
    *_, first, size = SCENARIOS[name]
    return range(first, first + size)


def _ok(outcomes: dict[str, list[tuple[str, Any]]], name: str) -> list[dict[str, Any]]:
    """Stats of every member of ``name``'s sub-group; fails on any error."""
    out = []
    for r in range(WORLD):
        kind, value = outcomes[name][r]
        if r not in _members(name):
            assert kind == "skip"
            continue
        assert kind == "ok", f"{name}, rank {r}: {value}"
        out.append(value)
    return out


@pytest.mark.parametrize("name", ["xor_4+1", "rs_4+1"])
def test_four_plus_one_rebuilds_a_lost_rank(outcomes, name: str) -> None:
    stats = _ok(outcomes, name)
    lost = [s for s in stats if s["lost"]]
    assert len(lost) == 1
    assert lost[0]["rebuild"]["bytes_received"] > 0 and lost[0]["rebuild"]["verify_s"] > 0
    assert lost[0]["rebuild"]["bytes_sent"] == 0  # a lost rank has nothing to give
    assert all(s["protect"]["bytes_sent"] > 0 for s in stats)
    assert sum(s["rebuild"]["codec_s"] > 0 for s in stats) >= 1


@pytest.mark.parametrize("name", ["rs_4+2", "rs_vand_4+2", "rs_4+2_lose_1"])
def test_four_plus_two_rebuilds_up_to_two(outcomes, name: str) -> None:
    stats = _ok(outcomes, name)
    assert sum(s["lost"] for s in stats) == len(SCENARIOS[name][3])


@pytest.mark.parametrize(
    ("name", "lost", "limit"), [("xor_4+1_lose_2", 2, 1), ("rs_4+2_lose_3", 3, 2)]
)
def test_losing_more_than_m_fails_clearly_on_every_rank(
    outcomes, name: str, lost: int, limit: int
) -> None:
    for r in _members(name):
        kind, msg = outcomes[name][r]
        assert kind == "error", f"rank {r} did not refuse: {msg}"
        assert f"lost {lost}" in msg and f"at most {limit}" in msg, msg
        assert "fall back to the last checkpoint on disk" in msg, msg


def test_two_groups_each_rebuild_their_lost_rank(outcomes) -> None:
    consecutive = _ok(outcomes, "two_3+1")
    strided = _ok(outcomes, "two_3+1_strided")
    for r in range(WORLD):
        assert list(consecutive[r]["group"]) == list(range(4 * (r // 4), 4 * (r // 4) + 4))
        assert list(strided[r]["group"]) == [r % 2 + 2 * i for i in range(4)]
    assert [r for r in range(WORLD) if consecutive[r]["lost"]] == [1, 6]
    assert [r for r in range(WORLD) if strided[r]["lost"]] == [0, 1]
