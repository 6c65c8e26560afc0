"""NCCL check for a GPU machine: a short chaos schedule on replica groups, digests compared.

Runs ``stalwart run --nproc N --group-size G`` with the model and the collectives on CUDA
(``Job(device="cuda")``: NCCL for the replicate groups and the groups' own process groups,
FSDP2 on ``job.shard_mesh``), under a seeded schedule: a SIGKILL inside the cross-group
all-reduce, a SIGKILL at the ``group-agree`` point (groups of 2 or more) and a SIGSTOP (a hung
rank, killed by the launcher after the hang timeout: the survivors' NCCL collective on it does
not fail by itself and must be aborted when the next epoch is published). Every rank verifies
every step; the script prints the recoveries and exits non-zero on any divergence (two
digests for one shard at one step, or at the end), a failed run or a missing death.

Layout by the GPUs present (NCCL wants one GPU per rank of a communicator): 4 or more: 2
groups x 2 ranks; 2 or 3: 2 groups x 1 rank; fewer: skipped with a message (exit 0), as
without CUDA. About 1-2 minutes; bounded at 5.

    python bench/gpu_elastic.py                 # on a machine with >= 2 GPUs
    python bench/gpu_elastic.py --device cpu    # the same harness over gloo, to check it
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

STEPS = 40
BOUND_S = 290  # the whole run, under 5 minutes


def _batch(step: int, rank: int, size: int, device: torch.device) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
    return x[rank::size].to(device), y[rank::size].to(device)


def worker(a: argparse.Namespace) -> None:
    """One rank under ``stalwart run``: FSDP2 on the group's mesh, verify every step."""
    from torch.distributed.fsdp import fully_shard

    import stalwart
    from stalwart.elastic import Job
    from stalwart.testing import chaos

    random.seed(0)
    np.random.seed(0)
    state = stalwart.TrainingState()
    job = Job(state, verify_every=1, device=a.device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10)).to(job.device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=job.shard_mesh)
    fully_shard(model, mesh=job.shard_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state.model, state.optimizer = model, opt
    torch.manual_seed(0)
    chaos.install(job)
    job.data_parallel(model)
    optimizer = job.optimizer(opt)
    while job.step < STEPS:
        while job.step in (12, 24, 36) and job.replicas < 2:
            job.refresh()
        optimizer.zero_grad()
        x, y = _batch(job.step, job.rank, job.size, job.device)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    job.close()
    print(f"worker {os.environ.get('STALWART_ELASTIC_WORKER')}: {job.backend}, step {job.step}")


def _layout(device: str) -> tuple[int, int] | None:
    if device == "cpu":
        return 4, 2
    if not torch.cuda.is_available():
        return None
    n = torch.cuda.device_count()
    return (4, 2) if n >= 4 else (2, 1) if n >= 2 else None


def _kills(nproc: int, group: int) -> list[dict[str, Any]]:
    """Three faults at steps 5, 17, 29, each on a rank of a group alive then."""
    if group == 2:  # groups [0,1] [2,3] -> [2,3] [4,5] -> [4,5] [6,7] -> ...
        return [
            {"worker": 1, "step": 5, "where": "collective", "delay_s": 0.002},
            {"worker": 2, "step": 17, "where": "agree"},
            {"worker": 5, "step": 29, "where": "boundary", "signal": "STOP"},
        ]
    return [  # workers 0, 1 -> 1, 2 -> 2, 3 -> ...
        {"worker": 0, "step": 5, "where": "collective", "delay_s": 0.002},
        {"worker": 1, "step": 17, "where": "boundary"},
        {"worker": 3, "step": 29, "where": "boundary", "signal": "STOP"},
    ]


def check(events: Path) -> tuple[int, dict[str, Any]]:
    """Divergences (per-shard digests at every step and at the end) and the run's facts."""
    from stalwart.elastic.recovery import digest_divergences, recoveries

    bad, verified = digest_divergences(events)
    rec = [{"worker": r.worker, "exit": r.exit_code, "detect_s": r.detect_s,
            "resume_s": r.resume_s, "lost_steps": r.lost_steps, "rejoin_s": r.rejoin_s}
           for r in recoveries(events)]  # fmt: skip
    return bad, {"verified_steps": verified, "recoveries": rec}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (NCCL), or cpu to check the harness")
    p.add_argument("--worker", action="store_true")
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    layout = _layout(a.device)
    if layout is None:
        print("skipped: NCCL needs CUDA and at least 2 GPUs (one per rank of a communicator); "
              f"found {torch.cuda.device_count() if torch.cuda.is_available() else 0}")  # fmt: skip
        return
    nproc, group = layout
    kills = _kills(nproc, group)
    with tempfile.TemporaryDirectory() as tmp:
        events = Path(tmp) / "events"
        me = [str(Path(__file__).resolve()), "--worker", "--device", a.device]
        cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", str(nproc), "--group-size",
               str(group), "--max-restarts", "3", "--timeout", "20", "--events", str(events),
               "--json", *me]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "STALWART_CHAOS": json.dumps({"kills": kills})}  # fmt: skip
        t0 = time.monotonic()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=BOUND_S)
        wall = time.monotonic() - t0
        bad, facts = check(events)
    deaths = sorted(r["worker"] for r in facts["recoveries"])
    ok = done.returncode == 0 and deaths == sorted(k["worker"] for k in kills)
    print(json.dumps({"device": a.device, "nproc": nproc, "group_size": group, "rc":
                      done.returncode, "wall_s": round(wall, 1), "divergences": bad,
                      "deaths_as_scheduled": ok, **facts}, indent=1))  # fmt: skip
    if not ok or bad:
        print(done.stderr[-4000:], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
