"""DiLoCo over an elastic job: sync every H inner steps, or asynchronously with a buffer.

    stalwart run --nproc 3 examples/diloco.py                 # synchronous DiLoCo
    stalwart run --nproc 3 examples/diloco.py --async-k 2     # outer step once 2 of 3 reported
    python examples/diloco.py                                 # one process (world of one)

Each worker trains its own copy with AdamW for ``--h`` steps, then the members average their
pseudo-gradients (global - local) and Nesterov SGD steps the global model. Kill a worker
(``kill -9``) while it runs: the others retry the outer step without it and a replacement
joins at the next outer step.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.elastic import Buffered, DiLoCo, Nesterov


def batch(step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh rows for every (step, worker): y = sin(x·w) for a fixed w."""
    g = torch.Generator().manual_seed(100_003 * worker + step)
    x = torch.randn(32, 16, generator=g)
    return x, torch.sin(x @ torch.linspace(-1, 1, 16)).unsqueeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--outer", type=int, default=20, help="outer steps")
    parser.add_argument("--h", type=int, default=50, help="inner steps per outer step")
    parser.add_argument("--async-k", type=int, default=0, help="buffered async with this k")
    a = parser.parse_args()
    torch.manual_seed(0)  # every worker starts from the same model
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # k below the members takes the delayed Nesterov rule (momentum once per round of
    # contributions, stale phases restated against the newest version): momentum 0.9 is safe
    mode = Buffered(k=a.async_k, staleness=2) if a.async_k else None
    diloco = DiLoCo(model, inner, h=a.h, outer=Nesterov(), mode=mode)  # lr 0.7, momentum 0.9
    worker = diloco.job.members[diloco.rank]
    while diloco.outer_step < a.outer:
        inner.zero_grad()
        x, y = batch(diloco.inner_steps, worker)
        F.mse_loss(model(x), y).backward()
        diloco.step()  # an inner step; every h-th (or the assigned H) also the outer step
    diloco.close(a.outer)  # every member ends on the same global model
    x, y = batch(10**6, 10**6)
    with torch.no_grad():
        loss = float(F.mse_loss(diloco.global_model(x), y))
    msg = (f"worker {worker}: {diloco.outer_step} outer steps, {diloco.inner_steps} inner "
           f"steps, held-out loss {loss:.4f}, sent {diloco.bytes_sent / 1e3:.1f} kB")  # fmt: skip
    print(msg)  # noqa: T201  # an example script reports on the console


if __name__ == "__main__":
    main()
