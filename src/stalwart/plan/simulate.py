"""A seeded discrete-event simulation of a job climbing the recovery ladder.

Events are failures only: Poisson arrivals of each kind (:func:`~stalwart.plan.ladder.rates_per_s`)
striking a uniformly drawn rank, node or rack, and the digest checks that find silent
corruption. Between events, progress, snapshot pauses and commits follow in closed form
(:mod:`stalwart.plan.timeline`). What the simulation adds to the closed forms:

- several tiers at once, each with its own interval, and the choice of restore source per
  event: among the strategy's snapshot tiers still holding a usable copy, the one with the least
  restore time plus work to redo (a lost host takes its disk; more than m lost members in an
  erasure-coded group since a memory snapshot takes that snapshot);
- correlated losses (a node's ranks, a rack's nodes) and overlapping failures: a failure while
  a replica group heals may remove the last holder of a shard and push the job down the ladder;
- heals that overlap training: a peer-rung event stops the job only for detection and the
  discarded step; the healing groups are out for the heal's time, charged as the equivalent
  full-job pause (heal time x g / R) when the heal starts;
- failures during recovery: a failure while the job rolls back restarts the rollback (from the
  same or an older copy), as in Daly's model; a failure that takes the last holder of a shard
  while a replacement is starting for a heal rolls back with that replacement's head start (it
  resumes the job from the tier once started; the groups lost now heal from it afterwards, for
  what is left of their heal then, their replacements launched at the loss's detection);
- silent data corruption, found at the next digest check (every ``verify_every_steps``) and
  rolled back to the newest copy taken before it (checkpoint-restart finds it at once).

Four options fit the model to a measured harness and are off in ``stalwart plan``
(``docs/plan.md`` says what each does, ``simulate``'s arguments in brief): ``strike_starting``
(False: a failure cannot strike a process still starting), ``at_boundaries`` (failures are
taken at step boundaries only), ``start_factors`` (each process start drawn around its mean)
and ``schedule`` (a measured fault trace replayed instead of drawn failures, over
``horizon_s``: the mean is the model's prediction for that run).

Every replication is seeded from ``seed`` (numpy's SeedSequence), so a result is reproducible;
the spread of the replications gives the confidence interval of the ETTR.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist, fmean, stdev

import numpy as np

from stalwart.errors import ConfigError
from stalwart.plan.config import PlanInputs
from stalwart.plan.inputs import Strategy
from stalwart.plan.ladder import TIERS, Kind, Layout, Loss, RungCosts, rates_per_s, rungs
from stalwart.plan.timeline import Clock, Segment, Snapshot
from stalwart.plan.trace import TracedFault

__all__ = ["SimResult", "simulate", "t_quantile"]

_KINDS = tuple(Kind)
_KEEP = 6  # snapshots remembered per tier (enough for corruption found a few intervals late)


@dataclass(frozen=True)
class SimResult:
    """What a simulation measured (seconds are wall seconds of the simulated job)."""

    ettr: float
    """Mean ETTR over the replications."""
    ettr_ci: float
    """Half-width of its 95 % confidence interval (Student t over the replications)."""
    replications: tuple[float, ...]
    failures: int
    simulated_s: float
    lost_work_s: float
    """Mean training progress redone per failure."""
    downtime_s: float
    """Mean stall per failure (detection, restore, heal debt), failures overlapping included."""
    rungs: dict[str, int] = field(default_factory=dict)
    """Failures by the rung that took them (silent corruption counted when found)."""


def t_quantile(p: float, dof: int) -> float:
    """Student t quantile by the Cornish-Fisher expansion in 1/dof (error < 1e-3 for dof >= 4)."""
    z = NormalDist().inv_cdf(p)
    v = float(dof)
    return (z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3))  # fmt: skip


class _Run:
    """One replication: state between events and the two ways an event is taken."""

    def __init__(self, inputs: PlanInputs, strategy: Strategy, every: dict[str, int],
                 strike_starting: bool = True, start_factors: Sequence[float] = (),
                 rng: np.random.Generator | None = None, at_boundaries: bool = False
                 ) -> None:  # fmt: skip
        self.lay, self.costs = Layout.of(inputs), RungCosts.of(inputs, strategy)
        self.strike_starting, self.at_boundaries = strike_starting, at_boundaries
        self.start_factors, self.rng = tuple(start_factors), rng
        self.peer = "peer" in rungs(strategy, inputs)
        self.step_s = inputs.job.step_s
        self.tiers = [t for t in TIERS if t in rungs(strategy, inputs)]
        self.every = every
        self.records: dict[str, list[Snapshot]] = {t: [Snapshot(0.0, -math.inf, -math.inf)]
                                                   for t in self.tiers}  # fmt: skip
        self.losses: list[tuple[float, Loss]] = []
        self.heals: list[tuple[float, Loss]] = []  # (end, loss) of groups still healing
        self.pending: list[float] = []  # progress at which undetected corruption struck
        self.rolling_back = False
        self.seg = Segment(0.0, 0.0, self.step_s, self._clocks(0))
        self.lost_steps = self.down_s = 0.0
        self.taken: Counter[str] = Counter()

    def _clocks(self, anchor: int) -> tuple[Clock, ...]:
        c = self.costs
        return tuple(Clock(t, anchor, self.every[t], c.save_s[t], c.lag_s[t]) for t in self.tiers)

    def _start(self, t: float, w0: float, p0: float, anchor: int | None = None) -> None:
        """Training resumes at ``w0`` from ``p0`` steps (the event was at ``t``)."""
        self.down_s += w0 - t - max(self.seg.w0 - t, 0.0)  # a cut-short stall never elapsed
        clocks = self.seg.clocks if anchor is None else self._clocks(anchor)
        self.seg = Segment(w0, p0, self.step_s, clocks)

    def _remember(self, t: float) -> None:
        """Keep this segment's newest snapshots (committed or in flight) before it ends."""
        limit = min(self.pending, default=math.inf)
        for clock in self.seg.clocks:
            found = [self.seg.newest_started(clock, t), self.seg.newest_commit(clock, t)]
            if limit < math.inf:
                found.append(self.seg.newest_commit(clock, t, at_most=limit))
            kept = {s.progress: s for s in self.records[clock.name]}
            kept.update({s.progress: s for s in found if s is not None})
            self.records[clock.name] = sorted(kept.values(), key=lambda s: s.progress)[-_KEEP:]

    def _usable(self, tier: str, snap: Snapshot) -> bool:
        after = [loss for when, loss in self.losses if when >= snap.start]
        if tier == "disk":
            return not any(loss.nodes for loss in after)
        if tier == "memory":
            return not self.lay.ec_overflow(after)
        return True

    def _factor(self) -> float:
        """This start's factor on the mean (docs/plan.md, `start_factors`)."""
        if not self.start_factors or self.rng is None:
            return 1.0
        return self.start_factors[int(self.rng.integers(len(self.start_factors)))]

    def _starting(self, t: float, loss: Loss) -> bool:
        """Whether ``loss`` strikes only processes still starting (``strike_starting``): every
        process while the job rolls back, or ranks whose replacement has not joined yet."""
        if self.rolling_back and t < self.seg.w0:
            return True
        ranks = set(self.lay.ranks(loss))
        healing = {r for end, h in self.heals if end > t for r in self.lay.ranks(h)}
        return bool(ranks) and ranks <= healing

    def pick_unit(self, t: float, kind: Kind, starting: bool) -> int:
        """The first unit of ``kind`` whose processes are (``starting``) or are not starting at
        ``t``; 0 if there is none."""
        units = range(self.lay.units(kind))
        return next((u for u in units if self._starting(t, self.lay.loss(kind, u)) is starting),
                    0)  # fmt: skip

    def failure(self, t: float, loss: Loss) -> bool:
        """Take a failure at ``t``; False when it struck nothing (``strike_starting``)."""
        if not self.strike_starting and self._starting(t, loss):
            return False
        p = self.seg.progress(t)
        oldest = min((s.start for n in self.tiers if n != "remote" for s in self.records[n]),
                     default=math.inf)  # fmt: skip
        self.losses = [(when, x) for when, x in self.losses if when >= oldest]
        self.losses.append((t, loss))
        self.heals = [(end, h) for end, h in self.heals if end > t]
        if loss.kind is Kind.SDC and self.costs.verify_every_steps:
            self.pending.append(p)
            return True
        self._remember(t)
        healing = [h for _, h in self.heals]
        if (self.peer and loss.kind is not Kind.SDC and not self.rolling_back
                and not self.lay.all_holders_lost([*healing, loss])):  # fmt: skip
            self._heal(t, p, loss)
        elif self.heals and loss.kind is not Kind.SDC:  # a replacement is starting already
            self._roll_back(t, p, loss.kind, p, head=(min(e for e, _ in self.heals) - t, loss))
        else:
            self._roll_back(t, p, loss.kind, p)
        return True

    def detect(self, t: float, corrupted_at: float) -> None:
        self._remember(t)  # while the corruption is pending: keeps the copy taken before it
        self.pending.remove(corrupted_at)
        self._roll_back(t, self.seg.progress(t), Kind.SDC, corrupted_at)

    def _heal(self, t: float, p: float, loss: Loss) -> None:
        c = self.costs
        stall = c.stall_s(loss.kind, "peer")
        heal = c.heal_time_s(loss.kind) * self._factor()
        debt = heal * self.lay.groups_out(loss) / self.lay.replicas
        self.heals.append((t + stall + heal, loss))
        w0 = max(t + stall, self.seg.w0) + debt  # a heal in progress keeps its own debt
        self.lost_steps += p - math.floor(p)
        self.taken["peer"] += 1
        self._start(t, w0, float(math.floor(p)))

    def _roll_back(self, t: float, p: float, kind: Kind, limit: float,
                   head: tuple[float, Loss] | None = None) -> None:  # fmt: skip
        """Roll every rank back to the best usable copy. ``head``: (seconds a replacement
        started for a heal still needs, the loss that took the last holder)."""
        best: tuple[float, str, Snapshot] | None = None
        for tier in self.tiers:
            lag = self.costs.lag_s[tier]
            for snap in reversed(self.records[tier]):
                done = snap.commit <= t or (self.at_boundaries and snap.start + lag <= t)
                if done and snap.progress <= min(p, limit) and self._usable(tier, snap):
                    cost = self.costs.restore_s[tier] + (p - snap.progress) * self.step_s
                    if best is None or cost < best[0]:
                        best = (cost, tier, snap)
                    break
        tier, x = (best[1], best[2].progress) if best else ("remote", 0.0)
        c, factor = self.costs, self._factor()
        stall = c.stall_s(kind, tier) + c.start_s * (factor - 1.0)
        heal = c.heal_time_s(kind) * factor  # the replacement for the member lost now
        if head is not None:
            left_s, loss = head
            # the replacement resumes once it is up and the lost member is found (side by
            # side: a hang is found while the replacement starts), then loads the tier
            started = max(c.detect_s[kind], left_s) + c.restore_s[tier] - c.start_s
            if started < stall:  # resumed by the replacement; the groups lost now heal after,
                # for what is left of their heal then (launched at the loss's detection, the
                # replacement may be up by the time the job resumes: it joins at once)
                left = max(c.detect_s[kind] + heal - started, 0.0)
                stall = started + left * self.lay.groups_out(loss) / self.lay.replicas
        self.lost_steps += p - x
        self.taken[tier] += 1
        self.rolling_back = True
        self.heals.clear()
        if head is not None:  # the member lost now is replaced from its detection on
            self.heals.append((t + c.detect_s[kind] + heal, head[1]))
        self.pending = [p for p in self.pending if p < x]  # later corruption is rolled away
        for name in self.tiers:
            self.records[name] = [s for s in self.records[name] if s.progress <= x] or [
                Snapshot(0.0, -math.inf, -math.inf)
            ]
        if best and tier == "memory":  # the rebuild made the snapshot's groups whole again
            self.records[tier][-1] = Snapshot(x, t, best[2].commit)
        self._start(t, t + stall, x, anchor=int(x))

    def next_detection(self) -> tuple[float, float]:
        """(wall time, corruption progress) of the next digest check that finds corruption."""
        k = self.costs.verify_every_steps or 1
        best = (math.inf, math.nan)
        for c in self.pending:
            check = k * (math.floor(max(c, self.seg.p0) / k) + 1)
            best = min(best, (self.seg.arrive(check), c))
        return best

    def settle(self, t: float) -> None:
        """Training resumed by ``t``: the next failure is no longer one during a rollback."""
        if t >= self.seg.w0:
            self.rolling_back = False


