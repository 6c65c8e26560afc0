"""A sharded state loaded into a fresh optimizer trains on exactly as the original.

A job that starts again builds its model and optimizer anew and loads them: the optimizer has
no state yet (torch creates it at the first step). Before ``fresh_optimizers``, a load of an
FSDP2 checkpoint gave such an optimizer plain tensors, and its next step failed ("got mixed
torch.Tensor and DTensor"). Here, 2 gloo ranks shard an MLP with ``fully_shard``, train two
steps, save, load into a fresh model and optimizer (from disk and from a memory tier), and
take the same third step on both: every shard of every parameter and moment is equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.testing import run_ranks
from tests.distributed import fresh_optimizer_ranks as ranks


@pytest.mark.parametrize("tier", ["disk", "memory"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_a_fresh_optimizer_loads_sharded_state_and_steps_as_the_original(
    tmp_path: Path, kind: str, tier: str
) -> None:
    results = run_ranks(ranks.load_into_fresh, 2, str(tmp_path / "ckpt"), kind, tier,
                        timeout_s=120)  # fmt: skip
    for r in results:
        assert r["error"] == "", r["error"]
        assert r["kinds"] == ["DTensor"]  # the moments are shards, as their parameters
        assert r["same"]
