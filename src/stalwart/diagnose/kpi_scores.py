"""The KPI search's leaves and per-element scores: each leaf's deviation score, the noise cut and
the abnormal partition, an element's purity (RiskLoc's weighted risk, or the balance of moved
leaves), its ripple misfit (HotSpot/Squeeze) and explanatory power (Adtributor)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stalwart.diagnose.options import DiagnoseOptions, EngineTuning
from stalwart.diagnose.score import finding_confidence

__all__ = [
    "Cause",
    "KpiLeaves",
    "SearchParams",
    "State",
    "describe",
    "deviation",
    "element_mask",
    "ripple_misfit",
    "noise_cut",
    "prepare",
]

TINY = 1e-12
_OPTIONS = DiagnoseOptions()  # the defaults of the knobs SearchParams takes from the options


@dataclass(frozen=True)
class KpiLeaves:
    """One row per leaf: attribute codes, the KPI's actual and forecast value, and each leaf's
    explanatory power (its share of the total deviation; sums to 1)."""

    codes: np.ndarray
    """(leaves, attributes) integer codes, 0..cards[j]-1 in column j."""
    cards: tuple[int, ...]
    real: np.ndarray
    predict: np.ndarray
    ep: np.ndarray
    direction: float
    """+1 when the KPI's total is above its forecast, -1 below (the deviation to explain)."""
    ratio: bool = False


@dataclass(frozen=True)
class SearchParams:
    """The search's knobs: those a user sets come from ``DiagnoseOptions`` (``from_options``;
    its defaults are theirs), the rest were trained here and are documented one by one."""

    risk: float = _OPTIONS.kpi_risk
    min_ep: float = _OPTIONS.kpi_min_ep
    merge: float = _OPTIONS.kpi_merge
    merge_ratio: float = _OPTIONS.kpi_merge_ratio
    trim: int = _OPTIONS.kpi_trim
    max_depth: int | None = _OPTIONS.kpi_max_depth
    max_causes: int = _OPTIONS.max_findings
    tuning: EngineTuning = _OPTIONS.tuning
    """How element sums are kept (``kpi_cache_ids``, ``kpi_dense_cells``): speed, not causes."""
    prior: float = 1.0
    balance_prior: float = 3.0
    balance_leaves: int = 30
    """An element with no leaf beyond the noise cut is scored on its balance of moved leaves
    when at least this many of its leaves moved (a broad cause whose leaves all moved less than
    the noise extreme); trained on S-7301, L-7302, RS-A (10: 0.767, 20/30/50: 0.773 mean F1)."""
    stop_share: float = 0.05
    """A further cause must explain at least this share of the largest cause found: single
    noise leaves beyond the cut come last, with a sliver each (trained: 0.03 / 0.05 / 0.08 gave
    0.769 / 0.773 / 0.767 mean F1)."""
    ratio_misfit: float = 0.2
    """Weight of the ripple misfit for a ratio KPI: a failure does not scale a success rate's
    leaves by one factor, so the ripple fit says less there (trained: 0.15 / 0.2 / 0.3 / 0.5 /
    1.0 gave 0.765 / 0.786 / 0.765 / 0.772 / 0.735 mean F1)."""
    scan_nats: float = 10.0
    """Second stage (``kpi_scan``): an element's scan statistic must exceed this many nats after
    the charge for its layer's size (``inf``: no second stage; trained: 5 / 10 / 15 / 20 gave
    0.829 / 0.830 / - / 0.826 mean F1, off 0.754 without far leaves)."""
    scan_min: int = 2
    """Second stage: an element must hold at least this many leaves beyond the noise cut."""
    scan_far: float = 1.5
    """Second stage: a single leaf moved this many times the noise cut the anomaly's way is a
    cause on its own (the cut is the noise extreme of the other side; trained: 1.0 / 1.25 /
    1.5 / 2 / 3 / off gave 0.767 / 0.821 / 0.830 / 0.826 / 0.818 / 0.790 mean F1)."""
    scan_far_ratio: float = float("inf")
    """``scan_far`` for a ratio KPI, whose small leaves (few requests) swing far by chance: the
    cut, set by the whole cube, does not bound one small leaf's noise."""
    misfit_weight: float = 1.0
    """Weight of the ripple misfit in use (``ratio_misfit`` for a ratio KPI, set by ``search``)."""

    @classmethod
    def from_options(cls, opts: DiagnoseOptions) -> SearchParams:
        """The search's knobs from the analysis' options (``kpi_*``, ``max_findings``,
        ``tuning``); the trained ones keep their defaults."""
        return cls(
            risk=opts.kpi_risk,
            min_ep=opts.kpi_min_ep,
            merge=opts.kpi_merge,
            merge_ratio=opts.kpi_merge_ratio,
            trim=opts.kpi_trim,
            max_depth=opts.kpi_max_depth,
            max_causes=opts.max_findings,
            tuning=opts.tuning,
        )


