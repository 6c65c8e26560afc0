"""PVF estimates and campaigns: each layer's population (digit-named layers included, and its
tensors that drew no fault), and the fast engine's re-run threshold at the output dtype's
precision."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from stalwart import vulnerability


def test_layer_groups_with_digit_names_get_their_own_populations() -> None:
    # nn.Sequential names its layers "0", "2": digits, but not bit positions
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4)).eval()
    res = vulnerability.run_campaign(
        model, torch.randn(12, 8), vulnerability.sample_faults(model, 400, seed=0), "dev>0.05"
    )
    by_layer = vulnerability.estimate(res, "layer")
    pops = by_layer.table.column("population").to_pylist()
    assert pops == [(8 * 64 + 64) * 32, (64 * 4 + 4) * 32]  # weight and bias, 32 bits each


def test_bit_groups_still_split_populations_by_bit() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    res = vulnerability.run_campaign(
        model, torch.randn(6, 8), vulnerability.sample_faults(model, 300, seed=1), "top1"
    )
    pops = set(vulnerability.estimate(res, "bit").table.column("population").to_pylist())
    assert pops == {8 * 16 + 16 + 16 * 4 + 4}  # every fp32 element has each bit once


class _Net(nn.Module):
    """A small bf16 CNN on which a fixed 1e-5 tolerance let fast != naive."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(4 * 4 * 4, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn(self.conv(x))))
        return self.out(torch.sigmoid(self.fc(x.flatten(1))))


def test_fast_engine_matches_naive_trial_for_trial_on_bf16() -> None:
    torch.manual_seed(2)
    model = _Net().to(torch.bfloat16).eval()
    x = torch.randn(10, 1, 8, 8).to(torch.bfloat16)
    faults = vulnerability.sample_faults(model, 300, seed=1)
    crit = ["top1", "dev>0.05"]
    fast = vulnerability.run_campaign(model, x, faults, crit, engine="fast")
    naive = vulnerability.run_campaign(model, x, faults, crit, engine="naive")
    assert fast.manifest["engine"] == "fast"
    for c in crit:
        assert np.array_equal(fast.failed[c], naive.failed[c]), c
        assert np.array_equal(fast.rate[c], naive.rate[c], equal_nan=True), c


def test_float32_keeps_the_given_tolerance() -> None:
    from stalwart.vulnerability.campaign import _noise_floor

    assert _noise_floor(torch.zeros(1), 1e-5) == 1e-5
    assert _noise_floor(torch.zeros(1, dtype=torch.int64), 1e-5) == 1e-5
    assert _noise_floor(torch.zeros(1, dtype=torch.float16), 1e-5) == 64 * 2**-10
    assert _noise_floor(torch.zeros(1, dtype=torch.bfloat16), 1e-5) == 64 * 2**-7


def test_a_layer_counts_its_tensors_that_drew_no_fault() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4)).eval()
    faults = vulnerability.sample_faults(model, 20, seed=0)
    assert "2.bias" not in {f.target for f in faults}  # 128 of 19,200 sites: not drawn here
    res = vulnerability.run_campaign(model, torch.randn(12, 8), faults, "top1")
    table = vulnerability.estimate(res, "layer").table
    groups, pops = table.column("group").to_pylist(), table.column("population").to_pylist()
    pops = dict(zip(groups, pops, strict=True))
    assert pops == {"0": (8 * 64 + 64) * 32, "2": (64 * 4 + 4) * 32}
