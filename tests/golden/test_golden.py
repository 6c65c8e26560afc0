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
