"""The checkpoint package's declared surface: a small front door, moved names that still
import (with a warning), explicit tier constructors, typed results, declared capabilities."""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path

import pytest
import torch

import stalwart.checkpoint as ckpt_pkg
from stalwart.checkpoint import Checkpointer
from stalwart.checkpoint.memory.tiers import Tier, TieredCheckpointer
from stalwart.checkpoint.policy import EveryNSteps, KeepAll, KeepLast
from stalwart.checkpoint.results import TieredSaveResult
from stalwart.errors import ConfigError
from stalwart.storage.base import ReadsViews, RemovesStaleTemps
from stalwart.storage.local import LocalStorage
from stalwart.storage.memory import MemoryStorage

pytestmark = pytest.mark.timeout(120)


def test_front_door_is_small_sorted_and_warning_free() -> None:
    assert len(ckpt_pkg.__all__) <= 15
    assert ckpt_pkg.__all__ == sorted(ckpt_pkg.__all__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ckpt_pkg.__all__:
            assert getattr(ckpt_pkg, name) is not None


@pytest.mark.parametrize("name", sorted(ckpt_pkg.MOVED))
def test_old_path_warns_and_gives_the_moved_object(name: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"stalwart.checkpoint.{name} moved to"):
        old = getattr(ckpt_pkg, name)
    assert old is getattr(importlib.import_module(ckpt_pkg.MOVED[name]), name)


def test_from_import_of_a_moved_name_warns() -> None:
    with pytest.warns(DeprecationWarning, match="stalwart.checkpoint.format"):
        from stalwart.checkpoint import ChunkRef  # noqa: F401


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError):
        _ = ckpt_pkg.NoSuchName


def test_tier_constructors_say_which_kind(tmp_path: Path) -> None:
    mem = Tier.memory(every=EveryNSteps(2), keep=KeepLast(3))
    assert mem.is_memory and mem.name == "memory" and mem.keep == KeepLast(3)
    assert Tier(name="m").is_memory  # the old form still means the memory tier
    disk = Tier.durable("disk", tmp_path / "d", keep=KeepAll())
    assert not disk.is_memory and disk.root == tmp_path / "d"
    with pytest.raises(ConfigError):
        Tier.durable("disk", None)  # type: ignore[arg-type]


def test_tiered_save_returns_a_typed_mapping(tmp_path: Path) -> None:
    tiers = [Tier.memory(), Tier.durable("disk", tmp_path / "d", every=EveryNSteps(2))]
    with TieredCheckpointer(tiers) as tc:
        one = tc.save(1, {"w": torch.ones(4)})
        two = tc.save(2, {"w": torch.ones(4)})
    assert isinstance(one, TieredSaveResult) and one.step == 1 and one.tiers == ["memory"]
    assert set(two) == {"memory", "disk"} and two["disk"].step == 2 and len(two) == 2


def test_optional_storage_capabilities_are_declared(tmp_path: Path) -> None:
    local, memory = LocalStorage(tmp_path / "s"), MemoryStorage()
    assert isinstance(local, ReadsViews) and isinstance(local, RemovesStaleTemps)
    assert not isinstance(memory, ReadsViews) and not isinstance(memory, RemovesStaleTemps)


def test_checkpointer_is_composed_not_mixed(tmp_path: Path) -> None:
    assert Checkpointer.__mro__ == (Checkpointer, object)
    with Checkpointer(tmp_path / "c") as ck:
        ck.save(1, {"w": torch.ones(2)})
        ck.load({"w": torch.zeros(2)})
        assert ck.last_load is not None and ck.last_load.step == 1
        assert ck.verify().ok
