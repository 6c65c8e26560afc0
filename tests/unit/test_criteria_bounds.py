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
