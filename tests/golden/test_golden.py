"""Every released format version's golden checkpoint keeps loading, bit for bit."""

from __future__ import annotations

from pathlib import Path

import torch

import stalwart
from tests.golden.make_golden import golden_state

HERE = Path(__file__).resolve().parent


def test_v1_golden_checkpoint_loads() -> None:
    ckpt = stalwart.Checkpointer(HERE / "v1")
    assert ckpt.steps() == [42, 43]
    expected = golden_state()
    loaded = ckpt.load(None, step=42)
    for k, v in expected["model"].items():
        assert torch.equal(loaded["model"][k], v)
    assert {k: loaded[k] for k in ("step", "lr", "name", "sizes")} == {
        k: expected[k] for k in ("step", "lr", "name", "sizes")
    }
    assert ckpt.manifest(42).metadata["written_by"] == "0.1.0"
    assert ckpt.load(None)["step"] == 43


def test_v2_golden_checkpoint_loads_and_carries_its_checksum() -> None:
    ckpt = stalwart.Checkpointer(HERE / "v2")
    assert ckpt.steps() == [42, 43]
    expected = golden_state()
    loaded = ckpt.load(None, step=42)
    for k, v in expected["model"].items():
        assert torch.equal(loaded["model"][k], v)
    assert {k: loaded[k] for k in ("step", "lr", "name", "sizes")} == {
        k: expected[k] for k in ("step", "lr", "name", "sizes")
    }
    assert ckpt.load(None)["step"] == 43
    assert all(ckpt.verify(s).ok for s in (42, 43))
    for version in ("v1", "v2"):  # v1 has no manifest checksum; v2 ends with one
        data = (HERE / version / "manifests" / "step-00000000000000000042.json").read_bytes()
        assert (b',"checksum":"' in data[-80:]) == (version == "v2")
