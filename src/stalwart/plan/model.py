"""The planner: best intervals per tier, expected ETTR and lost work for each strategy, and how
ETTR moves with job size.

Intervals. Each failure kind lands, when it strikes alone, on one rung of a strategy
(:meth:`~stalwart.plan.ladder.Layout.first_rung`); a snapshot tier t therefore sees the rate
Lambda_t of the kinds that land on it and costs c_t per snapshot. Its interval is the exact
one-tier optimum for (c_t, Lambda_t) (:func:`~stalwart.plan.analytic.optimal_interval`, Young's
sqrt(2 c_t / Lambda_t) to first order), at least one step and the tier's commit lag, at most
``interval_cap_s`` (a tier no kind lands on, such as the remote tier of a job with live
replicas, saves at that cap), rounded to whole steps and to a multiple of the next faster
tier's interval (snapshots of both tiers then fall on the same steps, as stalwart takes them:
one host copy feeds every tier). An interval the user set is kept as given.

ETTR. ``analytic`` is exact (Daly's complete model, :func:`~stalwart.plan.analytic.exact_ettr`)
for checkpoint-restart when its saves commit as their stall ends (one tier, Poisson failures,
rollback to the last commit); otherwise it is the first-order estimate
ETTR = (1 - sum_k lambda_k (L_k + D_k)) / (1 + sum_t c_t / tau_t), with lost work L_k =
tau_t / 2 + lag_t (+ half a digest interval for corruption) on a rollback rung t, half a step
on the peer rung, and downtime D_k the rung's stall (plus the heal's debt on the peer rung).
First order means: valid while lambda (tau + D) << 1, i.e. failures are rare within an interval
and a recovery; it ignores overlapping failures. The simulation (:mod:`stalwart.plan.simulate`)
has neither limit and is the figure to quote; the two agree where both apply (tests).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from stalwart.errors import ConfigError
from stalwart.plan.analytic import exact_ettr, optimal_interval
from stalwart.plan.config import PlanInputs
from stalwart.plan.inputs import Strategy
from stalwart.plan.ladder import (
    TIERS,
    Kind,
    Layout,
    RungCosts,
    mean_heal_debt_s,
    rates_per_s,
    room_gb,
    rungs,
)
from stalwart.plan.result import Estimate, PlanResult, ScalePoint, StrategyPlan
from stalwart.plan.simulate import simulate

__all__ = ["analytic", "landing_rates", "plan", "recommend_intervals"]


def landing_rates(inputs: PlanInputs, strategy: Strategy) -> dict[str, float]:
    """Events per second that land on each rung of ``strategy`` when they strike alone."""
    ladder = rungs(strategy, inputs)
    lay, out = Layout.of(inputs), dict.fromkeys(ladder, 0.0)
    for kind, rate in rates_per_s(inputs).items():
        if rate > 0:
            out[lay.first_rung(ladder, lay.loss(kind, 0))] += rate
    return out


def recommend_intervals(inputs: PlanInputs, strategy: Strategy | str) -> dict[str, float]:
    """Seconds between snapshots for each snapshot tier of ``strategy`` (module docstring)."""
    strategy = Strategy(strategy)
    costs, land = RungCosts.of(inputs, strategy), landing_rates(inputs, strategy)
    step, faster = inputs.job.step_s, 0
    out: dict[str, float] = {}
    for name in (t for t in TIERS if t in rungs(strategy, inputs)):
        tier = getattr(inputs.tiers, name)
        if tier.interval_s is not None:
            out[name] = max(1, round(tier.interval_s / step)) * step
            continue
        if land[name] > 0 and costs.save_s[name] > 0:
            chosen = min(optimal_interval(costs.save_s[name], land[name]), tier.interval_cap_s)
        else:
            chosen = tier.interval_cap_s
        span = max(chosen, costs.lag_s[name], step) / step
        if not math.isfinite(span):
            raise ConfigError(_out_of_range(inputs, f"tier {name}'s interval is {span:g} steps"))
        steps = max(1, round(span))
        if 0 < faster < steps:  # on the faster tier's grid: one pause serves both
            steps = steps // faster * faster
        out[name], faster = steps * step, steps
    return out


def _per_kind(inputs: PlanInputs, strategy: Strategy, intervals: dict[str, float]
              ) -> list[tuple[float, float, float]]:  # fmt: skip
    """(rate, lost work, downtime) of every failure kind, to first order."""
    lay, costs = Layout.of(inputs), RungCosts.of(inputs, strategy)
    step, out = inputs.job.step_s, []
    for kind, rate in rates_per_s(inputs).items():
        if rate <= 0:
            continue
        rung = lay.first_rung(rungs(strategy, inputs), lay.loss(kind, 0))
        down = costs.stall_s(kind, rung)
        if rung == "peer":
            lost, down = step / 2, down + mean_heal_debt_s(inputs, costs, kind)
        else:
            lost = intervals[rung] / 2 + costs.lag_s[rung]
            if kind is Kind.SDC and costs.verify_every_steps:
                lost += costs.verify_every_steps * step / 2
        out.append((rate, lost, down))
    return out


def analytic(inputs: PlanInputs, strategy: Strategy | str, intervals: dict[str, float]) -> Estimate:
    """The closed-form estimate for ``strategy`` at ``intervals`` (module docstring)."""
    strategy = Strategy(strategy)
    costs = RungCosts.of(inputs, strategy)
    kinds = _per_kind(inputs, strategy, intervals)
    lam = sum(rate for rate, _, _ in kinds)
    saves = sum(costs.save_s[t] / intervals[t] for t in intervals)
    lost = sum(rate * lost for rate, lost, _ in kinds) / lam if lam else 0.0
    down = sum(rate * down for rate, _, down in kinds) / lam if lam else 0.0
    tau = intervals.get("remote", 0.0)
    if strategy is Strategy.CHECKPOINT_RESTART and costs.lag_s["remote"] <= 1e-9 * tau:
        failures = [(rate, costs.stall_s(k, "remote")) for k, rate in rates_per_s(inputs).items()]
        ettr = exact_ettr(tau, costs.save_s["remote"], failures)
        return Estimate(ettr, lost, down, "exact (Daly's complete model)")
    ettr = (1.0 - lam * (lost + down)) / (1.0 + saves)
    return Estimate(max(ettr, 0.0), lost, down, "first order")


def _out_of_range(inputs: PlanInputs, what: str) -> str:
    """The message for inputs whose derived figures overflow: ``what`` overflowed, and the
    job's inputs it derives from (with their options) to change."""
    job = inputs.job
    return (
        f"the inputs are out of range: {what} (job.state_gb={job.state_gb:g} GB, --state-gb; "
        f"job.step_s={job.step_s:g} s, --step-s; job.accelerators={job.accelerators}, "
        "--accelerators; with the tiers' and network's GB/s and the costs); give realistic values"
    )


