"""``stalwart.elastic``'s front door stays small; moved results still import, with a warning."""

from __future__ import annotations

import importlib

import pytest

import stalwart.elastic as elastic


def test_front_door_is_small_and_importable() -> None:
    assert len(elastic.__all__) <= 15, elastic.__all__
    for name in elastic.__all__:
        assert hasattr(elastic, name), name
    assert {"ElasticSampler", "RecoveryLadder"} <= set(elastic.__all__)


@pytest.mark.parametrize("name", sorted(elastic.MOVED))
def test_moved_names_still_work_with_a_warning(name: str) -> None:
    where = elastic.MOVED[name]
    assert name not in elastic.__all__
    with pytest.warns(DeprecationWarning, match=rf"stalwart\.elastic\.{name} moved to {where}"):
        old = getattr(elastic, name)
    assert old is getattr(importlib.import_module(where), name)
    with pytest.raises(AttributeError):
        elastic.NoSuchName  # noqa: B018


def test_a_replacement_groups_warm_up_waits_for_its_model_then_announces() -> None:
    # With groups the model is built on job.shard_mesh after the Job: a replacement's warm-up
    # is kept until its first join (or its follow), then it announces itself; a first member
    # (nothing committed yet) has none to run.
    import dataclasses
    from datetime import timedelta

    from torch.distributed import TCPStore

    from stalwart.elastic.groups import Layout
    from stalwart.elastic.membership import Membership
    from stalwart.elastic.protocol import WorkerEnv, encode, keys

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=10))  # fmt: skip
    # A TCPStore set is not answered: another connection may read before the server took it.
    # A get on the same connection is answered after it, so it is the barrier here.
    for wid in (3, 4):
        layout = Layout(group=wid, group_rank=1, group_size=2)
        store.set(keys.layout(wid), encode(dataclasses.asdict(layout)))
        store.get(keys.layout(wid))
    calls: list[int] = []
    first = Membership(WorkerEnv("127.0.0.1", store.port, 3, None, timeout_s=10, hang_s=0), 1,
                       warmup=lambda: calls.append(3))  # fmt: skip
    assert first.warmup is None and first.announced and calls == [], "a first member: none"
    store.set(keys.PROGRESS, "7")  # the job committed steps: worker 4 is a replacement
    store.get(keys.PROGRESS)
    env = WorkerEnv("127.0.0.1", store.port, 4, None, timeout_s=10, hang_s=0)
    late = Membership(env, 1, warmup=lambda: calls.append(4))
    assert calls == [] and not late.announced and not store.check([keys.ready(4)])
    late.warm_up(announce=True)
    store.wait([keys.ready(4)], timedelta(seconds=10))  # announced on its own connection
    assert calls == [4] and late.announced
    late.warm_up(announce=True)
    assert calls == [4], "once"
