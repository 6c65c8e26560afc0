"""Plain-data values in a state tree: Namespace, dataclasses, Enum, sets and paths travel safely."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import pathlib

import pytest
import torch

from stalwart.checkpoint import Checkpointer
from stalwart.errors import ConfigError, UnsupportedValueError
from stalwart.tree import allow_types, flatten, unflatten


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = 2


@dataclasses.dataclass(frozen=True)
class Opts:
    lr: float = 0.1
    tags: frozenset[str] = frozenset({"a", "b"})
    mode: Mode = Mode.SLOW
    derived: int = dataclasses.field(default=0, init=False)


class NotAllowed(enum.Enum):
    X = 1


def _round_trip(state: object) -> object:
    flat = flatten(state)
    skeleton = json.loads(json.dumps(flat.skeleton))  # what the manifest holds
    return unflatten(skeleton, lambda fqn: flat.leaves[fqn].tensor)


def test_plain_values_round_trip_through_a_checkpoint(tmp_path: pathlib.Path) -> None:
    allow_types(Mode, Opts)
    state = {
        "hparams": argparse.Namespace(lr=0.5, out=pathlib.Path("/data/x"), mode=Mode.FAST),
        "opts": Opts(),
        "seen": {3, 1, 2},
        "frozen": frozenset({"x"}),
        "pure": pathlib.PureWindowsPath("C:/a/b"),
        "w": torch.arange(4.0),
    }
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state)
        out = ck.load(None, 1)
    assert out["hparams"] == state["hparams"]
    assert isinstance(out["hparams"].out, pathlib.Path)
    assert out["opts"] == state["opts"] and out["opts"].mode is Mode.SLOW
    assert out["seen"] == {1, 2, 3} and isinstance(out["frozen"], frozenset)
    assert out["pure"] == state["pure"]
    assert torch.equal(out["w"], state["w"])


def test_sets_encode_the_same_whatever_their_order() -> None:
    a = flatten({"s": {"b", "a", "c"}}).skeleton
    b = flatten({"s": {"c", "b", "a"}}).skeleton
    assert json.dumps(a) == json.dumps(b)


def test_an_unallowed_enum_is_refused_on_load_with_the_way_to_opt_in() -> None:
    with pytest.raises(UnsupportedValueError, match=r"allow_types\(NotAllowed\)"):
        _round_trip({"m": NotAllowed.X})


def test_unknown_objects_and_tensors_in_sets_are_refused() -> None:
    with pytest.raises(UnsupportedValueError, match="dataclass, an Enum"):
        flatten({"x": object()})
    with pytest.raises(UnsupportedValueError, match="holds tensors"):
        flatten({"s": {torch.ones(1)}})
    with pytest.raises(ConfigError, match="Enum and dataclass"):
        allow_types(int)


def test_a_reader_that_ignores_tags_still_gets_the_data() -> None:
    node = flatten(argparse.Namespace(a=1)).skeleton
    assert node["k"] == "dict" and node["as"] == "namespace"
