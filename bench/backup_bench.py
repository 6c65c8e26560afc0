"""Backup workers against synchronous steps, one of 3 workers slowed 2x: time to a target loss.

Contenders (same script, same seed, ``stalwart run --nproc 3`` with gloo on CPU):

* ``sync``: ``backup=0``, the gloo all-reduce (every step waits for the slow worker);
* ``b=1``, ``b=2``: static backup workers (commit with the first 2, or 1, contributions);
* ``dynamic``: ``backup=Dynamic()`` (k chosen online from the members' compute times);
* ``...+poll``: the same, the loop going through ``optimizer.accumulate`` (it polls
  ``too_late`` between micro-batches): a member whose step already has its k contributions
  abandons the rest and joins the next step in phase;
* ``...+partial``: ``Static(b, partial=True)`` / ``Dynamic(partial=True)`` and the same loop: a
  member still computing when the k-th contribution arrives stops at its next micro-batch and
  sends the share it computed (DropCompute's rule), weighted by that share.

Compute is *modelled*: a step is ``--micro`` micro-batches (gradient accumulation over the
worker's 16 rows), each followed by a sleep of ``--base-s / --micro`` (worker 2 sleeps twice
that; ``--slow random``: a different member each step), so the 2-core box's noise does not
decide who is late. This is how a user's gradient-accumulation loop uses the check::

    for x, y in optimizer.accumulate(micro_batches):  # stops early when too late
        (loss_fn(model(x), y) / len(micro_batches)).backward()
    optimizer.step()
 Every worker draws fresh rows each step
(``seed(step, rank)``), so dropping late contributions keeps the gradient unbiased. Worker 0
evaluates the held-out loss every 5 steps; the time to target is the wall time (from its first
step) of the first evaluation at or under ``--target``. Runs alternate between contenders; the
table gives medians and ranges over ``--runs`` runs.

    .venv/bin/python bench/backup_bench.py --runs 3
    .venv/bin/python bench/backup_bench.py --runs 3 --slow random
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CONTENDERS = {"sync": "0", "b=1": "1", "b=2": "2", "dynamic": "dynamic",
              "b=1+poll": "1", "b=2+poll": "2", "dynamic+poll": "dynamic",
              "b=1+partial": "1", "dynamic+partial": "dynamic"}  # fmt: skip


def _rows(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    w = torch.Generator().manual_seed(7)
    teacher = torch.randn(32, 10, generator=w)
    return x, (x @ teacher).argmax(dim=1)


def worker(a: argparse.Namespace) -> None:
    """One member: train, sleep the modelled compute time, log the held-out loss."""
    import stalwart
    from stalwart.elastic import Job
    from stalwart.elastic.backup import Dynamic, Static

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    job = Job(stalwart.TrainingState(model=model, optimizer=opt), verify_every=0)
    part = a.poll == "partial"
    backup = Dynamic(partial=part) if a.backup == "dynamic" else Static(int(a.backup), part)
    optimizer = job.optimizer(opt, backup=backup)
    wid = int(os.environ.get("STALWART_ELASTIC_WORKER", "0"))
    test = _rows(-1, 2048)
    t0, log = time.time(), []
    while job.step < a.steps:
        optimizer.zero_grad()
        x, y = _rows(1_000_000 + 1000 * job.step + job.rank, 16)
        slow = wid == 2 if a.slow == "fixed" else (job.step * 7919) % job.size == job.rank
        micro = list(zip(x.chunk(a.micro), y.chunk(a.micro), strict=True))
        for xs, ys in optimizer.accumulate(micro) if a.poll else micro:
            (F.cross_entropy(model(xs), ys) / a.micro).backward()
            time.sleep(a.base_s * (2 if slow else 1) / a.micro)
        optimizer.step()
        if wid == 0 and job.step % 5 == 0:
            with torch.no_grad():
                loss = float(F.cross_entropy(model(test[0]), test[1]))
            log.append((time.time() - t0, job.step, loss))
    job.close()
    if wid == 0:
        Path(a.log).write_text(json.dumps(log))


def run_once(name: str, a: argparse.Namespace, tmp: Path) -> list[tuple[float, int, float]]:
    log = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "3", "--max-restarts", "0",
           "--events", str(tmp / f"ev-{name}"), "--timeout", "60", __file__, "--worker",
           "--backup", CONTENDERS[name], "--steps", str(a.steps), "--base-s", str(a.base_s),
           "--slow", a.slow, "--micro", str(a.micro), "--log", str(log),
           *(["--poll", name.split("+")[1]] if "+" in name else [])]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("STALWART_ELASTIC_STORE", None)
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=600)
    return [tuple(r) for r in json.loads(log.read_text())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backup", default="0", help=argparse.SUPPRESS)
    parser.add_argument("--log", default="", help=argparse.SUPPRESS)
    parser.add_argument("--poll", default="", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--base-s", type=float, default=0.04)
    parser.add_argument("--target", type=float, default=0.6)
    parser.add_argument("--slow", choices=["fixed", "random"], default="fixed",
                        help="worker 2 always slow, or a different member each step")  # fmt: skip
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help="comma-separated subset of " + ", ".join(CONTENDERS))  # fmt: skip
    a = parser.parse_args()
    if a.worker:
        worker(a)
        return
    names = a.contenders.split(",")
    to_target: dict[str, list[float]] = {n: [] for n in names}
    total: dict[str, list[float]] = {n: [] for n in names}
    final: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.runs):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order
                log = run_once(name, a, Path(d) / f"run{r}")
                hit = [t for t, _, loss in log if loss <= a.target]
                to_target[name].append(hit[0] if hit else float("inf"))
                total[name].append(log[-1][0])
                final[name].append(log[-1][2])
                t_hit, t_all, end = to_target[name][-1], total[name][-1], final[name][-1]
                print(f"  run {r} {name:8s} to target {t_hit:.2f} s, {a.steps} steps "
                      f"{t_all:.2f} s, final loss {end:.3f}")  # fmt: skip
    who = "worker 2" if a.slow == "fixed" else "one member per step (pseudo-random)"
    print(f"\n3 workers, {who} slowed 2x (modelled compute {a.base_s} s / {2 * a.base_s} s "
          f"per step, {a.micro} micro-batches), target {a.target}, {a.runs} runs\n")  # fmt: skip
    print(f"| contender | time to target (s) | {a.steps} steps (s) | ms / step | final loss "
          "| speed-up to target vs sync | per step vs sync |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    sync = statistics.median(to_target.get("sync", [math.nan]))
    sync_all = statistics.median(total.get("sync", [math.nan]))
    for n in names:
        med, per = statistics.median(to_target[n]), statistics.median(total[n])
        print(f"| {n} | {_mr(to_target[n])} | {_mr(total[n])} | {1e3 * per / a.steps:.1f} | "
              f"{_mr(final[n], 3)} | {sync / med:.2f}x | {sync_all / per:.2f}x |")  # fmt: skip


def _mr(v: list[float], digits: int = 2) -> str:
    return f"{statistics.median(v):.{digits}f} [{min(v):.{digits}f}, {max(v):.{digits}f}]"


if __name__ == "__main__":
    main()
