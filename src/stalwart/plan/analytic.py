"""Closed forms for one tier: the best checkpoint interval and the expected goodput (ETTR).

Notation: failures arrive as a Poisson process of rate lambda (mean time to failure
M = 1 / lambda); a checkpoint stops training for delta seconds and commits when it ends; a
failure costs a recovery of R seconds, during which failures can strike again (each restarts
the recovery), and rolls the job back to the last committed checkpoint; tau is the training
time between checkpoints. ETTR (Meta's "effective training time ratio", Kokolis et al.) is the
share of wall-clock time that becomes kept training progress; here it is also the goodput.

- :func:`young_interval`: tau = sqrt(2 delta M) (Young 1974). First order: valid for
  delta << tau << M; it ignores failures during checkpoints and recoveries.
- :func:`daly_interval`: Daly's (2006) higher-order estimate,
  tau = sqrt(2 delta M) [1 + (1/3) sqrt(delta / 2M) + delta / 18M] - delta for delta < 2M,
  else M. Within a few tenths of a percent of the exact optimum for delta < M / 2.
- :func:`exact_ettr`: the exact expectation of the model above (Daly's complete cost
  function), for any tau, delta, lambda and R, with several failure kinds each having its own
  R: ETTR = lambda tau A / (e^{lambda (tau + delta)} - 1), A = sum_k (lambda_k / lambda)
  e^{-lambda R_k}. Exact under its assumptions (Poisson failures, blocking checkpoints,
  rollback to the last commit); no first-order step.
- :func:`optimal_interval`: the tau that maximises :func:`exact_ettr`, the root u = lambda tau
  of 1 - u = e^{-(u + lambda delta)}, i.e. tau = (1 + W0(-e^{-1 - lambda delta})) / lambda
  with W0 the principal Lambert W. It does not depend on R. As lambda delta -> 0 it tends to
  Young's sqrt(2 delta / lambda).
- :func:`meta_mttf_hours`: Kokolis et al.'s fitted form MTTF = 1 / (N_nodes r_f), with
  r_f = 6.50 failures per 1000 node-days (their RSC-1) by default.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from stalwart.errors import ConfigError

__all__ = [
    "daly_interval",
    "exact_ettr",
    "meta_mttf_hours",
    "optimal_interval",
    "young_interval",
]


def _positive(name: str, value: float, *, zero: bool = False) -> None:
    if not (value >= 0 if zero else value > 0) or math.isinf(value):
        raise ConfigError(
            f"{name} must be a finite number {'>=' if zero else '>'} 0, got {value!r}"
        )


def young_interval(save_s: float, mttf_s: float) -> float:
    """Young's first-order optimum sqrt(2 delta M), in seconds.

    Args:
        save_s: delta, the training time one checkpoint costs.
        mttf_s: M, the mean time between failures of the whole job.
    """
    _positive("save_s", save_s)
    _positive("mttf_s", mttf_s)
    return math.sqrt(2.0 * save_s * mttf_s)


def daly_interval(save_s: float, mttf_s: float) -> float:
    """Daly's (2006) higher-order estimate of the optimum interval, in seconds (module doc)."""
    _positive("save_s", save_s)
    _positive("mttf_s", mttf_s)
    if save_s >= 2.0 * mttf_s:
        return mttf_s
    xi = save_s / (2.0 * mttf_s)
    return math.sqrt(2.0 * save_s * mttf_s) * (1.0 + math.sqrt(xi) / 3.0 + xi / 9.0) - save_s


def optimal_interval(save_s: float, rate_per_s: float) -> float:
    """The exact optimum of :func:`exact_ettr`, in seconds (module docstring): the root of
    1 - u = e^{-(u + a)}, u = lambda tau, a = lambda delta, found by bisection on (0, 1).

    Args:
        save_s: delta, the training time one checkpoint costs (> 0).
        rate_per_s: lambda, the failure rate of the whole job (> 0).
    """
    _positive("save_s", save_s)
    _positive("rate_per_s", rate_per_s)
    a = rate_per_s * save_s

    def excess(u: float) -> float:  # 1 - u - e^{-(u + a)}, without cancellation for small u
        return -u - math.expm1(-(u + a))

    lo, hi = 0.0, 1.0  # excess(0) = 1 - e^-a > 0, excess(1) = -e^{-1-a} < 0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if excess(mid) > 0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * hi:
            break
    return 0.5 * (lo + hi) / rate_per_s


def exact_ettr(interval_s: float, save_s: float, failures: Iterable[tuple[float, float]]) -> float:
    """Expected ETTR of periodic blocking checkpoints under Poisson failures (module docstring).

    Args:
        interval_s: tau, training seconds between checkpoints.
        save_s: delta, seconds one checkpoint stops training (0: free checkpoints).
        failures: (rate per second, recovery seconds R) of each failure kind; a failure during
            a recovery restarts it with the new failure's R.

    Returns:
        The long-run share of wall time that is kept progress, in (0, 1].
    """
    _positive("interval_s", interval_s)
    _positive("save_s", save_s, zero=True)
    kinds = [(float(rate), float(r)) for rate, r in failures]
    for rate, r in kinds:
        _positive("a failure rate", rate, zero=True)
        _positive("a recovery time", r, zero=True)
    lam = sum(rate for rate, _ in kinds)
    if lam == 0.0:
        return interval_s / (interval_s + save_s)
    survive = sum(rate / lam * math.exp(-lam * r) for rate, r in kinds)
    return lam * interval_s * survive / math.expm1(lam * (interval_s + save_s))


def meta_mttf_hours(
    accelerators: int, failures_per_1000_node_days: float = 6.50, accelerators_per_node: int = 8
) -> float:
    """A job's mean time to failure by Kokolis et al.'s fitted form, 1 / (N_nodes r_f), hours.

    Args:
        accelerators: GPUs in the job; N_nodes = accelerators / accelerators_per_node.
        failures_per_1000_node_days: r_f; 6.50 is their RSC-1 fit, 2.34 their RSC-2.
        accelerators_per_node: 8 on both of their clusters.
    """
    _positive("accelerators", accelerators)
    _positive("failures_per_1000_node_days", failures_per_1000_node_days)
    nodes = accelerators / accelerators_per_node
    return 24.0 * 1000.0 / (nodes * failures_per_1000_node_days)
