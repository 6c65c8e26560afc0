"""An elastic worker that logs the sample ids of every step it commits (exactly-once test).

A tiny MLP learns a fixed dataset of ``SAMPLES`` rows through an
:class:`~stalwart.elastic.sampler.ElasticSampler` (global batch ``BATCH``, a partial batch
at the end of each epoch). Each member trains on its share of the step's global batch,
weighting its summed loss by ``share.loss_scale``; right after ``optimizer.step()`` returns
with the step committed, it appends one JSON line to ``<out>/samples-<worker>.jsonl``:
the step, the membership epoch, its rank and size, its share's ids and the global batch's.
Discarded steps are not logged. The final parameters and digest go to ``final-<tag>.pt``.

Usage: sampler_worker.py --steps N --out DIR [--hold-at STEP --hold-size N]...
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import stalwart
from stalwart.elastic import Job
from stalwart.elastic.sampler import ElasticSampler
from stalwart.testing import chaos

SAMPLES = 50
BATCH = 7  # 8 steps per epoch: 7 batches of 7, then one of 1


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SAMPLES, 8, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hold-at", type=int, action="append", default=[])
    parser.add_argument("--hold-size", type=int, default=0)
    a = parser.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    x, y = dataset()
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = ElasticSampler(SAMPLES, BATCH, seed=11)
    job = Job(stalwart.TrainingState(model=model, optimizer=opt), verify_every=4)
    chaos.install(job)
    model = job.data_parallel(model)
    optimizer = job.optimizer(opt)
    tag = os.environ.get("STALWART_ELASTIC_WORKER") or "single"
    a.out.mkdir(parents=True, exist_ok=True)
    with open(a.out / f"samples-{tag}.jsonl", "a", buffering=1) as log:
        while job.step < a.steps:
            while job.step in a.hold_at and job.size < a.hold_size:
                job.refresh()  # wait for a replacement, so that the split changes
            optimizer.zero_grad()
            share = sampler.share(job.step, job.rank, job.size)
            i = torch.from_numpy(share.indices)
            if len(i):
                (F.mse_loss(model(x[i]), y[i], reduction="sum") * share.loss_scale).backward()
            before = job.step
            optimizer.step()
            if job.step == before + 1:  # committed (a discarded step leaves job.step)
                line = {"step": before, "epoch": job.epoch, "rank": share.rank,
                        "size": share.size, "ids": share.indices.tolist(),
                        "global": sampler.global_batch(before).tolist()}  # fmt: skip
                log.write(json.dumps(line) + "\n")
    job.close()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"params": params, "digest": job.digest(), "step": job.step},
               a.out / f"final-{tag}.pt")  # fmt: skip


if __name__ == "__main__":
    main()
