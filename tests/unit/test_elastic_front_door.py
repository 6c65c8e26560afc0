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
