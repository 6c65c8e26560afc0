"""Rank bodies for the CheckFree tests (and the pipeline the bench runs in one process).

A 4-stage pipeline of identical residual blocks (``h + tanh(W h + b)``, width 32), an input
projection on the first stage and a head on the last, one stage per gloo rank: activations go
forward with ``send``/``recv``, their gradients come back the same way, every stage steps its own
Adam. At ``fail_at`` the worker of stage ``lost`` is replaced by a fresh process with
nothing saved: its block is re-initialised and its optimizer state is empty; then, by mode,

* ``checkfree``: the block is rebuilt from its neighbours (gradient-norm weights);
* ``scratch``: it trains on from the fresh initialisation;
* ``none``: nothing fails (the reference).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from stalwart.elastic.checkfree import fresh_optimizer, plan_sources, recover_over_gloo

WIDTH, STAGES = 32, 4
_T = torch.Generator().manual_seed(11)
TEACHER = [torch.randn(WIDTH, WIDTH, generator=_T) / WIDTH**0.5 for _ in range(3)]


class Stage(nn.Module):
    """One pipeline stage: [input projection] -> residual block -> [head]."""

    def __init__(self, index: int, stages: int = STAGES) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH) if index == 0 else None
        self.block = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1) if index == stages - 1 else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            h = self.inp(h)
        h = h + torch.tanh(self.block(h))  # residual, as in the transformers CheckFree targets
        return self.head(h) if self.head is not None else h


def build(seed: int = 0, stages: int = STAGES) -> list[Stage]:
    """Every stage, the same on every rank."""
    torch.manual_seed(seed)
    return [Stage(i, stages) for i in range(stages)]


def batch(step: int, rows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a fixed teacher network, fresh for every step."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(rows, 8, generator=g)
    h = x @ torch.ones(8, WIDTH) / 8**0.5
    for w in TEACHER:
        h = torch.tanh(h @ w)
    return x, h.sum(dim=1, keepdim=True) / 4


def grad_norm(module: nn.Module) -> float:
    """L2 norm of the module's gradients."""
    sq = sum(float(p.grad.pow(2).sum()) for p in module.parameters() if p.grad is not None)
    return sq**0.5


def _step(rank: int, world: int, stage: Stage, opt: torch.optim.Optimizer, step: int) -> float:
    x, y = batch(step)
    opt.zero_grad()
    if rank == 0:
        h_in = x
    else:
        h_in = torch.empty(x.shape[0], WIDTH)
        dist.recv(h_in, rank - 1)
        h_in.requires_grad_(True)
    out = stage(h_in)
    loss = torch.zeros(())
    if rank < world - 1:
        dist.send(out.detach(), rank + 1)
        g = torch.empty_like(out)
        dist.recv(g, rank + 1)
        out.backward(g)
    else:
        loss = F.mse_loss(out, y)
        loss.backward()
    if rank > 0:
        dist.send(h_in.grad, rank - 1)
    opt.step()
    return float(loss.detach())


def pipeline_body(rank: int, world: int, mode: str, steps: int, fail_at: int, lost: int) -> Any:
    """Train the pipeline over gloo; stage ``lost`` fails at ``fail_at`` (see the module)."""
    stage = build()[rank]
    opt = torch.optim.Adam(stage.parameters(), lr=3e-3)
    losses, record, norm = [], None, 0.0
    for step in range(steps):
        if step == fail_at and mode != "none":
            if rank == lost:  # the replacement: fresh weights, empty optimizer state
                torch.manual_seed(1000 + step)
                stage = Stage(rank, world)
                opt = fresh_optimizer(torch.optim.Adam(stage.parameters(), lr=3e-3))
            if mode == "checkfree":
                _, sources = plan_sources(lost, world)
                record = recover_over_gloo(stage, lost_rank=lost, sources=sources,
                                           grad_norm=norm, stage=lost)  # fmt: skip
        losses.append(_step(rank, world, stage, opt, step))
        norm = grad_norm(stage)
    return {"losses": losses, "record": record}


def reference_losses(steps: int) -> list[float]:
    """The same pipeline without failures, in one process (the gloo run's reference)."""
    stages = build()
    opts = [torch.optim.Adam(s.parameters(), lr=3e-3) for s in stages]
    losses = []
    for step in range(steps):
        x, y = batch(step)
        for o in opts:
            o.zero_grad()
        h = x
        for s in stages:
            h = s(h)
        loss = F.mse_loss(h, y)
        loss.backward()
        for o in opts:
            o.step()
        losses.append(float(loss.detach()))
    return losses


def replica_body(rank: int, world: int) -> str:
    """Two data-parallel replicas of one stage; rank 1 loses it and copies rank 0's, exactly."""
    stage = build()[1]
    opt = torch.optim.Adam(stage.parameters(), lr=3e-3)
    for step in range(5):
        opt.zero_grad()
        x, _ = batch(step + 100 * rank)
        stage(x @ torch.ones(8, WIDTH)).pow(2).mean().backward()
        for p in stage.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
    if rank == 1:
        torch.manual_seed(99)
        stage = Stage(1)
    record = recover_over_gloo(stage, lost_rank=1, sources=[0], replica=True, stage=1)
    assert record.exact and record.path == "replica"
    raw = b"".join(t.numpy().tobytes() for t in stage.state_dict().values())
    return hashlib.sha256(raw).hexdigest()
