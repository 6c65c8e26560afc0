"""A newcomer that follows pushed steps off the survivors' critical path (``elastic/follow.py``).

Real gloo processes (``run_ranks``): two survivors commit on a group of their own while a
fresh newcomer takes their lent copy and applies each committed step the pusher sends
(reduced gradients, buffers, the scheduler's learning rate of that step); after the
promotion its digest equals theirs bit for bit, and a step as three keeps them equal.
"""

from __future__ import annotations

import dataclasses

import pytest

from stalwart.testing import run_ranks

from . import follow_ranks

pytestmark = pytest.mark.timeout(120)  # run_ranks(timeout_s=60) inside


@pytest.mark.parametrize("bare", [False, True], ids=["promoted-with-a-step", "promoted-bare"])
def test_a_follower_applies_the_pushed_steps_and_joins_bit_identical(bare: bool) -> None:
    results = run_ranks(follow_ranks.followed, 3, 6, 12, bare, timeout_s=50)
    survivor, other, follower = results
    assert survivor["promoted"] and other["promoted"]
    assert follower["over"] is None
    assert {r["step"] for r in results} == {follower["followed_to"]}
    assert follower["followed_to"] >= 6  # at least 4 steps pushed and applied
    assert follower["fresh"] != survivor["fresh"]  # it started elsewhere
    assert survivor["final"] == other["final"] == follower["final"]
    assert len({r["next"] for r in results}) == 1
    assert len({r["lr"] for r in results}) == 1


def test_a_follower_past_its_bound_breaks_the_feed_and_the_survivor_goes_on() -> None:
    survivor, follower = run_ranks(follow_ranks.abandoned, 2, timeout_s=50)
    assert survivor["broken"] is not None
    assert survivor["pushed_after"] is False
    assert follower["refused"] is not None and "heal in full" in follower["refused"]


def test_a_follower_refuses_another_model_and_can_be_abandoned() -> None:
    survivor, follower = run_ranks(follow_ranks.refused, 2, timeout_s=50)
    assert "same model" in follower["mismatch"]
    assert "abandoned" in follower["abandoned"]
    assert survivor["broken"] is not None


def test_a_replacement_group_follows_whole_or_not_at_all() -> None:
    # Shard 0's rank is answered, shard 1's key is another replacement's: the answered rank
    # withdraws (its pusher's feed breaks, the key is free again) and the whole group
    # announces itself, to be healed at the epoch change as one group.
    from datetime import timedelta

    from torch.distributed import TCPStore

    from stalwart.elastic.groups import Layout
    from stalwart.elastic.protocol import encode, keys

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=20))  # fmt: skip
    for rank in (0, 1):
        layout = Layout(group=5, group_rank=rank, group_size=2)
        store.set(keys.layout(10 + rank), encode(dataclasses.asdict(layout)))
    store.set(keys.PROGRESS, "7")  # the job committed steps: 10 and 11 are replacements
    store.set(keys.follow(1), "99.1")
    first, second, pusher = run_ranks(follow_ranks.group_ask, 3, store.port, timeout_s=60)
    assert pusher["broken"] is not None and pusher["token"].startswith("10."), pusher
    assert first == {"announced": True, "ready": True, "following": False, "key": ""}, first
    assert second == {"announced": True, "ready": True, "following": False, "key": "99.1"}
