"""A preemption signal that reaches one rank stops every rank at the same step, saved."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from stalwart import Checkpointer
from stalwart.testing import run_ranks

from . import preempt_ranks

pytestmark = pytest.mark.timeout(180)


def test_one_signalled_rank_stops_all_at_one_step(tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    results = run_ranks(preempt_ranks.signal_one_rank, 2, root, timeout_s=120)
    assert [step for step, _ in results] == [3, 3]
    assert results[1][1] == 128 + signal.SIGUSR1  # the signalled rank: 128 + its signal
    assert results[0][1] == 128 + signal.SIGUSR1  # its peer stops with the guard's first signal
    ckpt = Checkpointer(root)
    assert ckpt.steps() == [3]
    tree = ckpt.load()
    assert torch.equal(tree["r0"], torch.full((8,), 3.0))
    assert torch.equal(tree["r1"], torch.full((8,), 4.0))