def _replicate(inputs: PlanInputs, strategy: Strategy, every: dict[str, int], horizon_s: float,
               seed: np.random.SeedSequence, strike_starting: bool = True,
               start_factors: Sequence[float] = (), schedule: Sequence[TracedFault] | None = None,
               at_boundaries: bool = False) -> tuple[float, int, _Run]:  # fmt: skip
    rng = np.random.default_rng(seed)  # the failures: the same with or without start factors
    starts = np.random.default_rng(seed.spawn(1)[0]) if start_factors else None
    run = _Run(inputs, strategy, every, strike_starting, start_factors, starts, at_boundaries)
    lay = Layout.of(inputs)
    rates = rates_per_s(inputs)
    total = sum(rates.values()) if schedule is None else 0.0
    probs = np.array([rates[k] / total for k in _KINDS]) if total > 0 else None
    trace = sorted(schedule or (), key=lambda f: f.t_s)
    t_fail = rng.exponential(1.0 / total) if total > 0 else math.inf
    if trace:
        t_fail = trace[0].t_s
    failures = 0
    while True:
        t_found, corrupted = run.next_detection()
        t = min(t_fail, t_found)
        if t >= horizon_s:
            break
        run.settle(t)
        if t_fail <= t_found and trace:
            fault = trace.pop(0)
            kind = Kind(fault.kind)
            unit = fault.unit
            if unit is None:
                unit = run.pick_unit(t, kind, starting=fault.whole)
            failures += run.failure(t, lay.loss(kind, unit))
            t_fail = trace[0].t_s if trace else math.inf
        elif t_fail <= t_found:
            kind = _KINDS[int(rng.choice(len(_KINDS), p=probs))]
            failures += run.failure(t, lay.loss(kind, int(rng.integers(lay.units(kind)))))
            t_fail = t + rng.exponential(1.0 / total)
        else:
            run.detect(t, corrupted)
    if run.seg.w0 > horizon_s:
        run.down_s -= run.seg.w0 - horizon_s
    return run.seg.progress(horizon_s) * run.step_s / horizon_s, failures, run


