"""A step discarded right after ``Job.data_parallel`` puts the model's buffers back.

``Job()`` snapshots its first step boundary before ``data_parallel`` names the buffers; the
snapshot must then take them, or a replacement whose first step is discarded keeps its own
BatchNorm statistics and parity blames it (a healthy worker named an SDC suspect).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stalwart
from stalwart.elastic import Job

pytestmark = pytest.mark.timeout(60)


def test_a_first_step_discarded_puts_batchnorm_statistics_back_exactly() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    job = Job(stalwart.TrainingState(model=model, optimizer=opt), world="single")
    job.data_parallel(model)
    optimizer = job.optimizer(opt)
    before = {name: b.clone() for name, b in model.named_buffers()}
    assert set(before) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    optimizer.zero_grad()  # the first step's boundary
    model(torch.randn(16, 4)).sum().backward()
    assert int(model[1].num_batches_tracked) == 1, "the forward updated the statistics"
    job.ledger.discard(RuntimeError("a peer died in the all-reduce"), fault=False)
    for name, b in model.named_buffers():
        assert torch.equal(b, before[name]), f"{name} not put back by the discard"
    assert job.step == 0
    job.close()


def test_buffers_named_after_the_step_began_wait_for_the_next_boundary() -> None:
    # The step is under way (its forward may have run): its snapshot is not taken again, so
    # the RNG a discard puts back stays the one of the step's start.
    model = nn.BatchNorm1d(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    job = Job(stalwart.TrainingState(model=model, optimizer=opt), world="single")
    optimizer = job.optimizer(opt)
    optimizer.zero_grad()
    start = torch.get_rng_state()
    torch.rand(5)  # drawn inside the step
    job.data_parallel(model)
    job.ledger.discard(RuntimeError("failed"), fault=False)
    assert torch.equal(torch.get_rng_state(), start), "the discard goes back to the step's start"
    job.close()
