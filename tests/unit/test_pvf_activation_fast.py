"""Campaigns on activation faults run on the fast engine and judge every trial as the naive
hook loop does: independent samples, dependent samples (a graph), an untraceable model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stalwart import inject, models, vulnerability
from stalwart.vulnerability import sample_activation_faults


def _same(a: vulnerability.CampaignResult, b: vulnerability.CampaignResult) -> None:
    assert a.criteria == b.criteria
    for c in a.criteria:
        assert np.array_equal(a.failed[c], b.failed[c]), c
        assert np.array_equal(a.rate[c], b.rate[c], equal_nan=True), c
    assert np.array_equal(a.nonfinite, b.nonfinite)


class Graph(nn.Module):
    def __init__(self, n: int = 30) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        adj = (torch.rand(n, n, generator=g) < 0.1).float() + torch.eye(n)
        self.register_buffer("adj", adj / adj.sum(1, keepdim=True))
        self.lin1, self.lin2 = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adj @ self.lin2(F.relu(self.adj @ self.lin1(x)))


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if h.dim() == 2:  # control flow on a traced value: torch.fx cannot trace it
            h = F.relu(h)
        return self.fc2(h)


def test_activation_campaign_equals_naive_trial_for_trial() -> None:
    digits = models.load("digits-cnn")
    model, x = digits.model, digits.inputs[0][:40]
    faults = sample_activation_faults(model, (x,), 120, seed=1)
    faults.faults += sample_activation_faults(
        model, (x,), 40, seed=2, error=inject.BitFlip(bit=30)
    ).faults
    crit = ["top1", "top5", "dev>0.05"]
    fast = vulnerability.run_campaign(model, x, faults, crit)
    slow = vulnerability.run_campaign(model, x, faults, crit, engine="naive")
    assert fast.manifest["engine"] == "fast" and slow.manifest["engine"] == "naive"
    _same(fast, slow)
    assert 0 < fast.failed["top1"].sum() < len(faults)


@pytest.mark.parametrize("make", [Graph, Untraceable], ids=["graph", "untraceable"])
def test_activation_campaign_dependent_and_eager(make: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = make().eval()
    x = torch.randn(30, 6) if make is Graph else torch.randn(12, 8)
    independent = make is not Graph
    faults = sample_activation_faults(model, (x,), 60, seed=3, error=inject.BitFlip(bit=30))
    kw = {"independent_samples": independent}
    crit = ["top1", "dev>0.1"]
    fast = vulnerability.run_campaign(model, x, faults, crit, **kw)
    slow = vulnerability.run_campaign(model, x, faults, crit, engine="naive", **kw)
    assert fast.manifest["engine"] == "fast"
    _same(fast, slow)
    assert fast.failed["top1"].any()
