"""Adasum against averaging: how much does the final loss move when the world size changes?

The claim (issue 11, docs/elastic.md "Adasum"): with the learning rate tuned at 2 workers only,
Adasum's final loss varies less across 2, 3 and 4 workers than averaging's does.

Set-up, the same for both contenders: a teacher MLP (32→64→10, fixed seed) labels Gaussian
inputs; a student MLP (32→64→10) trains by plain SGD with cross-entropy. Every worker takes
``--batch`` fresh rows per step and the run sees ``--samples`` rows in total, so n workers take
``samples / (n · batch)`` steps (an epoch budget, the elastic case: a bigger world finishes the
same data in fewer steps). The loss is measured on 4096 held-out rows.

* Contenders: ``mean`` (averaging, the same learning rate at every size), ``mean-scaled``
  (averaging with the linear scaling rule, lr · n/2, the usual fix), ``adasum``.
* The learning rate of each contender is tuned at size 2 on the *tuning* seed (its own data,
  teacher and initialisation) over ``--lrs``, by the final held-out loss.
* Then both run at sizes 2, 3, 4 on each *report* seed (different data, teacher, init) with
  their tuned rates; the spread is max - min of the final loss over the three sizes.

The n workers are simulated in one process: each worker's gradient is computed on its rows,
and the step uses their mean (averaging) or ``stalwart.elastic.reduce.adasum_reference`` (the
same binomial tree, the same bytes, as the gloo reduction; tests/distributed/test_adasum.py
checks that on 2-5 ranks). So the numbers are about numerics, not wall time.

    .venv/bin/python bench/adasum_bench.py               # tune on seed 0, report seeds 1-5
    .venv/bin/python bench/adasum_bench.py --report-seeds 1 2 3 4 5 6 7 8 9 10
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.elastic.reduce import adasum_reference

SIZES = (2, 3, 4)
D_IN, HIDDEN, CLASSES = 32, 64, 10


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))


class Task:
    """A seeded teacher and a seeded stream of rows; every seed is a different problem."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        torch.manual_seed(10_000 + seed)
        self.teacher = _mlp()
        for p in self.teacher.parameters():
            p.data.mul_(3.0)  # sharper classes than a default-initialised net gives
        self.test = self.rows(4096, torch.Generator().manual_seed(20_000 + seed))

    @torch.no_grad()
    def rows(self, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, D_IN, generator=g)
        return x, self.teacher(x).argmax(dim=1)


def train(task: Task, size: int, reduce: str, lr: float, samples: int, batch: int) -> float:
    """Final held-out loss of one run with ``size`` simulated workers."""
    torch.manual_seed(30_000 + task.seed)
    model = _mlp()
    params = list(model.parameters())
    data = torch.Generator().manual_seed(40_000 + task.seed)
    for _ in range(samples // (size * batch)):
        grads = []
        for _worker in range(size):
            x, y = task.rows(batch, data)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in params])
        if reduce == "adasum":
            combined = adasum_reference(grads)
        else:
            combined = [torch.stack(gs).mean(dim=0) for gs in zip(*grads, strict=True)]
        step_lr = lr * size / 2 if reduce == "mean-scaled" else lr  # linear scaling from 2
        with torch.no_grad():
            for p, g in zip(params, combined, strict=True):
                p.sub_(step_lr * g)
    with torch.no_grad():
        loss = float(F.cross_entropy(model(task.test[0]), task.test[1]))
    return loss if loss == loss else float("inf")  # NaN (diverged) sorts last


def tune(reduce: str, lrs: Sequence[float], samples: int, batch: int, seed: int) -> float:
    """The learning rate with the lowest final loss at size 2 on the tuning seed."""
    task = Task(seed)
    losses = {lr: train(task, 2, reduce, lr, samples, batch) for lr in lrs}
    print(f"  tune {reduce:6s} at size 2, seed {seed}: "
          + ", ".join(f"{lr:g}→{v:.3f}" for lr, v in losses.items()))  # fmt: skip
    return min(losses, key=losses.__getitem__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=9600, help="rows per run, all workers")
    parser.add_argument("--batch", type=int, default=16, help="rows per worker per step")
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.5, 1.0, 2.0])
    parser.add_argument("--tune-seed", type=int, default=0)
    parser.add_argument("--report-seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    a = parser.parse_args()
    torch.set_num_threads(1)
    if a.tune_seed in a.report_seeds:
        parser.error("the tuning seed must not be a report seed (hold out)")
    methods = ("mean", "mean-scaled", "adasum")
    lr = {m: tune(m, a.lrs, a.samples, a.batch, a.tune_seed) for m in ("mean", "adasum")}
    lr["mean-scaled"] = lr["mean"]  # at size 2 it is the same run as "mean"
    finals: dict[str, dict[int, list[float]]] = {m: {n: [] for n in SIZES} for m in methods}
    spreads: dict[str, list[float]] = {m: [] for m in methods}
    for seed in a.report_seeds:
        task = Task(seed)
        for m in methods:  # interleaved per seed: both contenders see the same problem
            row = [train(task, n, m, lr[m], a.samples, a.batch) for n in SIZES]
            for n, v in zip(SIZES, row, strict=True):
                finals[m][n].append(v)
            spreads[m].append(max(row) - min(row))
            print(f"  seed {seed} {m:11s} lr {lr[m]:g}: " + "  ".join(f"{v:.4f}" for v in row))
    print(f"\n{a.samples} rows per run, {a.batch} rows per worker per step, "
          f"lr tuned at size 2 on seed {a.tune_seed}, report seeds {a.report_seeds}\n")  # fmt: skip
    print("| reduction | lr (tuned at 2) | loss @2 | loss @3 | loss @4 | spread (max-min) |")
    print("|---|---|---|---|---|---|")
    for m in methods:
        cells = [_med_range(finals[m][n]) for n in SIZES]
        print(f"| {m} | {lr[m]:g} | " + " | ".join(cells) + f" | {_med_range(spreads[m])} |")
    for peer in ("mean", "mean-scaled"):
        ratios = [s_a / s_m for s_a, s_m in zip(spreads["adasum"], spreads[peer], strict=True)
                  if s_m > 0]  # fmt: skip
        if ratios:
            med, lo, hi = statistics.median(ratios), min(ratios), max(ratios)
            print(f"spread ratio adasum / {peer}, per seed: median {med:.2f} "
                  f"(range {lo:.2f} to {hi:.2f})")  # fmt: skip


def _med_range(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.4f} [{min(values):.4f}, {max(values):.4f}]"


if __name__ == "__main__":
    main()
