"""Shared reads are decided by the store: on where reads leave the host, off on local disks.

Real stores (a tmp dir, the in-process memory store, fsspec's memory filesystem, S3 on the
moto server, a ``FlakyStorage`` around each) and a one-rank ``Group``, whose ``all_gather``
is the same exchange a real group runs; the gloo worlds are in
``tests/distributed/test_shared_load_dist.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from stalwart.checkpoint import Checkpointer
from stalwart.checkpoint.collective import Group
from stalwart.checkpoint.durable import shared_read
from stalwart.checkpoint.durable.reshard import Box
from stalwart.storage import FsspecStorage, LocalStorage, MemoryStorage, Storage
from stalwart.testing import FlakyStorage
from stalwart.testing.s3_server import S3Server


@pytest.fixture
def s3_store(s3_server: S3Server, s3_bucket: str) -> Iterator[Storage]:
    store = FsspecStorage(f"s3://{s3_bucket}/job", storage_options=s3_server.storage_options)
    yield store
    store.close()


def test_by_default_the_store_decides() -> None:
    assert shared_read.SHARED_READS is None


def test_local_and_in_process_stores_stay_on_the_host(tmp_path: Path) -> None:
    for store in (
        LocalStorage(str(tmp_path)),
        MemoryStorage("auto-local"),
        FsspecStorage("memory://auto-local"),
        FlakyStorage(LocalStorage(str(tmp_path))),
    ):
        assert not shared_read.reads_leave_host(store), store


def test_object_stores_and_their_wrappers_leave_the_host(s3_store: Storage) -> None:
    assert shared_read.reads_leave_host(s3_store)
    assert shared_read.reads_leave_host(FlakyStorage(FlakyStorage(s3_store)))


class _Declared(MemoryStorage):
    """A store that says where its reads go (as a custom network store would)."""

    reads_leave_host = True


def test_a_store_may_declare_it() -> None:
    assert shared_read.reads_leave_host(_Declared("auto-declared"))


def _boxes(tmp_path: Path) -> list[Box]:
    w = torch.arange(12.0).reshape(3, 4)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"w": w})
        entry = ck.manifest(1).tensors["w"]
    return [Box(entry, "w", (0, 0), torch.zeros_like(w))]


@pytest.mark.parametrize(
    ("forced", "remote", "shares"),
    [
        (None, False, False),
        (None, True, True),
        (False, False, False),
        (False, True, False),
        (True, False, True),
        (True, True, True),
    ],
)
@pytest.mark.parametrize("shm", [True, False])
def test_the_plan_follows_the_store_unless_forced(
    tmp_path: Path,
    s3_store: Storage,
    monkeypatch: pytest.MonkeyPatch,
    forced: bool | None,
    remote: bool,
    shares: bool,
    shm: bool,
) -> None:
    monkeypatch.setattr(shared_read, "SHARED_READS", forced)
    monkeypatch.setattr(shared_read, "SHM_READS", shm)
    store = s3_store if remote else LocalStorage(str(tmp_path))
    g = Group(None, 0, 1)
    boxes = _boxes(tmp_path)
    plan = shared_read.plan_shared(g, boxes, store)
    assert (plan is not None) == shares
    if plan is not None:
        assert [r for r, _ in plan.pieces] == [0]  # the one box, read by the one rank
        assert (plan.shm is not None) == shm  # one host: through /dev/shm unless told not to
    # A rank that learns nothing of the store never shares unless forced.
    assert (shared_read.plan_shared(g, boxes) is not None) == (forced is True)
