"""The closed forms against their own definitions and against published numbers."""

from __future__ import annotations

import math

import pytest

from stalwart.errors import ConfigError
from stalwart.plan import Fleet, PlanInputs, exact_ettr, optimal_interval, young_interval
from stalwart.plan.analytic import daly_interval, meta_mttf_hours
from stalwart.plan.ladder import rates_per_s
from stalwart.plan.sources import LLAMA3_GPUS, LLAMA3_HOURS, LLAMA3_INTERRUPTIONS


@pytest.mark.parametrize("a", [1e-2, 1e-4, 1e-6, 1e-8])
def test_the_exact_optimum_tends_to_young_as_saves_get_cheap(a: float) -> None:
    """tau* = sqrt(2 delta M) (1 + O(sqrt(lambda delta))): Young's limit."""
    mttf = 3600.0
    ratio = optimal_interval(a * mttf, 1 / mttf) / young_interval(a * mttf, mttf)
    assert abs(ratio - 1) <= math.sqrt(a)


def test_the_optimum_maximises_the_exact_ettr_whatever_the_recovery_time() -> None:
    save, rate = 30.0, 1 / 7200
    best = optimal_interval(save, rate)
    for recovery in (0.0, 60.0, 3600.0):
        at = exact_ettr(best, save, [(rate, recovery)])
        for step in (0.99, 1.01, 0.9, 1.1):
            assert exact_ettr(best * step, save, [(rate, recovery)]) < at


def test_the_optimum_is_lambert_w() -> None:
    """tau* = (1 + W0(-e^(-1 - lambda delta))) / lambda (module docstring)."""
    special = pytest.importorskip("scipy.special")
    for save, rate in ((5.0, 1 / 1440), (60.0, 1 / 3600), (500.0, 1 / 600)):
        w = special.lambertw(-math.exp(-1 - rate * save)).real
        assert optimal_interval(save, rate) == pytest.approx((1 + w) / rate, rel=1e-9)


def test_daly_reproduces_his_published_optima() -> None:
    """Daly (2006), Figs. 3-5: delta = 5 min, R = 10 min; M = 24 h, 6 h, 15 min give
    tau_opt = 117, 57 and 9.1 min."""
    assert round(daly_interval(5, 24 * 60)) == 117
    assert round(daly_interval(5, 6 * 60)) == 57
    assert round(daly_interval(5, 15), 1) == 9.1
    # and Daly's estimate is within half a percent of the exact optimum there
    for mttf in (24 * 60, 6 * 60, 15):
        exact = optimal_interval(5, 1 / mttf)
        assert daly_interval(5, mttf) == pytest.approx(exact, rel=5e-3)


def test_exact_ettr_without_failures_is_the_save_overhead() -> None:
    assert exact_ettr(100.0, 5.0, [(0.0, 60.0)]) == pytest.approx(100 / 105)
    assert exact_ettr(100.0, 0.0, []) == 1.0


def test_meta_fitted_mttf_reproduces_their_projections() -> None:
    """Kokolis et al.: MTTF = 1 / (N_nodes r_f), r_f = 6.50 per 1000 node-days (RSC-1),
    projected 1.8 h at 16,384 GPUs and 0.23 h at 131,072."""
    assert round(meta_mttf_hours(16_384), 1) == 1.8
    assert round(meta_mttf_hours(131_072), 2) == 0.23
    assert meta_mttf_hours(2048) == pytest.approx(8 * meta_mttf_hours(16_384))


def test_meta_fleet_preset_gives_the_same_mttf() -> None:
    inputs = PlanInputs(fleet=Fleet.meta_rsc("rsc1"))
    mttf_h = 1 / sum(rates_per_s(inputs).values()) / 3600
    assert mttf_h == pytest.approx(meta_mttf_hours(16_384))


def test_llama3_rates_reproduce_419_interruptions_in_54_days() -> None:
    rates = rates_per_s(PlanInputs())  # the defaults: 16,384 GPUs at Llama 3's rates
    assert sum(rates.values()) * LLAMA3_HOURS * 3600 == pytest.approx(LLAMA3_INTERRUPTIONS)
    per_gpu_hour = LLAMA3_INTERRUPTIONS / (LLAMA3_GPUS * LLAMA3_HOURS)
    assert per_gpu_hour == pytest.approx(1.97e-5, rel=1e-2)  # one failure per ~5.8 GPU-years
    assert 1 / sum(rates.values()) / 3600 == pytest.approx(3.09, abs=0.01)  # hours


@pytest.mark.parametrize(
    "call",
    [
        lambda: young_interval(-1.0, 10.0),
        lambda: optimal_interval(0.0, 1.0),
        lambda: optimal_interval(1.0, float("inf")),
        lambda: exact_ettr(10.0, 1.0, [(-1.0, 2.0)]),
        lambda: meta_mttf_hours(0),
    ],
)
def test_bad_numbers_are_refused(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="must be a finite number"):
        call()
