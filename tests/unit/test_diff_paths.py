"""diff_steps keys non-tensor values by their typed path, not by the dotted name it joins to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart import Checkpointer
from stalwart.checkpoint.tools.diff import DiffReport, diff_steps

pytestmark = pytest.mark.timeout(60)


def _state(steps: int, epoch_label: str) -> dict[str, Any]:
    # "warmup.steps" and warmup -> steps join to one dotted name, as do the keys 1 and "1".
    return {
        "w": torch.ones(3),
        "sched": {"warmup.steps": 100, "warmup": {"steps": steps}},
        "epoch": {1: 0, "1": epoch_label},
    }


def _diff(tmp_path: Path, a: dict[str, Any], b: dict[str, Any]) -> DiffReport:
    with Checkpointer(tmp_path / "root") as ck:
        ck.save(1, a)
        ck.save(2, b)
        return diff_steps(ck, 1, 2)


def test_values_whose_paths_join_to_one_name_are_compared_apart(tmp_path: Path) -> None:
    r = _diff(tmp_path, _state(100, "a"), _state(999, "b"))
    assert not r.identical
    rows = {v.path: (v.status, v.old, v.new) for v in r.values}
    # Names that two paths share show the tuple of keys, so the rows tell them apart.
    assert rows == {
        "('sched', 'warmup', 'steps')": ("changed", "100", "999"),
        "('epoch', '1')": ("changed", "'a'", "'b'"),
    }


def test_identical_trees_with_colliding_names_diff_as_identical(tmp_path: Path) -> None:
    r = _diff(tmp_path, _state(100, "a"), _state(100, "a"))
    assert r.identical and r.values == []


def test_a_value_moved_to_a_colliding_path_is_removed_and_added(tmp_path: Path) -> None:
    r = _diff(tmp_path, {"lr": {"max": 1.0}, "n": 3}, {"lr.max": 1.0, "n": 4})
    rows = {v.path: v.status for v in r.values}
    assert rows == {"('lr', 'max')": "removed", "('lr.max',)": "added", "n": "changed"}
