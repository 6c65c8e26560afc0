"""The worker that ``bench/plan_validate.py`` runs under ``stalwart run``.

An MLP (256 -> 1024 -> 1024 -> 256, 1.6 M parameters, SGD with momentum: 12.6 MB of state) on
generated data, with a durable tier attached (``Job(state, checkpoint=...)``: a local folder
every ``--ckpt-every`` steps and at step 1, the last 3 kept) and the chaos schedule of the
environment installed (``stalwart.testing.chaos``: timed kills, hangs and losses of every
member).

The step's compute is a fixed global batch shared by the members: the members pace their
steps to ``--batch-s x members / live members`` seconds (sleeping out what the small real
forward, backward and all-reduce leave), so a job missing a member trains at (n - 1) / n of its
speed while it heals, as a data-parallel job on accelerators would, and the loaded 2-core box's
drift shows only where a step takes longer than its pace.

``--save-stall-s X`` makes every interval save (not the one at step 1) stall training for X
seconds (a sleep after the save's step): a stand-in for a tier whose save costs a noticeable
share of the interval, which this box cannot produce with a state that fits it (a larger state
slows every step, not the save alone).

``--group-size G`` (with ``stalwart run --group-size G``): replica groups of G ranks, the MLP
sharded by FSDP2 inside each (``fully_shard`` on ``job.shard_mesh``); ``--members`` then counts
ranks, so a group out of the job slows the others' steps as a data-parallel job's.

Usage: plan_chaos_worker.py --steps N --members M --batch-s S --ckpt DIR --ckpt-every K
       [--save-stall-s X] [--group-size G]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import stalwart
from stalwart.checkpoint import AnyOf, EveryNSteps, KeepLast, Tier, TieredCheckpointer
from stalwart.elastic import Job
from stalwart.testing import chaos


class FirstStep:
    """Save step 1 too: a job that loses every member before its first interval resumes from
    it (the model's snapshot at step 0) instead of stopping with nothing to resume."""

    def due(self, step: int, now_s: float, last_step: int | None, last_s: float | None) -> bool:
        return step == 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch-s", type=float, required=True, help="the full job's step, s")
    parser.add_argument("--members", type=int, required=True, help="the full job's members")
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--ckpt-every", type=int, required=True)
    parser.add_argument("--verify-every", type=int, default=50)
    parser.add_argument("--save-stall-s", type=float, default=0.0, help="each interval save")
    parser.add_argument("--group-size", type=int, default=1, help="stalwart run's --group-size")
    a = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(),
                          nn.Linear(1024, 256))  # fmt: skip
    every = a.ckpt_every if a.ckpt_every > 0 else 10**9  # 0: the tier never saves
    saves = AnyOf(EveryNSteps(every), FirstStep())
    tier = Tier(name="durable", root=str(a.ckpt), every=saves, keep=KeepLast(3))
    tiers = TieredCheckpointer([tier])
    if a.group_size > 1:  # FSDP2 inside each replica group, on the mesh the job gives
        state = stalwart.TrainingState()  # filled before the first zero_grad(), where it joins
        job = Job(state, verify_every=a.verify_every, checkpoint=tiers)
        for layer in [*(m for m in model if isinstance(m, nn.Linear)), model]:
            fully_shard(layer, mesh=job.shard_mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        state.model, state.optimizer = model, opt
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        state = stalwart.TrainingState(model=model, optimizer=opt)
        job = Job(state, verify_every=a.verify_every, checkpoint=tiers)
    chaos.install(job)
    model = job.data_parallel(model)
    optimizer = job.optimizer(opt)
    pace = time.monotonic()
    while job.step < a.steps:
        optimizer.zero_grad()
        g = torch.Generator().manual_seed(job.step * 100 + job.rank)
        x = torch.randn(16, 256, generator=g)
        F.mse_loss(model(x), torch.tanh(x)).backward()
        # the members' share of the global batch: a step of the full job takes batch_s
        pace = max(pace + a.batch_s * a.members / job.size, time.monotonic())
        time.sleep(max(pace - time.monotonic(), 0.0))
        optimizer.step()
        if a.save_stall_s and job.step % every == 0:  # this step's boundary saved the tier
            time.sleep(a.save_stall_s)
    job.close()


if __name__ == "__main__":
    main()
