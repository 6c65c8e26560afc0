"""Model factories for the sharded-campaign tests: module-level, so spawned workers and Ray
actors can import them by reference, and seeded, so every worker builds the same weights."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stalwart.vulnerability import FaultList, sample_activation_faults, sample_faults


def tiny() -> tuple[nn.Module, torch.Tensor]:
    """A 2-layer MLP on 24 inputs of 12 features (10 classes); the same in every process."""
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 10))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval(), torch.randn(24, 12, generator=g)


def mixed_faults(n: int = 240, seed: int = 0, make: Any = tiny) -> FaultList:
    """Weight faults on every tensor followed by activation faults (on the ReLU's output):
    both engine paths. ``make`` is the factory whose model names the targets."""
    model, x = make()
    w = sample_faults(model, n, seed=seed)
    a = sample_activation_faults(model, (x,), n // 4, modules="*1", seed=seed + 1)
    return FaultList(w.faults + a.faults, w.seed, w.error, w.population | a.population)


class _Suicidal(nn.Module):
    """Wraps a model; SIGKILLs its own process at the n-th forward, once (then ``marker``
    exists), on gloo rank ``rank``, or with ``rank=-1`` in any process without a gloo world
    (a Ray actor: build the test's own reference only once ``marker`` exists)."""

    def __init__(self, inner: nn.Module, rank: int, after: int, marker: str) -> None:
        super().__init__()
        self.inner, self.rank, self.after, self.marker, self.calls = inner, rank, after, marker, 0

    def forward(self, x: torch.Tensor) -> Any:
        self.calls += 1
        dist = torch.distributed
        me = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1
        if me == self.rank and self.calls == self.after and not Path(self.marker).exists():
            Path(self.marker).touch()  # die once: the resumed run must get through
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner(x)


def dies_on_rank(rank: int, after: int, marker: str) -> tuple[nn.Module, torch.Tensor]:
    """``tiny`` whose worker ``rank`` is SIGKILLed at its ``after``-th forward pass (once)."""
    model, x = tiny()
    return _Suicidal(model, rank, after, marker).eval(), x
