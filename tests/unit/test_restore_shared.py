"""Disk and memory restores share one routine: same checks, same messages, same translation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stalwart import Checkpointer
from stalwart.checkpoint.memory.snapshot import Snapshot
from stalwart.errors import StateMismatchError


def _state(width: int) -> dict[str, torch.nn.Module]:
    torch.manual_seed(width)
    return {"model": torch.nn.Linear(width, 4)}


def _sources(tmp_path: Path) -> list[tuple[str, object]]:
    saved = _state(8)
    ckpt = Checkpointer(tmp_path / "ck")
    ckpt.save(1, saved)
    snap = Snapshot.capture(saved, 1)
    return [
        ("disk", lambda st, strict: ckpt.load(st, strict=strict)),
        ("memory", lambda st, strict: snap.restore_into(st, strict=strict)),
    ]


def test_a_mismatched_state_is_refused_the_same_way_from_disk_and_memory(tmp_path: Path) -> None:
    for name, restore in _sources(tmp_path):
        wrong = _state(6)  # weight [4, 6] instead of [4, 8]
        with pytest.raises(StateMismatchError) as info:
            restore(wrong, True)  # type: ignore[operator]
        msg = str(info.value)
        assert "model.weight" in msg and "strict=False" in msg, (name, msg)


def test_strict_false_loads_what_matches_from_disk_and_memory(tmp_path: Path) -> None:
    saved = _state(8)
    for name, restore in _sources(tmp_path):
        target = {"model": torch.nn.Linear(8, 4), "other": torch.zeros(3)}
        restore(target, False)  # type: ignore[operator]
        assert torch.equal(target["model"].weight, saved["model"].weight), name
        assert torch.equal(target["other"], torch.zeros(3)), name


class _Refuses:
    def state_dict(self) -> dict[str, int]:
        return {"n": 1}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        raise ValueError("version 1 is too old")


def test_a_stateful_refusal_becomes_a_state_mismatch_from_memory_too() -> None:
    snap = Snapshot.capture({"obj": _Refuses(), "t": torch.ones(2)}, 3)
    with pytest.raises(StateMismatchError, match="load_state_dict refused the memory snapshot"):
        snap.restore_into({"obj": _Refuses(), "t": torch.zeros(2)})


def test_plain_values_are_restored_in_place_from_disk_and_memory(tmp_path: Path) -> None:
    saved = {"w": torch.ones(2), "step": 7, "cfg": {"lr": 0.5, "tags": ["a", "b"]}, "t": (1, 2)}
    ckpt = Checkpointer(tmp_path / "ck")
    ckpt.save(1, saved)
    snap = Snapshot.capture(saved, 1)
    loaders = [
        lambda st: ckpt.load(st),
        lambda st: snap.restore_into(st),
    ]
    for load in loaders:
        cfg = {"lr": 0.0, "tags": ["x", "y"]}
        state = {"w": torch.zeros(2), "step": 0, "cfg": cfg, "t": (0, 0)}
        tree = load(state)
        assert state["step"] == 7 and state["cfg"] is cfg and cfg == {"lr": 0.5, "tags": ["a", "b"]}
        assert torch.equal(state["w"], torch.ones(2))
        assert state["t"] == (1, 2) and tree["t"] == (1, 2)  # the tuple is replaced whole
