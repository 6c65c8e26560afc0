"""A ``stalwart run`` worker for the DiLoCo tests and bench: one generated regression task.

``--mode ddp`` trains with the job's per-step all-reduce (the baseline); ``--mode diloco``
syncs every ``--h`` inner steps; ``--mode async`` uses the buffered asynchronous outer step.
Every (step, rank) draws fresh rows; the held-out loss is measured on a fixed set. A slow
worker comes from the chaos harness (``STALWART_CHAOS`` with a ``Delay``). Writes
``final-{worker}.pt`` with the digest, steps, held-out loss, bytes sent and received, the
training loop's seconds and (``--trace``) the held-out loss at every outer step.

Usage: diloco_worker.py --mode ddp|diloco|async --outer N --h H [--k K --staleness S] --out DIR
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
from stalwart.elastic.async_outer import Buffered
from stalwart.elastic.diloco import DiLoCo, Nesterov
from stalwart.testing import chaos

_W = torch.Generator().manual_seed(7)
TEACHER = (torch.randn(16, 32, generator=_W), torch.randn(32, 1, generator=_W))


def batch(step: int, rank: int, rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh rows for every (step, rank) from a fixed random teacher network."""
    g = torch.Generator().manual_seed(100_003 * rank + step)
    x = torch.randn(rows, 16, generator=g)
    return x, torch.tanh(x @ TEACHER[0]) @ TEACHER[1] / 4


def model_and_inner(lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same initial model on every worker (seeded)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)


def held_out(model: nn.Module) -> float:
    """Mean-squared error on 512 held-out rows."""
    x, y = batch(10**6, 999, rows=512)
    with torch.no_grad():
        return float(F.mse_loss(model(x), y))


def _trace(trace: list[tuple[float, int, float]], t0: float, step: int, model: nn.Module) -> None:
    if not trace or trace[-1][1] != step:
        trace.append((time.perf_counter() - t0, step, held_out(model)))


def run_ddp(a: argparse.Namespace) -> dict[str, object]:
    model, opt = model_and_inner(a.lr)
    job = Job(stalwart.TrainingState(model=model, optimizer=opt, rng=False), verify_every=0)
    chaos.install(job)
    optimizer = job.optimizer(opt)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trace: list[tuple[float, int, float]] = []
    t0 = time.perf_counter()
    while job.step < a.outer * a.h:
        optimizer.zero_grad()
        x, y = batch(job.step, job.rank)
        F.mse_loss(model(x), y).backward()
        time.sleep(a.compute_s)  # modelled compute (the slow worker adds a chaos Delay)
        optimizer.step()
        if a.trace and job.step % a.h == 0:
            _trace(trace, t0, job.step // a.h, model)
    loop_s = time.perf_counter() - t0
    job.close()
    return {"digest": job.digest(), "steps": job.step, "loss": held_out(model),
            "bytes": params * job.step, "loop_s": loop_s, "trace": trace}  # fmt: skip


def run_diloco(a: argparse.Namespace) -> dict[str, object]:
    model, inner = model_and_inner(a.lr)
    mode = None
    if a.mode == "async":
        mode = Buffered(k=a.k, staleness=a.staleness, compute_aware=not a.fixed_h)
    outer = Nesterov(lr=a.outer_lr, momentum=a.outer_momentum)
    diloco = DiLoCo(model, inner, h=a.h, outer=outer, mode=mode, verify_every=0)
    chaos.install(diloco)
    trace: list[tuple[float, int, float]] = []
    t0 = time.perf_counter()
    while diloco.outer_step < a.outer:
        inner.zero_grad()
        x, y = batch(
            diloco.inner_steps, diloco.rank if mode is None else diloco.job.members[diloco.rank]
        )
        F.mse_loss(model(x), y).backward()
        time.sleep(a.compute_s)
        diloco.step()
        if a.trace:
            _trace(trace, t0, diloco.outer_step, diloco.global_model)
    loop_s = time.perf_counter() - t0
    diloco.close(a.outer)
    return {"digest": diloco.job.digest(), "steps": diloco.outer_step, "inner": diloco.inner_steps,
            "loss": held_out(diloco.global_model), "bytes": diloco.bytes_sent,
            "received": diloco.bytes_received, "loop_s": loop_s, "trace": trace}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ddp", "diloco", "async"), required=True)
    parser.add_argument("--outer", type=int, required=True)
    parser.add_argument("--h", type=int, default=10)
    parser.add_argument("--k", type=int, default=None)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--fixed-h", action="store_true", help="async: no compute-aware H")
    parser.add_argument("--compute-s", type=float, default=0.0, help="modelled s per step")
    parser.add_argument("--trace", action="store_true", help="held-out loss per outer step")
    parser.add_argument("--out", type=Path, required=True)
    a = parser.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    result = run_ddp(a) if a.mode == "ddp" else run_diloco(a)
    result["wall_s"] = time.perf_counter() - t0
    worker = os.environ.get("STALWART_ELASTIC_WORKER", "0")
    a.out.mkdir(parents=True, exist_ok=True)
    torch.save(result, a.out / f"final-{worker}.pt")


if __name__ == "__main__":
    main()
