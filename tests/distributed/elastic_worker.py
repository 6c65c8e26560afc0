"""An elastic worker script for the tests: a tiny MLP on generated data.

Runs unchanged under ``stalwart run``, ``torchrun`` and as one plain process. The global batch
of step ``s`` is fixed (12 rows drawn from a generator seeded with ``s``); member ``r`` of ``n``
takes rows ``r::n``, so the averaged gradient is the full batch's whatever the membership
(n in 1, 2, 3, 4), and the final parameters can be compared with a one-process run.

Usage: elastic_worker.py --steps N [--verify-every K] [--out DIR] [--step-sleep S]
                         [--min-size M] [--hold-at STEP --hold-size N] [--stats-window W]
                         [--batchnorm] [--corrupt-at STEP --corrupt-worker W]
                         [--ckpt DIR --ckpt-every K [--memory-tier] [--ckpt-wait]]
                         [--follow]

``--ckpt`` attaches checkpoint tiers (``Job(state, checkpoint=...)``): a durable tier under
``DIR`` every ``K`` steps (``--memory-tier``: and a memory tier every step before it).
``--ckpt-wait`` waits for each save to land before the next step, for tests whose kill must
come after a save, not race its background write.

``--corrupt-at`` flips one bit of a weight on worker ``W`` right after it commits step
``STEP``, once per process (a silent data corruption that only the digests can see).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import stalwart
from stalwart.elastic import Job
from stalwart.testing import chaos

GLOBAL_BATCH = 12


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This member's share of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return x[rank::size], y[rank::size]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--verify-every", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--min-size", type=int, default=1)
    parser.add_argument("--hold-at", type=int, default=-1, help="wait here for --hold-size")
    parser.add_argument("--hold-size", type=int, default=0)
    parser.add_argument("--stats-window", type=int, default=20)
    parser.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d after layer 0")
    parser.add_argument("--corrupt-at", type=int, default=-1)
    parser.add_argument("--corrupt-worker", type=int, default=0)
    parser.add_argument("--ckpt", type=Path, default=None)
    parser.add_argument("--ckpt-every", type=int, default=3)
    parser.add_argument("--memory-tier", action="store_true")
    parser.add_argument("--ckpt-wait", action="store_true")
    parser.add_argument("--follow", action="store_true", help="Job(follow=True)")
    a = parser.parse_args()
    torch.manual_seed(0)  # and the other generators: the digest covers them (runs compare)
    random.seed(0)
    np.random.seed(0)
    norm: list[nn.Module] = [nn.BatchNorm1d(16)] if a.batchnorm else []
    model = nn.Sequential(nn.Linear(8, 16), *norm, nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = stalwart.TrainingState(model=model, optimizer=opt)
    job = Job(state, min_size=a.min_size, verify_every=a.verify_every, stats_window=a.stats_window,
              checkpoint=_tiers(a.ckpt, a.ckpt_every, a.memory_tier), follow=a.follow)  # fmt: skip
    chaos.install(job)
    model = job.data_parallel(model)
    optimizer = job.optimizer(opt)
    wid = int(os.environ.get("STALWART_ELASTIC_WORKER", "0"))
    corrupt = a.corrupt_at >= 0 and wid == a.corrupt_worker
    while job.step < a.steps:
        while job.step == a.hold_at and job.size < a.hold_size:
            job.refresh()  # wait for a replacement to join, so the test sees a heal
        optimizer.zero_grad()
        x, y = batch(job.step, job.rank, job.size)
        F.mse_loss(model(x), y).backward()
        time.sleep(a.step_sleep)
        optimizer.step()
        if a.ckpt_wait and job.step % a.ckpt_every == 0:
            job.checkpoint.wait()  # the save of this step has landed before the next begins
        if corrupt and job.step == a.corrupt_at:
            corrupt = False  # once: a rollback recomputes this step without it
            with torch.no_grad():
                model[0].weight.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 20)
    job.close()
    print(f"worker {os.environ.get('STALWART_ELASTIC_WORKER', '-')}: done at step {job.step}")
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        tag = os.environ.get("STALWART_ELASTIC_WORKER") or os.environ.get("RANK") or "single"
        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save({"params": params, "digest": job.digest(), "step": job.step},
                   a.out / f"final-{tag}.pt")  # fmt: skip


def _tiers(root: Path | None, every: int, memory: bool) -> Any:
    if root is None:
        return None
    from stalwart.checkpoint import EveryNSteps, KeepLast, Tier, TieredCheckpointer

    durable = Tier(name="local", root=str(root), every=EveryNSteps(every), keep=KeepLast(3))
    return TieredCheckpointer([Tier.memory(), durable] if memory else [durable])


if __name__ == "__main__":
    main()


# -- bodies for run_ranks (parity policy tests): fn(rank, world_size, ...) -------------------


def _tiny_state(seed: int = 0) -> stalwart.TrainingState:
    torch.manual_seed(seed)  # RNG is replicated state: seed every generator alike
    random.seed(seed)
    np.random.seed(seed)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return stalwart.TrainingState(model=model, optimizer=opt)


def _train_one(state: stalwart.TrainingState) -> None:
    state.optimizer.zero_grad()
    state.model(torch.ones(3, 4)).sum().backward()
    state.optimizer.step()


def reconcile_policies(rank: int, world_size: int) -> dict[str, tuple[Any, ...]]:
    """Both rules of the parity policy, on 3 ranks of one gloo world.

    ``ahead``: rank 0 committed one more step (its copy of the all-reduce succeeded while the
    others' failed): everyone rolls forward to it. ``majority``: all at the same step, rank 1
    silently different in one value: rank 1 is repaired from the majority.
    """
    import torch.distributed as dist

    from stalwart.elastic.parity import reconcile
    from stalwart.elastic.state import digest

    out: dict[str, tuple[Any, ...]] = {}
    state = _tiny_state()
    step = 0
    if rank == 0:
        _train_one(state)
        step = 1
    step, found = reconcile(state, step, rank, dist.group.WORLD)
    out["ahead"] = (step, digest(state, step), found.received, found.source)
    _train_one(state)
    if rank == 1:
        with torch.no_grad():
            state.model.weight.view(-1)[0] += 1e-6  # one silently different value
    step, found = reconcile(state, step + 1, rank, dist.group.WORLD)
    out["majority"] = (step, digest(state, step), found.received, found.mismatch, found.source)
    return out


def reconcile_rollback(rank: int, world_size: int) -> dict[str, Any]:
    """Two members split with no majority: both go back to their last agreed state.

    Both agree at step 1 (recorded), take one more step, then rank 0's copy is corrupted (the
    rank the old tie rule trusted). The split rolls both back to step 1; the same split again
    before a later agreement is persistent and raises.
    """
    import torch.distributed as dist

    from stalwart.elastic.parity import reconcile
    from stalwart.elastic.state import AgreedState, digest
    from stalwart.errors import DistributedError

    state, agreed = _tiny_state(), AgreedState()
    _train_one(state)
    step, _ = reconcile(state, 1, rank, dist.group.WORLD, agreed)
    at_one = digest(state, step)
    out: dict[str, Any] = {"recorded": agreed.step}
    for attempt in ("first", "again"):
        _train_one(state)
        if rank == 0:
            with torch.no_grad():
                state.model.weight.view(-1)[0] += 1e-6  # one silently different value
        try:
            step, found = reconcile(state, 2, rank, dist.group.WORLD, agreed)
        except DistributedError as e:
            out[attempt] = str(e)
            break
        out[attempt] = (step, digest(state, step) == at_one, str(found.decision),
                        found.rolled_back_from, found.mismatch)  # fmt: skip
    return out
