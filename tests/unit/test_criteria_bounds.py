"""Criteria refuse settings under which every trial would fail (top0, a negative threshold)."""

from __future__ import annotations

import math

import pytest

from stalwart.errors import ConfigError
from stalwart.vulnerability.criteria import Deviation, TopK, criterion


@pytest.mark.parametrize("spec", ["top0", "dev>-1", "ctr>-0.5", "acc-drop>-0.1", "dev>nan"])
def test_settings_that_fail_every_trial_are_refused(spec: str) -> None:
    with pytest.raises(ConfigError, match=r"k >= 1|number >= 0"):
        criterion(spec)


def test_the_classes_refuse_them_too() -> None:
    with pytest.raises(ConfigError, match="k >= 1"):
        TopK(0)
    with pytest.raises(ConfigError, match="number >= 0"):
        Deviation(-0.1)
    with pytest.raises(ConfigError, match="number >= 0"):
        Deviation(math.inf)


@pytest.mark.parametrize("spec", ["top1", "top5", "dev>0", "dev>0.05", "ctr>0.01", "decision"])
def test_valid_settings_still_build(spec: str) -> None:
    assert criterion(spec).name


def test_float64_outputs_past_float32s_range_are_finite_with_finite_margins() -> None:
    # A float64 output near 1e300 is finite: cast to float32 it became Inf (a failure by
    # accuracy) and the top-1/top-k margins Inf - Inf = NaN.
    import torch

    from stalwart.vulnerability.criteria import AccuracyDrop, Top1

    golden = torch.tensor([[1e300, 1.0, 0.0], [0.0, 2e300, 1.0]], dtype=torch.float64)
    faulty = golden[None].clone()  # one trial, (K, B, C)
    acc = AccuracyDrop(labels=torch.tensor([0, 1]))
    assert float(acc.change(golden, faulty)) == 0.0
    for crit in (Top1(), TopK(2)):
        margin = crit.margin(golden, faulty)
        assert torch.isfinite(margin).all() and (margin > 0).all(), (crit.name, margin)
