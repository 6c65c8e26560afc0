"""Rank bodies (and a ``stalwart run`` worker script) for the Adasum tests.

The bodies run under :func:`stalwart.testing.run_ranks` (``fn(rank, world_size, ...)``); the
script at the bottom trains the elastic tests' MLP with ``reduce="adasum"``.

Usage: adasum_ranks.py --steps N [--verify-every K] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import stalwart
from stalwart.elastic import Job
from stalwart.elastic.reduce import adasum, adasum_hook
from stalwart.testing import chaos

SHAPES = ((5, 3), (7,), (1,), (4, 4))


def inputs(rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s tensors: fp32 and bf16, one all-zero on odd ranks, one shared direction."""
    g = torch.Generator().manual_seed(100 + rank)
    out = [torch.randn(s, generator=g) for s in SHAPES]
    out[1] = out[1].to(torch.bfloat16)
    if rank % 2:
        out[2] = torch.zeros(1)  # a zero-norm contribution
    out[3] = torch.ones(4, 4) * (rank + 1)  # parallel on every rank
    return out


def distributed_adasum(rank: int, world_size: int) -> list[torch.Tensor]:
    """``adasum`` of :func:`inputs` over the default group; checks the inputs are untouched."""
    mine = inputs(rank)
    out = adasum(mine, dist.group.WORLD)
    assert all(torch.equal(a, b) for a, b in zip(mine, inputs(rank), strict=True))
    return out


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


_W = torch.linspace(-1.0, 1.0, 8).reshape(8, 1)  # a learnable target: y = tanh(x @ W)


def _batch(step: int, rank: int, size: int, rows: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(rows, 8, generator=g)
    return x[rank::size], torch.tanh(x @ _W)[rank::size]


def ddp_hook_trains(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """DDP with ``adasum_hook`` (tiny buckets, several parameters each): every step's reduced
    gradients equal ``adasum`` of the local gradients (computed on a twin model), and the
    loss falls."""
    model = _mlp()
    twin = _mlp()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)
    ddp.register_comm_hook(None, adasum_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    held_out = _batch(-1, 0, 1, rows=256)
    losses, mismatches = [], 0
    for step in range(steps):
        x, y = _batch(step, rank, world_size)
        twin.load_state_dict(model.state_dict())
        twin.zero_grad()
        F.mse_loss(twin(x), y).backward()
        expected = adasum([p.grad for p in twin.parameters()], dist.group.WORLD)
        opt.zero_grad()
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        got = [p.grad for p in model.parameters()]
        mismatches += sum(not torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        opt.step()
        with torch.no_grad():
            losses.append(float(F.mse_loss(model(held_out[0]), held_out[1])))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"losses": losses, "mismatches": mismatches, "params": params}


def fixed_world_job(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """``Job`` in its fixed-world mode (torchrun's environment) with ``reduce="adasum"``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    job = Job(stalwart.TrainingState(model=model, optimizer=opt), verify_every=5)
    job.data_parallel(model, reduce="adasum")
    optimizer = job.optimizer(opt)
    reference_grads: list[torch.Tensor] = []
    while job.step < steps:
        optimizer.zero_grad()
        x, y = _batch(job.step, job.rank, job.size)
        F.mse_loss(model(x), y).backward()
        if job.step == 0:
            reference_grads = adasum([p.grad for p in model.parameters()], dist.group.WORLD)
        optimizer.step()
        if job.step == 1:
            first = [p.grad.clone() for p in model.parameters()]
    job.close()
    same = all(torch.equal(a, b) for a, b in zip(first, reference_grads, strict=True))
    return {"digest": job.digest(), "step": job.step, "first_grads_are_adasum": same}


def main() -> None:
    """The elastic tests' training loop (see ``elastic_worker.py``) with Adasum."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--verify-every", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    a = parser.parse_args()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    job = Job(stalwart.TrainingState(model=model, optimizer=opt), verify_every=a.verify_every)
    chaos.install(job)
    model = job.data_parallel(model, reduce="adasum")
    optimizer = job.optimizer(opt)
    while job.step < a.steps:
        optimizer.zero_grad()
        x, y = _batch(job.step, job.rank, job.size)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    job.close()
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        tag = os.environ.get("STALWART_ELASTIC_WORKER", "single")
        torch.save({"digest": job.digest(), "step": job.step}, a.out / f"final-{tag}.pt")


if __name__ == "__main__":
    main()
