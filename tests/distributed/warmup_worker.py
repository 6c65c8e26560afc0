"""An elastic worker with a warm-up (``Job(warmup=...)``), for ``test_elastic_warmup.py``.

Trains a small MLP with AdamW under ``stalwart run``; the warm-up (one forward and backward
on zeros, then ``zero_grad()``) leaves a marker file named after the worker, and each worker
writes its final digest.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

import numpy as np
import torch
from torch import nn

import stalwart
from stalwart.elastic import Job
from stalwart.testing import chaos


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    wid = os.environ["STALWART_ELASTIC_WORKER"]
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def warmup() -> None:
        model(torch.zeros(4, 32)).square().sum().backward()
        opt.zero_grad()
        (a.out / f"warmed-{wid}").write_text(json.dumps({"grads": [
            p.grad is None for p in model.parameters()]}))  # fmt: skip

    job = Job(stalwart.TrainingState(model=model, optimizer=opt), verify_every=3, warmup=warmup)
    chaos.install(job)
    model = job.data_parallel(model)
    optimizer = job.optimizer(opt)
    while job.step < a.steps:
        while job.step == a.steps - 3 and job.replicas < 2:
            job.refresh()  # the replacement joins before the end
        optimizer.zero_grad()
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(job.step))
        x = x.chunk(job.size)[job.rank]
        model(x).square().mean().backward()
        optimizer.step()
    job.close()
    (a.out / f"final-{wid}.json").write_text(json.dumps({"digest": job.digest()}))


if __name__ == "__main__":
    main()