def steps_between(inputs: PlanInputs, intervals: dict[str, float]) -> dict[str, int]:
    """Whole steps between snapshots of each tier (at least one)."""
    step = inputs.job.step_s
    return {t: max(1, round(s / step)) for t, s in intervals.items()}


def _steps_and_horizon(
    inputs: PlanInputs,
    strategy: Strategy,
    intervals: dict[str, float],
    failures: int,
    replications: int,
    schedule: Sequence[TracedFault] | None,
    horizon_s: float | None,
) -> tuple[dict[str, int], float]:
    """``simulate``'s arguments checked: the steps between snapshots of each tier it uses,
    and the seconds each replication runs."""
    need = [t for t in TIERS if t in rungs(strategy, inputs)]
    missing = [t for t in need if not (intervals.get(t, 0) > 0)]
    if missing:
        raise ConfigError(f"simulate({strategy.value}): give a positive interval for {missing}")
    if replications < 2 or failures < replications:
        raise ConfigError("simulate: replications must be >= 2 and failures >= replications")
    every = steps_between(inputs, {t: intervals[t] for t in need})
    if schedule is not None:
        if not (horizon_s is not None and horizon_s > 0):
            raise ConfigError("simulate(schedule=...): give the trace's horizon_s (> 0)")
        return every, horizon_s
    total = sum(rates_per_s(inputs).values())
    longest = max(every.values()) * inputs.job.step_s
    return every, failures / total / replications if total > 0 else 100.0 * longest


