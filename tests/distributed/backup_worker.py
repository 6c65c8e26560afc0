"""A ``stalwart run`` worker script for the backup-worker tests: one worker is slowed.

The elastic tests' MLP on fresh rows per step (``batch(step, rank, size)``), committed with
the first ``n - b`` contributions. ``--slow-worker W --slow-s S`` makes worker W sleep S
seconds more than the others (``--base-s``, default 0) before each step's commit.
``--micro M`` accumulates the gradient over M micro-batches (the sleep spread over them)
through ``optimizer.accumulate``, which polls
``optimizer.too_late()`` between them: a member whose step already committed abandons the rest
(``--backup 1+partial``: sends the share it computed).

Usage: backup_worker.py --steps N --backup B|dynamic[+partial] [--slow-worker W --slow-s S]
       [--base-s S] [--micro M] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import stalwart
from stalwart.elastic import Job
from stalwart.elastic.backup import Dynamic, Static
from stalwart.testing import chaos


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh rows for every (step, rank): which members are late does not bias the mean."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 8, generator=g)
    return x, torch.tanh(x.sum(dim=1, keepdim=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--backup", required=True)
    parser.add_argument("--verify-every", type=int, default=5)
    parser.add_argument("--slow-worker", type=int, default=-1)
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--base-s", type=float, default=0.0)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    a = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    job = Job(stalwart.TrainingState(model=model, optimizer=opt), verify_every=a.verify_every)
    chaos.install(job)
    b, _, mode = a.backup.partition("+")  # "1", "dynamic", "1+partial", "dynamic+partial"
    part = mode == "partial"
    backup = Dynamic(partial=part) if b == "dynamic" else Static(int(b), partial=part)
    optimizer = job.optimizer(opt, backup=backup)
    worker = int(os.environ.get("STALWART_ELASTIC_WORKER", "-2"))
    while job.step < a.steps:
        optimizer.zero_grad()
        x, y = batch(job.step, job.rank, job.size)
        micro = list(zip(x.chunk(a.micro), y.chunk(a.micro), strict=True))
        for xs, ys in optimizer.accumulate(micro):  # stops early once too late
            (F.mse_loss(model(xs), ys) / a.micro).backward()
            time.sleep((a.base_s + (a.slow_s if worker == a.slow_worker else 0.0)) / a.micro)
        optimizer.step()
    job.close()
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        torch.save({"digest": job.digest(), "step": job.step}, a.out / f"final-{worker}.pt")


if __name__ == "__main__":
    main()
