"""An elastic worker with sharded state, for ``test_elastic_sharded.py``.

Replicated part: a tiny MLP trained data parallel by the job (the global batch of step ``s``
is fixed and slot ``q`` of ``n`` takes rows ``q::n``). Sharded part: an "expert" per slot,
trained only on that slot's own rows (its gradients never leave the member), stepped by
:meth:`ShardedState.step_on_commit`; nobody else holds it, so a replacement can only get it
from the erasure-coded pieces. The expert's update depends on nothing but its own state and
the slot's data, so its final bytes must equal an uninterrupted run's bit for bit.

Writes ``<out>/log-w<wid>.jsonl`` (one line per protect: step, slot, shard digest; one per
heal) and ``<out>/final-w<wid>.pt``.

Usage: sharded_worker.py --steps N --out DIR [--k 3 --m 1] [--every 1] [--table-mib MIB]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import stalwart
from stalwart.elastic import Job
from stalwart.elastic.sharded import ShardedState
from stalwart.elastic.state import digest
from stalwart.testing import chaos

GLOBAL_BATCH = 12


def batch(step: int, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot ``slot``'s share of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return x[slot::n], y[slot::n]


def expert_batch(step: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows only slot ``slot``'s expert trains on."""
    g = torch.Generator().manual_seed(50_000 + 100 * slot + step)
    x = torch.randn(6, 8, generator=g)
    return x, torch.cos(x[:, :4] * (slot + 1))


def _expert(table_mib: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(7)  # the same start on every slot; training sets apart
    expert = nn.Linear(8, 4)
    expert.register_buffer("table", torch.ones(table_mib * (1 << 18)))  # bulk, for the bench
    with torch.no_grad():
        for p in expert.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return expert


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--table-mib", type=int, default=0, help="bulk added to each shard")
    a = parser.parse_args()
    wid = os.environ.get("STALWART_ELASTIC_WORKER", "single")
    a.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    expert = _expert(a.table_mib)
    eopt = torch.optim.SGD(expert.parameters(), lr=0.05, momentum=0.9)
    shard = stalwart.TrainingState(model=expert, optimizer=eopt, rng=False)
    job = Job(stalwart.TrainingState(model=model, optimizer=opt), min_size=4, verify_every=5)
    chaos.install(job)
    optimizer = job.optimizer(opt)
    sharded = ShardedState(job, shard, k=a.k, m=a.m, every=a.every)
    sharded.step_on_commit(eopt)
    log = (a.out / f"log-w{wid}.jsonl").open("a")

    def record(event: str, step: int) -> None:
        if event == "commit" and sharded.protected_step == step:
            line = {"kind": "protect", "step": step, "slot": sharded.slot,
                    "shard": digest(shard, step)}  # fmt: skip
            log.write(json.dumps(line) + "\n")
            log.flush()

    job.add_listener(record)
    if sharded.last_heal is not None:  # a replacement: its shard was rebuilt at construction
        line = {"kind": "heal", **sharded.last_heal, "slot": sharded.slot,
                "shard": digest(shard, job.step)}  # fmt: skip
        log.write(json.dumps(line) + "\n")
        log.flush()
    while job.step < a.steps:
        optimizer.zero_grad()
        x, y = batch(job.step, sharded.slot, sharded.n)
        xe, ye = expert_batch(job.step, sharded.slot)
        (F.mse_loss(model(x), y) + F.mse_loss(expert(xe), ye)).backward()
        optimizer.step()
    job.close()
    final = {
        "slot": sharded.slot,
        "step": job.step,
        "heals": sharded.heals,
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "expert": {k: v.detach().clone() for k, v in expert.state_dict().items()},
        "shard": digest(shard, job.step),
    }
    torch.save(final, a.out / f"final-w{wid}.pt")


if __name__ == "__main__":
    main()
