"""An elastic worker with replica groups: FSDP2 inside each group, the job across groups.

``stalwart run --nproc 4 --group-size 2 groups_worker.py --steps N``: two replica groups of
two ranks. Each rank shards a small MLP with ``fully_shard(..., mesh=job.shard_mesh)``; the
global batch of step ``s`` is fixed (16 rows drawn from a generator seeded with ``s``) and
rank ``r`` of ``n`` (``job.rank``, ``job.size``: over every rank of every group) takes rows
``r::n``, so FSDP2's average inside a group and the job's average across groups give the
full batch's gradient whatever the membership. Run as one plain process it is a world of
one with a one-rank mesh: the reference.

Usage: groups_worker.py --steps N [--verify-every K] [--out DIR] [--hold-at STEP ...
                        --hold-replicas R] [--step-sleep S] [--follow] [--warmup]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import stalwart
from stalwart.elastic import Job
from stalwart.testing import chaos

GLOBAL_BATCH = 16


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return x[rank::size], y[rank::size]


def build(job: Job) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The MLP, every layer and the root sharded on the replica group's mesh."""
    torch.manual_seed(0)  # the same full weights on every rank before sharding
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 1))  # fmt: skip
    mesh = job.shard_mesh
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--verify-every", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--hold-at", type=int, action="append", default=[], help="wait here (repeatable)"
    )
    parser.add_argument("--hold-replicas", type=int, default=0)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--follow", action="store_true", help="Job(follow=True)")
    parser.add_argument("--warmup", action="store_true", help="Job(warmup=...): counted")
    a = parser.parse_args()
    random.seed(0)  # the digest covers every generator: seed them alike
    np.random.seed(0)
    state = stalwart.TrainingState()  # filled once the model is sharded on the job's mesh
    warmups = []

    def warmup() -> None:  # a replacement's first forward and backward, before it joins
        F.mse_loss(model(torch.zeros(2, 8)), torch.zeros(2, 1)).backward()
        opt.zero_grad()
        warmups.append(job.step)

    job = Job(state, verify_every=a.verify_every, follow=a.follow,
              warmup=warmup if a.warmup else None)  # fmt: skip
    model, opt = build(job)
    state.model, state.optimizer = model, opt  # before the first zero_grad(): the heal is there
    torch.manual_seed(0)  # the global generator is replicated state too
    chaos.install(job)
    job.data_parallel(model)
    optimizer = job.optimizer(opt)
    while job.step < a.steps:
        while job.step in a.hold_at and job.replicas < a.hold_replicas:
            job.refresh()  # wait for the replacement group, so the test sees a heal
        optimizer.zero_grad()
        x, y = batch(job.step, job.rank, job.size)
        F.mse_loss(model(x), y).backward()
        time.sleep(a.step_sleep)
        optimizer.step()
    job.close()
    wid = os.environ.get("STALWART_ELASTIC_WORKER") or "single"
    full = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        record = {"digest": job.digest(), "step": job.step, "shard_rank": job.shard_rank,
                  "group_size": job.group_size, "full": full, "warmups": warmups}  # fmt: skip
        torch.save(record, a.out / f"final-{wid}.pt")
    print(f"worker {wid}: done at step {job.step} (replicas {job.replicas})")


if __name__ == "__main__":
    main()
