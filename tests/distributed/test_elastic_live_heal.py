"""Heals peer to peer: every holder sends a slice, in chunks, over sockets (``elastic/heal.py``).

Real gloo processes (``run_ranks``): holders train a small MLP with AdamW, newcomers start
fresh; after the heal every newcomer's digest (parameters, optimizer moments, RNG, step)
equals the holders', bit for bit, and one more step keeps them equal.
"""

from __future__ import annotations

import itertools

import pytest

from stalwart.elastic.heal import slice_bounds
from stalwart.testing import run_ranks

from . import live_heal_ranks

pytestmark = pytest.mark.timeout(150)  # a test may run two 50 s run_ranks


def test_slices_cover_the_stream_once_in_order() -> None:
    for total, count in [(0, 1), (10, 3), (1 << 20, 4), (7, 7), (5, 8)]:
        bounds = [slice_bounds(total, i, count) for i in range(count)]
        assert bounds[0][0] == 0 and bounds[-1][1] == total
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))


def test_newcomers_heal_from_every_holders_slice_bit_identical() -> None:
    # 2 holders, 2 newcomers; chunks of 1000 bytes: slices and chunks cross leaf boundaries
    results = run_ranks(live_heal_ranks.sliced_heal, 4, 2, 1000, timeout_s=50)
    held = results[0]["before"]
    assert all(r["step"] == 3 for r in results)
    assert all(r["before"] != held for r in results[2:])  # the newcomers differed
    assert {r["after"] for r in results} == {held}
    assert len({r["next"] for r in results}) == 1


def test_a_heals_holders_keep_their_copy_and_receivers_record_the_received_state() -> None:
    # 1 holder, 2 newcomers: the holder sends a digest it does not hash again and keeps the
    # copy of its step 1; each newcomer's copy (received leaves adopted, moments cloned) is
    # the healed state and stays it when the live state trains on
    results = run_ranks(live_heal_ranks.reconciled_heal, 3, 1, timeout_s=50)
    healed = results[0]["healed"]
    assert [r["step"] for r in results] == [3, 3, 3]
    assert [r["received"] for r in results] == [False, True, True]
    assert {r["healed"] for r in results} == {healed}
    assert results[0]["copy_step"] == 1 and results[0]["restored"] == results[0]["kept"]
    for r in results[1:]:
        assert r["copy_step"] == 3 and r["restored"] == healed
        assert not r["aliased"]  # no leaf of the copy is a live optimizer moment


def test_a_listener_replays_the_survivors_steps_to_their_digest_bit_for_bit() -> None:
    # survivors 0 and 1 lend their copy of step 2 and commit 5 steps while rank 2 listens;
    # it replays one kept step per step from its third on, then the rest, then the RNG,
    # integer buffers and skeleton from rank 0: every digest equal, and one more step as
    # three contributors keeps them equal
    results = run_ranks(live_heal_ranks.background_heal, 3, True, 5, 2, timeout_s=50)
    assert results[2]["fresh"] != results[0]["fresh"]  # the newcomer differed
    assert len({r["final"] for r in results}) == 1
    assert len({r["next"] for r in results}) == 1
    assert results[2]["replayed_early"] >= 1  # some steps replayed while still listening
    # the listener changed nothing the survivors computed: the same digests as alone
    alone = run_ranks(live_heal_ranks.background_heal, 2, False, 5, 2, timeout_s=50)
    assert alone[0]["final"] == results[0]["final"]


def test_a_catchup_past_its_bound_keeps_nothing_and_refuses_to_replay() -> None:
    results = run_ranks(live_heal_ranks.bounded_catchup, 2, 2, timeout_s=50)
    assert results[1] == {"over": True, "kept": 0, "refused": True}
