"""Replica groups (2 groups x 2 ranks, FSDP2 on gloo/CPU): chaos cycles, and healthy overhead.

**Cycles** (``--cycles N``, default 50): seeded kill/rejoin cycles on ``stalwart run --nproc 4
--group-size 2``. Cycle ``k`` kills one rank of a live group at a seeded step and point
(``collective``: SIGKILL 0-3 ms into the cross-group all-reduce, from a timer thread;
``agree``: after the replicate all-reduce, before the group agreed; ``boundary``: at the step
boundary); the launcher takes the group out and starts a new one, which heals rank by rank
from a live group; the survivors hold at the end of the cycle until two groups train again.
Every rank verifies every step (``verify_every=1``) and logs its per-shard digest: a
*divergence* is a (step, shard) with two digests across groups, or final digests of one
shard that differ. Cycles run ``--cycles-per-run`` to a ``stalwart run``.

    .venv/bin/python bench/elastic_groups_bench.py --cycles 50            # the long run
    .venv/bin/python bench/elastic_groups_bench.py --cycles 4 --runs 0    # a short check
    .venv/bin/python bench/elastic_groups_bench.py --cycles 50 --runs 0 --follow  # groups follow

``--follow``: ``Job(follow=True)``: each rank of a new group follows the survivors' rank of its
shard while they commit, instead of being healed at the epoch change; the totals count the
follows promoted and the heals (a follow that fell back is healed).

**Overhead** (``--runs R``, default 5): healthy per-step time, stalwart (``--group-size 2``,
FSDP2 on ``job.shard_mesh``, the job's all-reduce across groups, digests every 50 steps as
in the library) against plain HSDP (``torchrun``, FSDP2 on a 2-D mesh (replicate, shard):
torch's own hybrid sharding, no fault tolerance). Same MLP, data and optimizer; runs
alternate (order rotating); the table gives medians and ranges of the per-run medians.

    .venv/bin/python bench/elastic_groups_bench.py --cycles 0 --runs 5 --steps 150
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
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

PERIOD = 8  # steps per cycle: kill in [2, 4], hold at 6 until two groups train again
HIDDEN = 512


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN),
                         nn.ReLU(), nn.Linear(HIDDEN, 10))  # fmt: skip


def _shard(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(128, 256, generator=g), torch.randint(0, 10, (128,), generator=g)
    return x[rank::size], y[rank::size]


# -- workers ------------------------------------------------------------------------------


def worker_stalwart(a: argparse.Namespace) -> None:
    """One rank under ``stalwart run --group-size 2`` (cycles and overhead)."""
    import stalwart
    from stalwart.elastic import Job
    from stalwart.testing import chaos

    random.seed(0)
    np.random.seed(0)
    state = stalwart.TrainingState()
    job = Job(state, verify_every=a.verify_every, follow=a.follow)
    model = _model()
    _shard(model, job.shard_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state.model, state.optimizer = model, opt
    torch.manual_seed(0)
    chaos.install(job)
    job.data_parallel(model)
    optimizer = job.optimizer(opt)
    holds = set(a.hold_at)
    times = []
    while job.step < a.total:
        while job.step in holds and job.replicas < 2:
            job.refresh()
        t0 = time.perf_counter()
        optimizer.zero_grad()
        x, y = _batch(job.step, job.rank, job.size)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    job.close()
    if a.out is not None and job.rank == 0:
        a.out.write_text(json.dumps(times))


def worker_hsdp(a: argparse.Namespace) -> None:
    """One rank of plain HSDP under torchrun: FSDP2 on a 2-D (replicate, shard) mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size // 2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model()
    _shard(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(a.total):
        t0 = time.perf_counter()
        opt.zero_grad()
        x, y = _batch(step, rank, size)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    if rank == 0 and a.out is not None:
        a.out.write_text(json.dumps(times))
    dist.destroy_process_group()


# -- the overhead table -------------------------------------------------------------------


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra or {})}
    env.pop("STALWART_ELASTIC_STORE", None)
    return env


def _timed_run(contender: str, a: argparse.Namespace, tmp: Path) -> float:
    out = tmp / f"{contender}-{time.monotonic_ns()}.json"
    me = [str(Path(__file__).resolve()), "--worker", contender, "--total",
          str(a.warmup + a.steps), "--out", str(out), "--verify-every", "50"]  # fmt: skip
    if contender == "hsdp":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", *me]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "4", "--group-size", "2",
               "--timeout", "60", *me]  # fmt: skip
    subprocess.run(cmd, env=_env(), check=True, capture_output=True, timeout=900)
    return statistics.median(json.loads(out.read_text())[a.warmup :]) * 1e3


def overhead(a: argparse.Namespace) -> None:
    """Interleaved runs of both contenders; prints the table."""
    medians: dict[str, list[float]] = {"hsdp": [], "stalwart": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.runs):
            for c in ["hsdp", "stalwart"] if r % 2 == 0 else ["stalwart", "hsdp"]:
                medians[c].append(_timed_run(c, a, Path(tmp)))
                print(f"run {r} {c}: {medians[c][-1]:.2f} ms/step", flush=True)
    print("\n| contender | median step (ms) | range of run medians (ms) |")
    print("|---|---|---|")
    for c, xs in medians.items():
        print(f"| {c} | {statistics.median(xs):.2f} | {min(xs):.2f} to {max(xs):.2f} |")
    ratios = [s / h for s, h in zip(medians["stalwart"], medians["hsdp"], strict=True)]
    print(f"\nstalwart / plain HSDP: median {statistics.median(ratios):.3f} "
          f"(per-pair {min(ratios):.3f} to {max(ratios):.3f}), {a.runs} pairs")  # fmt: skip


