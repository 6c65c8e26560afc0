"""Training through a slow worker: backup workers with partial contributions, or Adasum.

    stalwart run --nproc 3 examples/slow_workers.py                   # Dynamic(partial=True)
    stalwart run --nproc 3 examples/slow_workers.py --backup 0        # synchronous, for contrast
    stalwart run --nproc 3 examples/slow_workers.py --reduce adasum     # synchronous Adasum
    python examples/slow_workers.py                                   # one process (world of one)

Every step is 4 micro-batches of gradient accumulation; a different worker each step is made
2x slower (``--slow-s`` of sleep per step). With backup workers a step commits once ``n - b``
members finished; ``optimizer.accumulate`` stops the slow one at its next micro-batch and it
sends the share it computed (weighted by that share), so its work is not lost. Worker 0 prints
the step time and held-out loss; compare the runs above.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import stalwart
from stalwart.elastic import Dynamic, Job, Static


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh rows for every (step, rank): which members are late does not bias the mean."""
    g = torch.Generator().manual_seed(1_000 * step + rank)
    x = torch.randn(32, 16, generator=g)
    return x, torch.sin(x @ torch.linspace(-1, 1, 16)).unsqueeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--backup", default="dynamic", help="'dynamic' or a count b (0: sync)")
    parser.add_argument("--reduce", default="mean", choices=["mean", "adasum"])
    parser.add_argument("--slow-s", type=float, default=0.02, help="compute per step, seconds")
    a = parser.parse_args()
    torch.manual_seed(0)  # every worker starts from the same model
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    job = Job(stalwart.TrainingState(model=model, optimizer=opt))
    model = job.data_parallel(model, reduce=a.reduce)
    backup = Dynamic(partial=True) if a.backup == "dynamic" else Static(int(a.backup), True)
    # backup steps average through the coordinator's store: Adasum runs synchronous steps
    use = job.size > 1 and a.backup != "0" and a.reduce == "mean"
    optimizer = job.optimizer(opt, backup=backup if use else 0)
    held_out = batch(-1, 0)
    t0 = time.time()
    while job.step < a.steps:
        optimizer.zero_grad()
        x, y = batch(job.step, job.rank)
        micro = list(zip(x.chunk(4), y.chunk(4), strict=True))
        slow = job.size > 1 and job.step % job.size == job.rank  # a different one each step
        for xs, ys in optimizer.accumulate(micro):  # stops early once the step committed
            (F.mse_loss(model(xs), ys) / len(micro)).backward()
            time.sleep(a.slow_s * (2 if slow else 1) / len(micro))  # the modelled compute
        optimizer.step()
        if job.rank == 0 and job.step % 20 == 0:
            with torch.no_grad():
                loss = float(F.mse_loss(model(held_out[0]), held_out[1]))
            per_step = 1e3 * (time.time() - t0) / job.step
            print(f"step {job.step}: held-out loss {loss:.4f}, {per_step:.1f} ms/step")  # noqa: T201
    job.close()
    if os.environ.get("STALWART_ELASTIC_WORKER", "0") == "0":
        print(f"done: {job.step} steps, {job.size} worker(s), {job.digest()[:12]}")  # noqa: T201


if __name__ == "__main__":
    main()
