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


def test_a_warm_up_with_replica_groups_is_refused_with_the_fix() -> None:
    # With groups the model is built on job.shard_mesh after the Job: a warm-up at the job's
    # construction would run before it exists (a replacement would crash on its own closure).
    import dataclasses
    from datetime import timedelta

    from torch.distributed import TCPStore

    from stalwart.elastic.groups import Layout
    from stalwart.elastic.membership import Membership
    from stalwart.elastic.protocol import WorkerEnv, encode, keys
    from stalwart.errors import ConfigError

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=10))  # fmt: skip
    store.set(keys.layout(3), encode(dataclasses.asdict(Layout(group=1, group_rank=1,
                                                               group_size=2))))  # fmt: skip
    env = WorkerEnv("127.0.0.1", store.port, 3, None, timeout_s=10, hang_s=0)
    with pytest.raises(ConfigError, match="leave warmup out with --group-size > 1"):
        Membership(env, 1, warmup=lambda: None, announce=False)
    assert not store.check([keys.ready(3)]), "refused before announcing"
    assert Membership(env, 1, announce=False).layout.group_size == 2, "without it: as before"