@dataclass(frozen=True)
class Cause:
    """One element found: (column index, value code) pairs and its scores."""

    items: tuple[tuple[int, int], ...]
    ep: float
    """Share of the abnormal deviation the element explains."""
    purity: float
    misfit: float
    confidence: float
    real: float
    predict: float
    leaves: int


def deviation(real: np.ndarray, predict: np.ndarray) -> np.ndarray:
    """Each leaf's deviation score 2(f - v)/(|f| + |v|): Squeeze's 2(f - v)/(f + v) for a
    non-negative KPI; in magnitudes, so a negative KPI (net margin, balance) keeps the sign of
    f - v and the bound of 2, and a value that crosses zero scores the full 2."""
    s = np.abs(real) + np.abs(predict)
    return np.divide(2.0 * (predict - real), s, out=np.zeros_like(s), where=s > TINY)


def noise_cut(x: np.ndarray, trim: int) -> float:
    """The noise cut for deviations ``x`` oriented so the anomaly is positive: forecast noise
    moves leaves both ways alike, so the extreme of those moved against the anomaly, ``trim``
    places in (fewer when there are few), bounds the noise."""
    against = -x[x < 0]
    want = 2 * trim + 1  # with this many distinct values the cut is the (trim + 1)-th largest
    if len(against) > 64 * want:  # the largest values, without sorting them all
        top = np.unique(np.partition(against, len(against) - 64 * want)[-64 * want :])
        if len(top) >= want:
            return float(top[-1 - trim])
    against = np.unique(against)
    if len(against) == 0:
        return 0.0
    return float(against[-1 - min(trim, (len(against) - 1) // 2)])


@dataclass
class State:
    """Per-leaf arrays of the live (not yet explained) leaves."""

    codes: np.ndarray
    real: np.ndarray
    predict: np.ndarray
    ep: np.ndarray
    w_abnormal: np.ndarray
    """Weight of an abnormal leaf (0 for a normal one): how far it lies beyond the cut."""
    w_all: np.ndarray
    moved: np.ndarray
    """+1 for a leaf moved the anomaly's way, -1 against it, 0 unmoved (int8)."""
    nonzero: np.ndarray
    """Whether both the actual and the forecast value are non-zero (bool)."""
    x: np.ndarray
    """Deviation oriented so the anomaly is positive (the deviation times -direction, so
    its absolute value is the deviation's)."""
    index: np.ndarray
    """Each live leaf's position among all leaves."""

    def keep(self, mask: np.ndarray) -> State:
        return State(*(getattr(self, k)[mask] for k in self.__dataclass_fields__))

    def shrink(self, mask: np.ndarray) -> None:
        """Keep only the leaves in ``mask``, in place: one array at a time, so the live leaves
        are never held twice."""
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k)[mask])

    def abnormal_ep(self) -> float:
        return float(self.ep[self.w_abnormal > 0].sum())


def prepare(leaves: KpiLeaves, trim: int, *, noise: bool = True) -> tuple[State, float]:
    dev = deviation(leaves.real, leaves.predict)
    sign = -leaves.direction  # dev > 0 is a drop
    x = sign * dev
    cut = noise_cut(x, trim) if noise else 0.0
    abnormal = x > cut
    zero = (leaves.real == 0) & (leaves.predict == 0)
    w_ab = np.where(abnormal, np.minimum(np.abs(x), 1.0), 0.0)
    w_no = np.where(abnormal | zero, 0.0, np.minimum(np.abs(cut - x), 1.0))
    ep = leaves.ep
    if float(ep[abnormal].sum()) < 0:
        ep = -ep
    del dev, abnormal, zero
    w_no += w_ab
    nonzero = (leaves.real != 0) & (leaves.predict != 0)
    codes = np.ascontiguousarray(leaves.codes)
    index = np.arange(len(codes), dtype=np.min_scalar_type(max(len(codes) - 1, 0)))
    moved = np.sign(x).astype(np.int8)
    state = State(codes, leaves.real, leaves.predict, ep, w_ab, w_no, moved, nonzero, x, index)
    return state, sign * cut


def ripple_misfit(st: State, ids: np.ndarray, n: int, leaf: np.ndarray) -> np.ndarray:
    """Ripple fit: scale every leaf by its element's own actual/forecast ratio (leaves with both
    values non-zero: a zero says nothing about relative change) and compare the deviation left
    with the deviation from forecast."""
    ids, nz = ids[leaf], st.nonzero[leaf]
    real, predict = st.real[leaf], st.predict[leaf]
    w = real * nz
    v = np.bincount(ids, weights=w, minlength=n)
    f = np.bincount(ids, weights=np.multiply(predict, nz, out=w), minlength=n)
    del w
    scale = np.divide(v, f, out=np.ones_like(v), where=np.abs(f) > TINY)  # a negative KPI too
    moved = scale[ids]
    moved *= predict  # the leaves' forecast scaled by their element's ratio
    del predict
    m1 = np.bincount(ids, weights=_abs_deviation(real, moved, nz), minlength=n)
    del real, moved
    x = st.x[leaf]
    m2 = np.bincount(ids, weights=np.multiply(np.abs(x, out=x), nz, out=x), minlength=n)
    return np.divide(m1, m2, out=np.zeros_like(m1), where=m2 > TINY)


def _abs_deviation(real: np.ndarray, predict: np.ndarray, nz: np.ndarray) -> np.ndarray:
    """``abs(deviation(real, predict)) * nz``, overwriting ``predict`` (the same values,
    without ``deviation``'s leaf-sized temporaries)."""
    s = np.abs(real) + np.abs(predict)
    d = np.subtract(predict, real, out=predict)
    d *= 2.0
    ok = s > TINY
    np.divide(d, s, out=d, where=ok)
    d[~ok] = 0.0
    np.abs(d, out=d)
    d *= nz
    return d


def element_mask(st: State, items: tuple[tuple[int, int], ...]) -> np.ndarray:
    mask = np.ones(len(st.codes), dtype=bool)
    for c, v in items:
        mask &= st.codes[:, c] == v
    return mask


def describe(
    st: State, items: tuple[tuple[int, int], ...], total_ep: float, p: SearchParams
) -> Cause:
    """The scores of one element over the leaves of ``st``."""
    mask = np.ones(len(st.codes), dtype=bool)
    for c, v in items:
        mask &= st.codes[:, c] == v
    w_ab, w_all = float(st.w_abnormal[mask].sum()), float(st.w_all[mask].sum())
    moved, count = float(st.moved[mask].sum()), float(np.abs(st.moved[mask]).sum())
    purity = w_ab / (w_all + p.prior)
    if w_ab > 0 or count >= p.balance_leaves:
        purity = max(purity, moved / (count + p.balance_prior))
    one = np.zeros(len(mask), dtype=np.int64)
    misfit = p.misfit_weight * float(ripple_misfit(st, one, 1, mask)[0])
    return Cause(
        items=items,
        ep=float(st.ep[mask].sum()) / total_ep,
        purity=purity,
        misfit=misfit,
        confidence=finding_confidence(purity, misfit),
        real=float(st.real[mask].sum()),
        predict=float(st.predict[mask].sum()),
        leaves=int(mask.sum()),
    )
