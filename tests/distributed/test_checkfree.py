"""CheckFree: a lost pipeline stage rebuilt from its neighbours (or copied from a replica).

A 4-stage pipeline over 4 gloo processes (``checkfree_ranks.py``); stage 1's worker is
replaced at step 30 with nothing saved. Same seed and data in every mode, so the runs
differ only by the recovery.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stalwart.elastic.checkfree import (
    average_states,
    fresh_optimizer,
    neighbour_weights,
    plan_sources,
    recover_stage,
)
from stalwart.errors import ConfigError
from stalwart.testing import run_ranks

from . import checkfree_ranks as cr

pytestmark = pytest.mark.timeout(180)

STEPS, FAIL, LOST = 80, 30, 1


def _losses(tmp: Path, mode: str) -> dict[str, object]:
    results = run_ranks(cr.pipeline_body, 4, mode, STEPS, FAIL, LOST, tmp_dir=str(tmp))
    return {"losses": results[-1]["losses"], "records": [r["record"] for r in results]}


def test_a_lost_middle_stage_is_rebuilt_from_its_neighbours(tmp_path: Path) -> None:
    ref = {"losses": cr.reference_losses(STEPS)}  # no failure, in one process
    got = _losses(tmp_path, "checkfree")
    losses = got["losses"]
    assert isinstance(losses, list) and len(losses) == STEPS
    assert losses[:FAIL] == pytest.approx(ref["losses"][:FAIL], rel=1e-4), "same until the failure"
    records = got["records"]
    assert isinstance(records, list) and len({repr(r) for r in records}) == 1, "same everywhere"
    rec = records[0]
    assert rec.path == "neighbours" and rec.sources == (0, 2) and not rec.exact
    assert sum(rec.weights) == pytest.approx(1.0) and all(wt > 0 for wt in rec.weights)
    before = losses[FAIL - 1]
    assert losses[FAIL] > before, "the rebuilt stage is approximate: the loss jumps"
    tail = sum(losses[-10:]) / 10
    ref_tail = sum(ref["losses"][-10:]) / 10
    assert tail < losses[FAIL] and tail < 2.0 * ref_tail, (tail, ref_tail, losses[FAIL])


def test_a_replica_is_copied_exactly(tmp_path: Path) -> None:
    digests = run_ranks(cr.replica_body, 2, tmp_dir=str(tmp_path))
    assert digests[0] == digests[1]


def test_recovery_in_one_process() -> None:
    stages = cr.build()
    fresh = cr.Stage(2)
    states = {i: s.state_dict() for i, s in enumerate(stages)}
    rec = recover_stage(fresh, 2, states, 4, grad_norms={1: 1.0, 3: 3.0})
    assert rec.path == "neighbours" and rec.weights == (0.25, 0.75)
    want = 0.25 * stages[1].block.weight + 0.75 * stages[3].block.weight
    assert torch.allclose(fresh.block.weight, want)
    first = cr.Stage(0)
    rec = recover_stage(first, 0, states, 4)
    assert rec.path == "neighbour-copy" and rec.sources == (1,)
    assert set(rec.kept) == {"inp.weight", "inp.bias"}, "the first stage's own layer is kept"
    assert torch.equal(first.block.weight, stages[1].block.weight)
    rec = recover_stage(cr.Stage(1), 1, {}, 4, replica=states[1])
    assert rec.exact
    assert (
        neighbour_weights([None, 2.0]) == [0.5, 0.5] and neighbour_weights([0.0, 0.0]) == [0.5] * 2
    )
    assert plan_sources(3, 4) == ("neighbour-copy", (2,))
    with pytest.raises(ConfigError):
        plan_sources(0, 1)
    with pytest.raises(ConfigError):
        recover_stage(cr.Stage(1), 1, {0: states[0]}, 4)
    new, kept = average_states({"a": torch.ones(2)}, [{"a": torch.ones(3)}], [1.0])
    assert kept == ("a",) and torch.equal(new["a"], torch.ones(2))
    opt = torch.optim.Adam(stages[0].parameters(), lr=0.1)
    stages[0](torch.randn(2, 8)).sum().backward()
    opt.step()
    again = fresh_optimizer(opt)
    assert not again.state and again.defaults["lr"] == 0.1
