"""``Job(state, checkpoint=...)`` in a world of one: saves on the schedule, resumes at start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stalwart
from stalwart.checkpoint import Checkpointer, EveryNSteps, Tier, TieredCheckpointer
from stalwart.elastic import ElasticSampler, Job
from stalwart.errors import ConfigError, StateMismatchError


def _train(root: Path, steps: int, *, batch: int = 4, tiered: bool = False) -> Job:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(10, batch, seed=1)
    state = stalwart.TrainingState(model=model, optimizer=opt, stateful={"sampler": sampler})
    ck: Checkpointer | TieredCheckpointer = Checkpointer(root)
    if tiered:
        ck = TieredCheckpointer([Tier(name="local", root=str(root), every=EveryNSteps(2))])
    job = Job(state, world="single", checkpoint=ck, save_every=2)
    optimizer = job.optimizer(opt)
    x = torch.linspace(-1, 1, 30).reshape(10, 3)
    while job.step < steps:
        optimizer.zero_grad()
        share = sampler.share(job.step, job.rank, job.size)
        i = torch.from_numpy(share.indices)
        (F.mse_loss(model(x[i]), x[i].sum(1, keepdim=True), reduction="sum")
         * share.loss_scale).backward()  # fmt: skip
        optimizer.step()
    job.close()
    return job


@pytest.mark.parametrize("tiered", [False, True])
def test_a_restarted_job_resumes_from_its_newest_saved_step(tmp_path: Path, tiered: bool) -> None:
    first = _train(tmp_path / "ck", 5, tiered=tiered)
    assert Checkpointer(tmp_path / "ck").steps() == [2, 4]
    second = _train(tmp_path / "ck", 7, tiered=tiered)
    held = second.ledger.checkpoint
    assert held is not None and held.last_report is not None
    assert held.last_report.step == 4 and held.last_report.steps_lost == 0
    assert Checkpointer(tmp_path / "ck").steps()[-1] == 6
    reference = _train(tmp_path / "other", 7, tiered=tiered)
    assert second.digest() == reference.digest()  # as if never stopped
    assert first.digest() != second.digest()


def test_a_different_data_stream_is_refused_not_climbed_past(tmp_path: Path) -> None:
    _train(tmp_path / "ck", 3)
    with pytest.raises(StateMismatchError, match="another data stream"):
        _train(tmp_path / "ck", 5, batch=5)


def test_checkpoint_must_be_a_checkpointer(tmp_path: Path) -> None:
    state = stalwart.TrainingState(model=nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="Checkpointer or a TieredCheckpointer"):
        Job(state, world="single", checkpoint=str(tmp_path))


def test_a_step_saved_again_after_a_rollback_overwrites_it(tmp_path: Path) -> None:
    from stalwart.elastic.checkpointing import JobCheckpoint

    model = nn.Linear(2, 2)
    state = stalwart.TrainingState(model=model, rng=False)
    held = JobCheckpoint(Checkpointer(tmp_path / "ck"), state, save_every=2)
    held.after_commit(2, writer=True)
    held.after_commit(3, writer=True)  # not due
    held.after_commit(1, writer=False)  # not the writer: nothing
    held.wait()
    with torch.no_grad():
        model.weight.add_(1.0)  # the replayed step 2 differs from the first one
    held.after_commit(2, writer=True)  # replayed after a rollback: replaces the saved step
    held.wait()
    fresh = nn.Linear(2, 2)
    Checkpointer(tmp_path / "ck").load(stalwart.TrainingState(model=fresh, rng=False))
    assert torch.equal(fresh.weight, model.weight)
    assert Checkpointer(tmp_path / "ck").steps() == [2]


def _train_scheduled(root: Path, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    state = stalwart.TrainingState(model=model, optimizer=opt, scheduler=sched)
    job = Job(state, world="single", checkpoint=Checkpointer(root), save_every=2)
    optimizer = job.optimizer(opt)
    while job.step < steps:
        optimizer.zero_grad()
        g = torch.Generator().manual_seed(job.step)
        model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
        optimizer.step()
        sched.step()  # the usual loop: the scheduler steps after the commit
    job.close()
    return model, opt


def test_a_save_holds_the_scheduler_the_loop_stepped_after_the_commit(tmp_path: Path) -> None:
    _train_scheduled(tmp_path / "ck", 5)  # saves steps 2 and 4; stops after step 5
    saved = Checkpointer(tmp_path / "ck").load(None, 4)
    assert saved["scheduler"]["last_epoch"] == 4  # not 3: the save waited for the boundary
    resumed, opt = _train_scheduled(tmp_path / "ck", 8)
    reference, ref_opt = _train_scheduled(tmp_path / "other", 8)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert torch.equal(resumed.weight, reference.weight)