# -- chaos cycles -------------------------------------------------------------------------


def schedule(seed: int, cycles: int) -> tuple[list[dict[str, Any]], list[int]]:
    """Kills (as chaos JSON) and hold steps for ``cycles`` cycles; victims follow the groups
    the launcher will have (a dead rank's group is replaced by the next two worker ids)."""
    rng = random.Random(seed)
    live, next_wid = [[0, 1], [2, 3]], 4
    kills, holds = [], []
    for k in range(cycles):
        group = rng.randrange(len(live))
        victim = live[group][rng.randrange(2)]
        where = rng.choice(["collective", "agree", "boundary"])
        delay = rng.uniform(0, 0.003) if where == "collective" else 0.0
        kills.append({"worker": victim, "step": k * PERIOD + rng.randint(2, 4), "where": where,
                      "delay_s": delay})  # fmt: skip
        holds.append(k * PERIOD + 6)
        live.pop(group)
        live.append([next_wid, next_wid + 1])
        next_wid += 2
    return kills, holds


def _chaos_run(seed: int, cycles: int, tmp: Path, follow: bool) -> dict[str, Any]:
    from stalwart.elastic import summarize
    from stalwart.elastic.recovery import digest_divergences, recoveries

    kills, holds = schedule(seed, cycles)
    ev = tmp / f"events-{seed}"
    total = cycles * PERIOD + 4
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "4", "--group-size", "2",
           "--max-restarts", str(cycles), "--timeout", "30", "--events", str(ev),
           str(Path(__file__).resolve()), "--worker", "stalwart", "--total", str(total),
           "--verify-every", "1", *(["--follow"] if follow else [])]  # fmt: skip
    for h in holds:
        cmd += ["--hold-at", str(h)]
    env = _env({"STALWART_CHAOS": json.dumps({"kills": kills})})
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, timeout=120 + 40 * cycles)
    wall = time.monotonic() - t0
    divergent, verified = digest_divergences(ev)
    rec = recoveries(ev)
    deaths = sorted(r.worker for r in rec)
    summary = summarize(ev)
    return {
        "seed": seed, "cycles": cycles, "rc": done.returncode, "wall_s": round(wall, 1),
        "divergent": divergent,
        "verified_steps": verified,
        "deaths_as_scheduled": deaths == sorted(k["worker"] for k in kills),
        "lost_steps": [r.lost_steps for r in rec],
        "resume_s": [round(r.resume_s, 3) for r in rec if r.resume_s is not None],
        "rejoin_s": [round(r.rejoin_s, 2) for r in rec if r.rejoin_s is not None],
        "follows": summary.follows, "heals": summary.heals,
        "tail": "" if done.returncode == 0 else done.stderr.decode()[-1500:],
    }  # fmt: skip


def campaign(a: argparse.Namespace) -> int:
    """Runs the cycles; prints one JSON line per run and the totals; returns divergences."""
    divergent = failed = done_cycles = follows = heals = 0
    resume: list[float] = []
    rejoin: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        seed = a.first_seed
        while done_cycles < a.cycles:
            n = min(a.cycles_per_run, a.cycles - done_cycles)
            r = _chaos_run(seed, n, Path(tmp), a.follow)
            print(json.dumps(r), flush=True)
            divergent += r["divergent"]
            failed += r["rc"] != 0 or not r["deaths_as_scheduled"]
            resume += r["resume_s"]
            rejoin += r["rejoin_s"]
            follows, heals = follows + r["follows"], heals + r["heals"]
            done_cycles += n
            seed += 1
    print(
        f"\n{done_cycles} kill/rejoin cycles: {divergent} divergences (per-shard digests "
        f"at every step and at the end); {failed} runs failed or missed a scheduled death; "
        f"{follows} rank follows promoted, {heals} heals"
    )
    if resume:
        print(f"survivors' next commit after a death: median {statistics.median(resume):.3f} s "
              f"({min(resume):.3f} to {max(resume):.3f}); a new group's rejoin (launch to "
              f"first commit): median {statistics.median(rejoin):.2f} s")  # fmt: skip
    return divergent + failed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=50, help="kill/rejoin cycles (0: none)")
    p.add_argument("--cycles-per-run", type=int, default=10)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=5, help="overhead pairs (0: none)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--worker", choices=["stalwart", "hsdp"])
    p.add_argument("--total", type=int)
    p.add_argument("--out", type=Path)
    p.add_argument("--verify-every", type=int, default=50)
    p.add_argument("--hold-at", type=int, action="append", default=[])
    p.add_argument("--follow", action="store_true", help="Job(follow=True)")
    a = p.parse_args()
    if a.worker == "stalwart":
        worker_stalwart(a)
        return
    if a.worker == "hsdp":
        worker_hsdp(a)
        return
    bad = campaign(a) if a.cycles else 0
    if a.runs:
        overhead(a)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
