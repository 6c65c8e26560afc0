"""Per-rank bodies for ``test_step_exists_dist.py`` (module level: ``run_ranks`` pickles them)."""

from __future__ import annotations

import torch

import stalwart
from stalwart.errors import StepExistsError


def refuse_then_overwrite(rank: int, world: int, root: str) -> list[str]:
    """Save step 1, re-save it (every rank must refuse alike), then overwrite it on purpose."""
    outcomes = []
    with stalwart.Checkpointer(root) as ck:
        ck.save(1, {"w": torch.full((4,), float(rank + 1))})
        for call in (ck.save, ck.save_async):
            try:
                call(1, {"w": torch.zeros(4)})
                outcomes.append("saved")
            except StepExistsError:
                outcomes.append("refused")
        ck.save(1, {"w": torch.full((4,), 9.0)}, overwrite=True)
        outcomes.append(str(float(ck.load(None)["w"][0])))
    return outcomes
