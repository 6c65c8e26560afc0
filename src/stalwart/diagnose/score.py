"""Scoring, pruning and selection of item-sets: lift with a Wilson interval, significance-based
redundancy pruning, and a greedy cover of the failures with a stopping rule.

Notation: an item-set X has failure mass f(X) and total mass n(X) (rows, or a KPI's reference
mass); the base rate is F / N over the whole table. lift(X) = (f(X) / n(X)) / (F / N).

- *Filter*: keep X when lift >= ``min_lift`` and the Wilson lower bound of its rate, at the
  Bonferroni-corrected level alpha / (number of candidates), is above the base rate.
- *Superset rule*: drop X when, for a kept subset Y, X's rate is not significantly above the rate
  of Y \\ X (the extra items add nothing; the FDA paper's lift-ratio rule, made a test).
- *Subset rule*: drop Y when, for a kept superset X, the rate of Y \\ X is not significantly above
  the base rate (Y is elevated only because it contains X; the FDA support-ratio rule).
- *Selection*: repeatedly take the survivor with the most attributable failures on the rows not
  yet explained, f - n * (residual rate), re-testing it against the residual rate; stop at
  ``max_findings``, when the next one would add less than ``min_gain`` of the failures, or when
  the findings' rows hold ``coverage`` of the failures.

With ``counts=False`` (an additive KPI, whose masses are not counts) the tests become ratio
thresholds, as in the FDA paper.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import combinations
from statistics import NormalDist

import numpy as np

from stalwart.diagnose.aggregate import Itemset
from stalwart.diagnose.options import DiagnoseOptions

__all__ = [
    "Scored",
    "Tester",
    "finding_confidence",
    "overall_confidence",
    "prune",
    "select",
    "wilson",
]

_RATIO = 1.25  # rate ratio that counts as "higher" when masses are not counts


def finding_confidence(purity: float, misfit: float = 0.0) -> float:
    """How sure one finding is, 0..1, in both modes: the share of its mass that is anomalous
    (purity) less what its cause model leaves unexplained (misfit).

    Labelled events: purity = 1 - 1 / lift_low, the share of the finding's failures above the
    base rate at the low end of the lift's interval; no misfit. KPI: ``kpi_search``'s weighted
    purity of deviating leaves and the misfit of the ripple effect.
    """
    return float(min(max(purity - misfit, 0.0), 1.0))


def overall_confidence(explained: list[float], confidence: list[float]) -> float:
    """How sure an analysis is of its findings together, 0..1: their confidences weighted by
    the share each explains, times the share they explain together (capped at 1)."""
    ep = np.maximum(np.asarray(explained, dtype=np.float64), 0.0)
    if ep.size == 0 or ep.sum() <= 0:
        return 0.0
    conf = np.asarray(confidence, dtype=np.float64)
    return float((ep * conf).sum() / ep.sum() * min(1.0, float(ep.sum())))


def wilson(f: float, n: float, z: float) -> tuple[float, float]:
    """Wilson score interval of the proportion f / n at normal quantile ``z``."""
    if n <= 0:
        return 0.0, 1.0
    p = min(max(f / n, 0.0), 1.0)
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(mid - half, 0.0), min(mid + half, 1.0)


@dataclass
class Scored:
    """An item-set with its masses, and the neighbours pruned in its favour."""

    items: Itemset
    failures: float
    rows: float
    subsumed: list[tuple[Itemset, str]] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.failures / self.rows if self.rows > 0 else 0.0


@dataclass(frozen=True)
class Tester:
    """Significance (or ratio) tests shared by pruning and selection."""

    z: float
    counts: bool
    ratio: float = _RATIO

    @classmethod
    def make(cls, options: DiagnoseOptions, tests: int, *, counts: bool) -> Tester:
        level = options.alpha / max(tests, 1)
        return cls(NormalDist().inv_cdf(1 - level), counts, options.min_lift_gain)

    def above(self, f: float, n: float, rate: float) -> bool:
        """Is the rate f / n significantly above ``rate``?"""
        if n <= 0 or f <= 0:
            return False
        if not self.counts:
            return f / n > rate * _RATIO
        return wilson(f, n, self.z)[0] > rate

    def greater(self, f1: float, n1: float, f2: float, n2: float) -> bool:
        """Is f1 / n1 significantly above f2 / n2 (two-proportion z-test)?"""
        if n1 <= 0:
            return False
        if n2 <= 0:
            return False
        p1, p2 = min(f1 / n1, 1.0), min(max(f2 / n2, 0.0), 1.0)
        if p1 <= p2 * self.ratio:
            return False
        if not self.counts:
            return True
        p = min((f1 + f2) / (n1 + n2), 1.0)
        se = math.sqrt(max(p * (1 - p), 1e-12) * (1 / n1 + 1 / n2))
        return (p1 - p2) / se > self.z


def _subsets(
    items: Itemset, closure: Callable[[Itemset], frozenset[tuple[int, str]]]
) -> list[Itemset]:
    full = sorted(closure(items))
    out: list[Itemset] = []
    for k in range(1, len(full)):
        out.extend(combinations(full, k))
    return [s for s in out if s != items]


def prune(
    cands: list[Scored],
    base: float,
    tester: Tester,
    options: DiagnoseOptions,
    closure: Callable[[Itemset], frozenset[tuple[int, str]]],
) -> list[Scored]:
    """Filter by lift and significance, then apply the superset and subset rules."""
    kept = {
        c.items: c
        for c in cands
        if c.rows > 0
        and c.rate >= options.min_lift * base
        and tester.above(c.failures, c.rows, base)
    }
    # superset rule
    survivors: dict[Itemset, Scored] = {}
    for items, c in kept.items():
        reason = None
        for sub in _subsets(items, closure):
            y = kept.get(sub)
            if y is None:
                continue
            f_rest, n_rest = y.failures - c.failures, y.rows - c.rows
            if n_rest <= 0 or not tester.greater(c.failures, c.rows, f_rest, n_rest):
                reason = sub
                break
        if reason is None:
            survivors[items] = c
        else:
            kept[reason].subsumed.append((items, "adds no significant lift to it"))
    # subset rule: index survivors by every sub-item-set of their closure
    supersets: dict[Itemset, list[Scored]] = {}
    for c in survivors.values():
        for sub in _subsets(c.items, closure):
            supersets.setdefault(sub, []).append(c)
    out = []
    for items, y in survivors.items():
        explained_by = None
        for x in supersets.get(items, ()):
            f_rest, n_rest = y.failures - x.failures, y.rows - x.rows
            if not tester.above(f_rest, n_rest, base):
                explained_by = x
                break
        if explained_by is None:
            out.append(y)
        else:
            explained_by.subsumed.append((items, "elevated only through it"))
    return out


@dataclass
class Selected:
    """A selected finding with the masses it explains beyond what was selected before."""

    scored: Scored
    attributable: float
    residual_rate: float


def select(
    survivors: list[Scored],
    *,
    total_failures: float,
    total_rows: float,
    recount: Callable[[list[Itemset], np.ndarray | None], tuple[np.ndarray, np.ndarray]],
    match: Callable[[Itemset], np.ndarray],
    tester: Tester,
    options: DiagnoseOptions,
    closure: Callable[[Itemset], frozenset[tuple[int, str]]],
    everything: dict[Itemset, Scored] | None = None,
) -> tuple[list[Selected], float]:
    """Greedy cover; returns the selection and the share of the failures its rows hold."""
    chosen: list[Selected] = []
    pool = list(survivors)
    mask: np.ndarray | None = None
    f_res, n_res = total_failures, total_rows
    f = np.array([c.failures for c in pool])
    n = np.array([c.rows for c in pool])
    while pool and len(chosen) < options.max_findings:
        rate = f_res / n_res if n_res > 0 else 0.0
        gain = f - n * rate
        order = np.argsort(-gain)
        ok = [
            int(i)
            for i in order
            if gain[i] >= (options.min_gain or 0.0) * total_failures
            and f[i] >= options.min_lift * rate * n[i]
            and tester.above(f[i], n[i], rate)
        ]
        if not ok:
            break
        pick = ok[0]
        best, best_f, best_n = pool[pick], float(f[pick]), float(n[pick])
        simpler = _simpler(
            best, best_f, best_n, rate, everything, chosen, recount, mask, tester, options
        )
        if simpler is not None:
            best, best_f, best_n = simpler
        chosen.append(Selected(best, best_f - best_n * rate, rate))
        m = ~match(best.items)
        mask = m if mask is None else mask & m
        f_res, n_res = f_res - best_f, n_res - best_n
        picked_closure = closure(best.items)
        pool = [
            c
            for k, c in enumerate(pool)
            if k != pick
            and c.items != best.items
            and not (closure(c.items) <= picked_closure)
            and not (picked_closure <= closure(c.items))
        ]
        if not pool:
            break
        f, n = recount([c.items for c in pool], mask)
        if total_failures - f_res >= options.coverage * total_failures:
            break
    covered = (total_failures - f_res) / total_failures if total_failures > 0 else 0.0
    return chosen, covered


def _simpler(
    best: Scored,
    f_best: float,
    n_best: float,
    rate: float,
    everything: dict[Itemset, Scored] | None,
    chosen: list[Selected],
    recount: Callable[[list[Itemset], np.ndarray | None], tuple[np.ndarray, np.ndarray]],
    mask: np.ndarray | None,
    tester: Tester,
    options: DiagnoseOptions,
) -> tuple[Scored, float, float] | None:
    """A subset of ``best`` that explains nearly as much, nearly as sharply: the simpler
    explanation wins near-ties (its extra items only split the same rows)."""
    if not everything or len(best.items) < 2:
        return None
    subs = [
        s
        for k in range(1, len(best.items))
        for s in combinations(best.items, k)
        if s in everything and not any(set(c.scored.items) <= set(s) for c in chosen)
    ]
    if not subs:
        return None
    f, n = recount(subs, mask)
    gain_best = f_best - n_best * rate
    rate_best = f_best / n_best
    fits = [
        (len(s), -(f[i] - n[i] * rate), i)
        for i, s in enumerate(subs)
        if n[i] > 0
        and f[i] - n[i] * rate >= options.simpler * gain_best
        and f[i] / n[i] >= options.simpler * rate_best
        and tester.above(f[i], n[i], rate)
    ]
    if not fits:
        return None
    i = min(fits)[2]
    return everything[subs[i]], float(f[i]), float(n[i])
