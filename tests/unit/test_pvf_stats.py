"""Intervals, the Leveugle planner and stratified recombination against known values."""

from __future__ import annotations

import pytest

from stalwart.errors import ConfigError
from stalwart.vulnerability.stats import clopper_pearson, mcnemar, sample_size, stratified, wilson


def test_leveugle_table_from_the_research_notes() -> None:
    n = 18_346 * 32
    assert sample_size(n, 0.05) == 384
    assert sample_size(n, 0.01) == 9450
    assert sample_size(n, 0.005) in (36056, 36057)  # the notes rounded t to 1.96
    assert sample_size(None, 0.001, p=0.01) == 38031  # a small prior cuts n ~25x
    assert sample_size(10, 0.01) <= 10


def test_intervals() -> None:
    lo, hi = wilson(80, 120)
    assert (round(lo, 3), round(hi, 3)) == (0.578, 0.745)
    assert wilson(0, 100)[0] == 0.0 and 0.03 < wilson(0, 100)[1] < 0.04
    lo, hi = clopper_pearson(0, 100)
    assert lo == 0.0 and hi == pytest.approx(0.0362, abs=1e-4)  # ~ rule of three
    lo, hi = clopper_pearson(5, 10)
    assert lo == pytest.approx(0.187, abs=1e-3) and hi == pytest.approx(0.813, abs=1e-3)
    assert wilson(0, 0) == (0.0, 1.0)
    with pytest.raises(ConfigError):
        wilson(5, 3)


def test_stratified_weights_by_population_not_trials() -> None:
    # stratum A: 10 % of sites, always fails; stratum B: 90 %, never fails
    p, lo, hi = stratified([100, 0], [100, 1000], [10, 90])
    assert p == pytest.approx(0.1) and lo < 0.1 < hi
    assert stratified([5], [10], [1])[0] == 0.5


def test_mcnemar_paired() -> None:
    fixed, broken, pval = mcnemar(
        [True] * 20 + [False] * 80, [False] * 18 + [True] * 2 + [False] * 80
    )
    assert (fixed, broken) == (18, 0) and pval < 1e-4
