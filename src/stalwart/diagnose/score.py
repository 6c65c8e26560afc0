"""Scoring, pruning and selection of item-sets: lift with a Wilson interval, significance-based
redundancy pruning, and a greedy cover of the failures with a stopping rule.

Notation: an item-set X has failure mass f(X) and total mass n(X) (rows, or a KPI's reference
mass); the base rate is F / N over the whole table. lift(X) = (f(X) / n(X)) / (F / N).

- *Filter*: keep X when lift >= ``min_lift`` and the Wilson lower bound of its rate, at the
  Bonferroni-corrected level alpha / (number of candidates), is above the base rate.
- *Superset rule*: drop X when, for a kept subset Y, X's rate is not significantly above the rate
  of Y \\ X (the extra items add nothing; the FDA paper's lift-ratio rule, made a test).
- *Subset rule*: drop Y when, for a kept superset X, the rate of Y \\ X is not significantly above
  the base rate (Y is elevated only because it contains X; the FDA support-ratio rule). Along a
  hierarchy, several disjoint finer findings (hosts under a rack, or under the CPU model they
  share) may explain Y together the same way, when the rest of Y is significantly below them.
- *Selection*: repeatedly take the survivor with the most attributable failures on the rows not
  yet explained, f - n * (residual rate), or (``rank_by="likelihood"``) the largest binomial
  likelihood ratio of its rate against the residual rate, re-testing it against that; stop at
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
    # superset rule; along a hierarchy only against coarser findings of no more items (a host is
    # not absorbed by a combination of the attributes it shares with another bad host)
    survivors: dict[Itemset, Scored] = {}
    absorbed: dict[Itemset, list[Scored]] = {}
    for items, c in kept.items():
        reason = _absorber(c, kept, tester, closure)
        if reason is None:
            survivors[items] = c
        elif set(reason) <= set(items):
            kept[reason].subsumed.append((items, "adds no significant lift to it"))
        else:
            absorbed.setdefault(reason, []).append(c)
    out = _subset_rule(survivors, base, tester, closure, absorbed)
    # along a hierarchy, what a dropped item-set absorbed stands again unless a kept one absorbs
    # it (a rack with two bad hosts absorbs the weaker one, then is explained by the stronger
    # one alone), and the subset rule runs again with it
    for _ in range(len(kept)):
        final = {c.items: c for c in out}
        held: dict[Itemset, list[Scored]] = {}
        back = []
        for sub, xs in absorbed.items():
            for x in xs:
                owner = sub if sub in final else _absorber(x, final, tester, closure)
                if owner is None:
                    back.append(x)
                else:
                    held.setdefault(owner, []).append(x)
        absorbed = held
        if not back:
            break
        out = _subset_rule({c.items: c for c in out + back}, base, tester, closure, absorbed)
    for sub, xs in absorbed.items():
        kept[sub].subsumed += [(x.items, "adds no significant lift to it") for x in xs]
    return out


def _absorber(
    x: Scored,
    kept: dict[Itemset, Scored],
    tester: Tester,
    closure: Callable[[Itemset], frozenset[tuple[int, str]]],
) -> Itemset | None:
    """The first item-set of ``kept`` that absorbs ``x`` (superset rule), or None."""
    return next((s for s in _subsets(x.items, closure) if _absorbs(kept.get(s), x, tester)), None)


def _absorbs(y: Scored | None, x: Scored, tester: Tester) -> bool:
    """Does ``y``, a coarser item-set of no more items, leave nothing to ``x`` inside it: is
    x's rate not significantly above the rest of y's?"""
    if y is None or len(y.items) > len(x.items):
        return False
    f_rest, n_rest = y.failures - x.failures, y.rows - x.rows
    return n_rest <= 0 or not tester.greater(x.failures, x.rows, f_rest, n_rest)


def _subset_rule(
    survivors: dict[Itemset, Scored],
    base: float,
    tester: Tester,
    closure: Callable[[Itemset], frozenset[tuple[int, str]]],
    absorbed: dict[Itemset, list[Scored]],
) -> list[Scored]:
    """Drop Y when it is elevated only through a kept superset X (of Y or of Y's closure), or,
    along a hierarchy, only through several finer findings together (``_finer_group``): kept
    ones, or ones Y absorbed by the superset rule (a rack absorbs each of its two bad hosts,
    since the other one lifts the rest of the rack)."""
    supersets: dict[Itemset, list[Scored]] = {}  # every sub-item-set of a survivor's closure
    for c in survivors.values():
        for sub in _subsets(c.items, closure):
            supersets.setdefault(sub, []).append(c)
    out = []
    for items, y in survivors.items():
        finer = supersets.get(items, [])
        explained_by = next(
            (x for x in finer if not tester.above(y.failures - x.failures, y.rows - x.rows, base)),
            None,
        )
        if explained_by is not None:
            explained_by.subsumed.append((items, "elevated only through it"))
            continue
        group = _finer_group(y, finer + absorbed.get(items, []), base, tester)
        if not group:
            out.append(y)
        for x in group:
            x.subsumed.append((items, f"elevated only through it and {len(group) - 1} like it"))
    return out


def _finer_group(y: Scored, finer: list[Scored], base: float, tester: Tester) -> list[Scored]:
    """Findings finer than ``y`` along a hierarchy (``y`` lies in their closure, not in their
    items: hosts under a rack, or under the CPU model they share) that explain it together:
    disjoint (one set of columns, other values), at least two, and the rest of its rows not
    above the base rate; besides, the rest significantly below theirs, or each of them fewer
    items than ``y`` (a combination of the attributes two bad hosts share is those hosts).
    Empty when none do. Otherwise the coarse value is the simpler explanation: a bad kernel
    shows on every host that runs it, and with enough runs every such host is a finding."""
    groups: dict[tuple[int, ...], list[Scored]] = {}
    for x in finer:
        if not set(y.items) <= set(x.items):
            groups.setdefault(tuple(c for c, _ in x.items), []).append(x)
    for columns in sorted(groups, key=len):
        xs = groups[columns]
        f, n = sum(x.failures for x in xs), sum(x.rows for x in xs)
        f_rest, n_rest = y.failures - f, y.rows - n
        if len(xs) < 2 or tester.above(f_rest, n_rest, base):
            continue
        if len(columns) < len(y.items) or tester.greater(f, n, f_rest, n_rest):
            return xs
    return []


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
        explained = options.rank_by in (None, "explained")
        order = _ranked(gain if explained else _likelihood(f, n, rate), pool)
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


def _ranked(score: np.ndarray, pool: list[Scored]) -> list[int]:
    """Indices of ``pool``, highest ``score`` first, ties in the order of their items: the same
    findings in the same order however the input's rows are ordered."""
    return sorted(range(len(pool)), key=lambda i: (-float(score[i]), pool[i].items))


def _likelihood(f: np.ndarray, n: np.ndarray, rate: float) -> np.ndarray:
    """Log-likelihood ratio of each item-set's own rate f / n against ``rate`` (binomial; 0
    where its rate is not above it): Kulldorff's scan statistic."""
    f, n = np.asarray(f, dtype=np.float64), np.asarray(n, dtype=np.float64)
    p = np.clip(np.divide(f, n, out=np.zeros_like(f), where=n > 0), 0.0, 1.0)
    r = min(max(rate, 1e-12), 1 - 1e-12)
    with np.errstate(divide="ignore", invalid="ignore"):
        inside = np.where(f > 0, f * np.log(np.maximum(p, 1e-300) / r), 0.0)
        outside = np.where(n - f > 0, (n - f) * np.log(np.maximum(1 - p, 1e-300) / (1 - r)), 0.0)
    return np.where(p > r, inside + outside, 0.0)


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