def _strategy_plan(inputs: PlanInputs, strategy: Strategy, sim: dict[str, int] | None
                   ) -> StrategyPlan:  # fmt: skip
    c = RungCosts.of(inputs, strategy)  # a state of 1e308 GB takes forever to save
    derived = {f"a {t} save": v for t, v in c.save_s.items()} | {"a heal": c.heal_s}
    derived |= {f"a restore from {t}": v for t, v in c.restore_s.items()}
    for what, seconds in (derived | {f"a {t} commit": v for t, v in c.lag_s.items()}).items():
        if not math.isfinite(seconds):
            raise ConfigError(_out_of_range(inputs, f"{what} takes {seconds:g} s"))
    try:
        return _modelled(inputs, strategy, sim)
    except OverflowError as e:  # a step of 1e300 s: a failure's odds within it overflow
        raise ConfigError(_out_of_range(inputs, f"a figure overflowed ({e})")) from e


def _modelled(inputs: PlanInputs, strategy: Strategy, sim: dict[str, int] | None
              ) -> StrategyPlan:  # fmt: skip
    intervals = recommend_intervals(inputs, strategy)
    simulated = None
    if sim is not None:
        simulated = simulate(inputs, strategy, intervals, **sim)
    lam = sum(rates_per_s(inputs).values())
    notes = tuple(
        f"{t}: {getattr(inputs.tiers, t).capacity_gb:g} GB per rank cannot hold two snapshots "
        f"({need:g} GB); not used"
        for t in ("memory", "disk")
        if t in rungs(strategy) and (need := room_gb(inputs, t)) is not None
    )
    return StrategyPlan(
        strategy=strategy.value,
        intervals_s=intervals,
        landing_per_day={k: v * 86400 for k, v in landing_rates(inputs, strategy).items()},
        analytic=analytic(inputs, strategy, intervals),
        simulated=simulated,
        failures_per_day=lam * 86400,
        notes=notes,
    )


def plan(
    inputs: PlanInputs | None = None,
    *,
    strategies: Iterable[Strategy | str] = tuple(Strategy),
    sizes: Sequence[int] = (),
    simulate: bool = True,
    failures: int = 2_000,
    replications: int = 16,
    seed: int = 0,
) -> PlanResult:
    """Plan a job: intervals, ETTR and lost work per strategy, and ETTR against job size.

    Args:
        inputs: the job, fleet, tiers and costs (defaults: Llama 3's job and failure rates
            with stalwart's costs measured here; every source in ``PlanResult.sources``).
        strategies: which strategies to model (default: all three).
        sizes: accelerator counts for the scaling curve (each a multiple of the group size);
            empty: none.
        simulate: also run the discrete-event simulation (the figure to quote; the closed
            forms are always given).
        failures, replications, seed: the simulation's length, split and root seed
            (:func:`stalwart.plan.simulate.simulate`).

    Raises:
        ConfigError: a bad strategy or size.
    """
    inputs = inputs if inputs is not None else PlanInputs()
    try:
        chosen = [Strategy(s) for s in strategies]
    except ValueError:
        known = ", ".join(s.value for s in Strategy)
        raise ConfigError(f"unknown strategy in {list(strategies)}; use {known}") from None
    sim = {"failures": failures, "replications": replications, "seed": seed} if simulate else None
    plans = tuple(_strategy_plan(inputs, s, sim) for s in chosen)
    curve = []
    for n in sizes:
        sized = inputs.replace(**{"job.accelerators": int(n)})
        for s in chosen:
            p = _strategy_plan(sized, s, sim)
            curve.append(ScalePoint(int(n), s.value, p.analytic.ettr,
                                    p.simulated.ettr if p.simulated else math.nan,
                                    p.simulated.ettr_ci if p.simulated else math.nan))  # fmt: skip
    return PlanResult(inputs=inputs.to_dict(), sources=inputs.sources(), plans=plans,
                      scaling=tuple(curve))  # fmt: skip
