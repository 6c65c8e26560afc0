"""Backup workers: a waiting member gives up a step only when a departed member held a piece of it.

Members are threads with their own ``BackupRound`` on one real ``TCPStore``; a departed member
is one that ``gone()`` names (what a newer epoch left out), simulated by its store writes alone.
The store's timeout (20 s) is far above the assertions' bounds: giving up is at once.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from stalwart.elastic.backup import BackupRound, Static
from stalwart.elastic.backup_job import _departed
from stalwart.elastic.backup_wire import encode
from stalwart.elastic.membership import Epoch
from stalwart.elastic.protocol import encode as encode_json
from stalwart.elastic.protocol import keys

pytestmark = pytest.mark.timeout(60)

GRAD = [torch.tensor([1.0, 2.0])]


def _store(master: dist.TCPStore | None = None) -> dist.TCPStore:
    if master is None:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=20))  # fmt: skip
        store.set(keys.EPOCH, "0")
        return store
    return dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=20))


def _member(master: dist.TCPStore, out: dict[Any, Any], rank: int, size: int,
            gone: set[int]) -> None:  # fmt: skip
    rnd = BackupRound(_store(master), Static(1))
    t0 = time.monotonic()
    try:
        out[rank] = rnd.exchange(epoch=0, step=0, rank=rank, size=size, grads=GRAD, buffers=[],
                                 own_s=0.01, gone=lambda: gone)  # fmt: skip
    except RuntimeError as e:
        out[rank] = e
    out[f"s{rank}"] = time.monotonic() - t0
    rnd.close()


def test_a_member_that_left_after_posting_does_not_cost_the_step() -> None:
    """4 members, k = 3: rank 2 posts ticket 1 and leaves, rank 0 waits, rank 1 reduces late."""
    master, out = _store(), dict[Any, Any]()
    master.add("backup/0/0/n", 1)
    master.set("backup/0/0/g1", encode((2, 0.01, 1.0), GRAD))
    waiter = threading.Thread(target=_member, args=(master, out, 0, 4, {2}))
    waiter.start()
    while int(master.add("backup/0/0/n", 0)) < 2:
        time.sleep(0.001)
    time.sleep(0.6)  # rank 0 polls gone() at least twice before the reducer arrives
    _member(master, out, 1, 4, {2})
    waiter.join(timeout=20)
    assert not isinstance(out[0], Exception), out[0]
    assert out[0][0].used == (2, 0, 1) and out[1][0].used == (2, 0, 1)


@pytest.mark.parametrize("role", ["reducer", "unposted"])
def test_a_member_that_left_holding_a_missing_piece_ends_the_wait_at_once(role: str) -> None:
    """3 members, k = 2: the departed rank 2 took the reducer's ticket (and named itself) or
    ticket 1 without posting it; rank 0 gives up within a poll, not the store's timeout."""
    master, out = _store(), dict[Any, Any]()
    if role == "unposted":
        master.add("backup/0/0/n", 1)  # rank 2's ticket 1, never posted: rank 0 reduces
    waiter = threading.Thread(target=_member, args=(master, out, 0, 3, {2}))
    waiter.start()
    if role == "reducer":
        while int(master.add("backup/0/0/n", 0)) < 1:
            time.sleep(0.001)
        master.add("backup/0/0/n", 1)
        master.set("backup/0/0/k", "2")
    waiter.join(timeout=20)
    assert isinstance(out[0], RuntimeError) and "left the job" in str(out[0])
    assert out["s0"] < 2.0


def test_departed_ranks_come_from_the_latest_epoch_and_ignore_newcomers() -> None:
    master = _store()
    latest = {"n": 3}
    membership = SimpleNamespace(store=master, latest_epoch=lambda: latest["n"])
    ledger = SimpleNamespace(membership=membership, epoch=Epoch(2, (0, 2, 3), 0, None),
                             newer_epoch_published=lambda: latest["n"] > 2)  # fmt: skip
    master.set(keys.members(3), encode_json([0, 2, 3, 4]))
    assert _departed(ledger) == set(), "a newcomer alone leaves nobody out"
    master.set(keys.members(4), encode_json([0, 3, 4]))
    latest["n"] = 4
    assert _departed(ledger) == {1}, "worker 2 is rank 1 of epoch 2"