def simulate(
    inputs: PlanInputs,
    strategy: Strategy | str,
    intervals: dict[str, float],
    *,
    failures: int = 2_000,
    replications: int = 16,
    seed: int = 0,
    strike_starting: bool = True,
    start_factors: Sequence[float] = (),
    schedule: Sequence[TracedFault] | None = None,
    horizon_s: float | None = None,
    at_boundaries: bool = False,
) -> SimResult:
    """Simulate ``strategy`` with the given snapshot intervals.

    Args:
        inputs: the job, fleet, tiers and costs.
        strategy: which recovery strategy runs.
        intervals: seconds between snapshots for every snapshot tier the strategy uses
            (``memory``, ``disk``, ``remote``); rounded to whole steps.
        failures: expected failures over all replications (sets the simulated time; more
            failures narrow the confidence interval as 1 / sqrt(failures)).
        replications: independent runs the time is split into (>= 2, for the interval).
        seed: the root of every replication's random stream.
        strike_starting: False: a failure on a process still starting does nothing (uncounted).
        start_factors: factors on the mean start of a process, one drawn per heal and
            rollback (docs/plan.md); empty: every start takes the mean.
        schedule: a fault trace to replay in every replication instead of drawn failures
            (docs/plan.md); ``failures`` and the inputs' rates are then unused.
        horizon_s: with ``schedule``, the seconds each replication runs (required).
        at_boundaries: failures are taken at step boundaries only: a snapshot whose pause
            began has committed ``lag_s`` later (a fault due in the pause strikes after it).

    Raises:
        ConfigError: an interval is missing or not positive, too few failures/replications,
            or a schedule without a positive ``horizon_s``.
    """
    strategy = Strategy(strategy)
    every, per_run = _steps_and_horizon(
        inputs, strategy, intervals, failures, replications, schedule, horizon_s
    )
    results, n, lost, down, taken = [], 0, 0.0, 0.0, Counter[str]()
    for child in np.random.SeedSequence(seed).spawn(replications):
        ettr, count, run = _replicate(inputs, strategy, every, per_run, child, strike_starting,
                                      start_factors, schedule, at_boundaries)  # fmt: skip
        results.append(ettr)
        n, lost, down = n + count, lost + run.lost_steps * run.step_s, down + run.down_s
        taken.update(run.taken)
    half = t_quantile(0.975, replications - 1) * stdev(results) / math.sqrt(replications)
    return SimResult(
        ettr=fmean(results),
        ettr_ci=half,
        replications=tuple(results),
        failures=n,
        simulated_s=per_run * replications,
        lost_work_s=lost / n if n else 0.0,
        downtime_s=down / n if n else 0.0,
        rungs=dict(taken),
    )
