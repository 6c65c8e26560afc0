"""``localize``'s pipeline: clean the attributes, one row per cleaned leaf with its KPI columns
summed (DuckDB GROUP BY), the leaf-level search of ``kpi_search``, and findings.

The search reads each leaf's raw actual and forecast values (not clipped deviation masses): the
forecast noise is estimated from the leaves that moved *against* the deviation, so both signs
must reach it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow.compute as pc

from stalwart.diagnose.clean import plan_cleaning
from stalwart.diagnose.kpi_search import KpiLeaves, Localized, SearchParams, kpi_leaves, search
from stalwart.diagnose.options import DiagnoseOptions
from stalwart.diagnose.result import Diagnosis, Finding
from stalwart.diagnose.source import Source, quote
from stalwart.diagnose.target import Masses

__all__ = ["localize_kpi"]


def localize_kpi(
    src: Source,
    actual: str | tuple[str, str],
    expected: str | tuple[str, str],
    attrs: list[str],
    masses: Masses,
    opts: DiagnoseOptions,
) -> Diagnosis:
    """Localize the KPI's deviation over ``attrs`` (already checked against the source)."""
    start = time.perf_counter()
    mode = "kpi-additive" if isinstance(actual, str) else "kpi-ratio"
    plan = plan_cleaning(
        src, attrs, target_sql=masses.target, weight_sql=masses.reference, options=opts
    )
    kw: dict[str, Any] = {
        "cleaning": [
            {"column": s.column, "action": s.action, "detail": s.detail} for s in plan.steps
        ],
        "notes": list(src.notes),
    }
    if not plan.columns:
        msg = (
            "every attribute column was dropped by cleaning (see cleaning); name columns to "
            "keep with keep=[...]"
        )
        return Diagnosis([], mode, 0.0, 0.0, 0, (), message=msg, **kw)
    kpi = [actual] if isinstance(actual, str) else list(actual)
    kpi += [expected] if isinstance(expected, str) else list(expected)
    leaves, k, values = _leaves(src, plan.exprs, kpi)
    prepared = time.perf_counter()
    found = search(leaves, params(opts))
    done = time.perf_counter()
    kw["timings_s"] = {"prepare": round(prepared - start, 4), "search": round(done - prepared, 4)}
    findings = _findings(found, leaves, k, plan.columns, values)
    if found.fallback:
        kw["notes"].append(
            "no element passed the risk bar (kpi_risk): the best-scoring one is shown, with "
            "its low confidence"
        )
    total_t, total_r = _masses(k, np.ones(len(leaves.codes), dtype=bool))
    none = "nothing found: no leaf moved away from its forecast the way the total did"
    return Diagnosis(
        findings,
        mode,
        total_t,
        total_r,
        len(leaves.codes),
        plan.columns,
        candidates=len(found.causes),
        covered=float(min(1.0, sum(max(c.ep, 0.0) for c in found.causes))),
        message="" if findings else none,
        confidence=found.confidence,
        **kw,
    )


def _leaves(
    src: Source, exprs: tuple[str, ...], kpi: list[str]
) -> tuple[KpiLeaves, list[np.ndarray], list[list[str]]]:
    """One row per cleaned leaf (GROUP BY the cleaned attributes, KPI columns summed): the
    leaves, the KPI sums per leaf, and each attribute's values by code."""
    sel = ", ".join(f"{e} AS a{i}" for i, e in enumerate(exprs))
    sums = ", ".join(
        f"sum(coalesce(CAST({quote(c)} AS DOUBLE), 0)) AS k{i}" for i, c in enumerate(kpi)
    )
    table = src.sql(f"SELECT {sel}, {sums} FROM {{src}} GROUP BY ALL").to_arrow_table()
    n_attr = len(exprs)
    codes = np.empty((table.num_rows, n_attr), dtype=np.int64)
    values: list[list[str]] = []
    for i in range(n_attr):
        enc = pc.dictionary_encode(table.column(i)).combine_chunks()
        codes[:, i] = enc.indices.to_numpy(zero_copy_only=False)
        values.append([str(v) for v in enc.dictionary.to_pylist()])
    k = [table.column(n_attr + i).to_numpy().astype(np.float64) for i in range(len(kpi))]
    half = len(k) // 2
    cards = tuple(max(len(v), 1) for v in values)
    return kpi_leaves(codes, cards, tuple(k[:half]), tuple(k[half:])), k, values


def params(opts: DiagnoseOptions) -> SearchParams:
    """The search's knobs from the analysis' options."""
    return SearchParams(
        risk=opts.kpi_risk,
        min_ep=opts.kpi_min_ep,
        trim=opts.kpi_trim,
        max_depth=opts.kpi_max_depth,
        max_causes=opts.max_findings,
    )


def _masses(k: list[np.ndarray], mask: np.ndarray) -> tuple[float, float]:
    """(deviation, reference) masses of the leaves in ``mask``: |actual - forecast| and the
    forecast for an additive KPI; for a ratio, the numerator lost or gained against the
    forecast ratio, and the actual denominator."""
    s = [float(x[mask].sum()) for x in k]
    if len(s) == 2:
        return abs(s[0] - s[1]), s[1]
    an, ad, en, ed = s
    ratio = en / ed if ed else 0.0
    return abs(an - ad * ratio), ad


def _findings(
    found: Localized,
    leaves: KpiLeaves,
    k: list[np.ndarray],
    columns: tuple[str, ...],
    values: list[list[str]],
) -> list[Finding]:
    total_t, total_r = _masses(k, np.ones(len(leaves.codes), dtype=bool))
    base = total_t / total_r if total_r > 0 else 0.0
    out = []
    for c in found.causes:
        mask = np.ones(len(leaves.codes), dtype=bool)
        for col, v in c.items:
            mask &= leaves.codes[:, col] == v
        t, r = _masses(k, mask)
        lift = (t / r) / base if r > 0 and base > 0 else 0.0
        out.append(
            Finding(
                items={columns[col]: values[col][v] for col, v in c.items},
                failures=t,
                rows=r,
                support=t / total_t if total_t > 0 else 0.0,
                lift=lift,
                lift_low=lift,
                lift_high=lift,
                explained=c.ep,
                confidence=c.confidence,
            )
        )
    return out
