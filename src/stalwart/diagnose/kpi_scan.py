"""The KPI search's second stage: small, deep causes found by how unlikely their concentration of
abnormal leaves is, not by how much of the deviation they explain.

A cause spanning three or four attributes covers a handful of leaves and can explain well under
1% of the total deviation when broad causes dominate it; an explanatory-power floor (RiskLoc's 2%,
the first stage's ``min_ep``) never lets it through, yet its leaves all lie beyond the noise cut,
where forecast noise puts only a few leaves of the whole cube (the cut is the noise extreme of
the other side). So once the first stage stops, every element of the leaves left is scored by a
scan statistic (Kulldorff's, with the binomial likelihood ratio): with ``q`` the share of the
remaining leaves beyond the cut, an element holding ``k`` of its ``n`` leaves beyond it scores
``n KL(k/n || q)`` nats, less the log of the number of elements in its layer (a Bonferroni
charge for looking at all of them). The most significant element wins whatever its layer: a
parent dilutes the same ``k`` in more leaves, a child holds fewer of them, so the score peaks at
the element the anomaly was injected at. It must still pass the first stage's risk bar (purity
less ripple misfit) and hold at least ``scan_min`` abnormal leaves (one leaf beyond the cut is
as likely noise as not).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from stalwart.diagnose.kpi_scores import (
    Cause,
    SearchParams,
    State,
    describe,
    element_mask,
    ripple_misfit,
)
from stalwart.diagnose.kpi_sums import ElementSums

__all__ = ["scan"]


def _kl(a: np.ndarray, q: float) -> np.ndarray:
    """Bernoulli KL divergence KL(a || q), elementwise."""
    a = np.clip(a, 1e-12, 1.0)
    one = np.where(a < 1.0, (1.0 - a) * np.log(np.maximum(1.0 - a, 1e-12) / (1.0 - q)), 0.0)
    return a * np.log(a / q) + one


def _layer_sizes(st: State, sums: ElementSums, depth: int) -> list[float]:
    """log of the number of elements per layer (1..depth), each cuboid's bounded by the leaves."""
    out = [0.0]
    for layer in range(1, depth + 1):
        total = 0
        for cols in itertools.combinations(range(len(sums.cards)), layer):
            total += min(math.prod(sums.cards[c] for c in cols), len(sums.codes))
        out.append(math.log(max(total, 1)))
    return out


def _best(
    st: State, sums: ElementSums, depth: int, q: float, log_m: list[float], p: SearchParams
) -> tuple[float, tuple[tuple[int, int], ...]] | None:
    """The most significant element passing the risk bar: (score, its (column, code) pairs);
    not its cuboid's per-leaf ids, which the next cuboid's would join in memory."""
    best: tuple[float, tuple[tuple[int, int], ...]] | None = None
    for layer in range(1, depth + 1):
        for cols in itertools.combinations(range(len(sums.cards)), layer):
            ids, n, (ep, w_ab, w_all, moved, count, k) = sums.get(st, cols)
            ok = (k >= p.scan_min) & (ep > 0) & (k > q * count)
            if not ok.any():
                continue
            s = np.full(n, -np.inf)
            s[ok] = count[ok] * _kl(k[ok] / count[ok], q) - log_m[layer]
            floor = max(p.scan_nats, best[0] if best else -np.inf)
            ok &= s > floor
            if not ok.any():
                continue
            purity = np.maximum(w_ab / (w_all + p.prior), moved / (count + p.balance_prior))
            ok &= purity >= p.risk
            if not ok.any():
                continue
            risk = np.full(n, -np.inf)
            risk[ok] = purity[ok] - p.misfit_weight * ripple_misfit(st, ids(), n, ok[ids()])[ok]
            s = np.where(risk >= p.risk, s, -np.inf)
            e = int(np.argmax(s))
            if s[e] > floor:
                codes = sums.element_codes(st, cols, ids, e)
                best = (float(s[e]), tuple(zip(cols, codes, strict=True)))
    return best


def _far(st: State, far: float, p: SearchParams, total_ep: float, room: int) -> list[Cause]:
    """Single leaves moved ``far`` or more the anomaly's way (oriented deviation), largest share
    of the deviation first, each as the element of all its attributes."""
    out: list[Cause] = []
    near = np.flatnonzero((st.ep > 0) & (st.x >= far))
    for i in near[np.argsort(-st.ep[near], kind="stable")]:
        if len(out) >= room:
            break
        cause = describe(st, tuple(enumerate(int(v) for v in st.codes[i])), total_ep, p)
        if cause.purity - cause.misfit >= p.risk:
            out.append(cause)
    return out


def scan(
    st: State,
    sums: ElementSums,
    depth: int,
    p: SearchParams,
    total_ep: float,
    room: int,
    cut: float,
) -> list[Cause]:
    """Up to ``room`` more causes from the live leaves ``st`` (their sums in ``sums``, which
    this updates), the most significant first, each one's leaves removed before the next; then
    single leaves beyond ``scan_far`` times the noise cut ``cut``."""
    live = float(np.abs(st.moved).sum())
    q = float((st.w_abnormal > 0).sum()) / max(live, 1.0)
    if p.scan_nats == math.inf or q <= 0.0 or q >= 0.5:
        return []
    log_m = _layer_sizes(st, sums, depth)
    causes: list[Cause] = []
    while len(causes) < room:
        got = _best(st, sums, depth, q, log_m, p)
        if got is None:
            break
        items = got[1]
        causes.append(describe(st, items, total_ep, p))
        mask = element_mask(st, items)
        sums.remove(st, mask)
        st.shrink(~mask)
    if p.scan_far < math.inf and cut > 0:
        causes += _far(st, p.scan_far * cut, p, total_ep, room - len(causes))
    return causes
