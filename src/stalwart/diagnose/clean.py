"""Automatic, reported cleaning of attribute columns, expressed as DuckDB SQL.

Each attribute column becomes one VARCHAR expression: NULL becomes the value ``(null)``, a numeric
column with many distinct values becomes quantile buckets, a high-cardinality categorical column
keeps its values that could matter and folds the rest into ``other``, and an ID-like column
(distinct values above ``id_share`` of the rows, the FDA paper's variability filter) is dropped.
Every decision is recorded as a ``CleaningStep`` so the report can say what was done.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass

from stalwart.diagnose.options import DiagnoseOptions
from stalwart.diagnose.quoting import identifier, literals
from stalwart.diagnose.source import Source

__all__ = ["CleanPlan", "CleaningStep", "bucket_labels", "id_like", "plan_cleaning"]

log = logging.getLogger(__name__)

NULL_VALUE = "(null)"
OTHER_VALUE = "other"
_NUMERIC = (
    "TINYINT",
    "SMALLINT",
    "INTEGER",
    "BIGINT",
    "HUGEINT",
    "UTINYINT",
    "USMALLINT",
    "UINTEGER",
    "UBIGINT",
    "FLOAT",
    "DOUBLE",
    "DECIMAL",
    "REAL",
)
_INTEGER = _NUMERIC[:9]
_MAX_KEPT = 5000  # values kept per folded column; beyond this the IN list gets slow


@dataclass(frozen=True)
class CleaningStep:
    """One cleaning decision: ``action`` is dropped, bucketed, folded, nulls or kept."""

    column: str
    action: str
    detail: str


@dataclass(frozen=True)
class CleanPlan:
    """The attribute columns kept and the SQL expression that cleans each of them."""

    columns: tuple[str, ...]
    exprs: tuple[str, ...]
    steps: tuple[CleaningStep, ...]
    unfolded: tuple[str, ...] = ()
    """Each expression before rare values are folded into ``other``: equal to it on every
    value that is kept, and much cheaper to evaluate."""
    rows: int = 0
    total_target: float = 0.0
    """Summed failure mass of the whole input."""
    total_reference: float = 0.0
    """Summed total mass (rows, or weights) of the whole input."""


def _is_numeric(sql_type: str) -> bool:
    return sql_type.upper().startswith(_NUMERIC)


def _fmt(x: float, digits: int = 4) -> str:
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.{digits}g}"


def plan_cleaning(
    src: Source,
    attributes: list[str],
    *,
    target_sql: str,
    weight_sql: str,
    options: DiagnoseOptions,
) -> CleanPlan:
    """Profile ``attributes`` in one scan and decide how to clean each.

    ``target_sql`` is the per-row failure mass (0 for a non-failure) and ``weight_sql`` the
    per-row weight; both are used to keep the values that could still reach ``min_support``.
    """
    steps: list[CleaningStep] = []
    parts = ["count(*)", f"sum({weight_sql})", f"sum({target_sql})"]
    for c in attributes:
        parts += [f"approx_count_distinct({identifier(c)})", f"count(*) - count({identifier(c)})"]
    row = src.sql(f"SELECT {', '.join(parts)} FROM {{src}}").fetchall()[0]
    assert row is not None
    n_rows = int(row[0])
    failures = float(row[2] or 0.0)
    cols: list[str] = []
    exprs: list[str] = []
    unfolded: list[str] = []
    for i, c in enumerate(attributes):
        distinct, nulls = int(row[3 + 2 * i] or 0), int(row[4 + 2 * i] or 0)
        sql_type = src.types.get(c, "VARCHAR")
        q = identifier(c)
        if nulls:
            steps.append(CleaningStep(c, "nulls", f"{nulls} empty value(s) kept as {NULL_VALUE}"))
        if distinct + (1 if nulls else 0) <= 1:
            steps.append(CleaningStep(c, "dropped", "a single value in every row"))
            continue
        keep = c in options.keep
        numeric = _is_numeric(sql_type)
        integer = sql_type.upper().startswith(_INTEGER)
        if not keep and id_like(distinct, n_rows, numeric, integer, options):
            steps.append(
                CleaningStep(c, "dropped", f"ID-like: {distinct} distinct values in {n_rows} rows")
            )
            continue
        if numeric and distinct > options.max_values and not keep:
            expr, detail = _bucket(src, c, sql_type, options.buckets)
            if expr is not None:
                steps.append(CleaningStep(c, "bucketed", detail))
                cols.append(c)
                exprs.append(expr)
                unfolded.append(expr)
                continue
        base = f"coalesce(CAST({q} AS VARCHAR), '{NULL_VALUE}')"
        unfolded.append(base)
        if distinct > options.max_values and not keep:
            base, detail = _fold(src, c, base, n_rows, failures, target_sql, weight_sql, options)
            if detail:
                steps.append(CleaningStep(c, "folded", detail))
        cols.append(c)
        exprs.append(base)
    return CleanPlan(
        tuple(cols),
        tuple(exprs),
        tuple(steps),
        tuple(unfolded),
        n_rows,
        failures,
        float(row[1] or 0.0),
    )


def id_like(
    distinct: int, n_rows: int, numeric: bool, integer: bool, options: DiagnoseOptions
) -> bool:
    """Whether a column is ID-like (dropped): more distinct values than ``id_share`` of the
    rows and ``id_min_distinct``; a number only when it is an integer nearly unique per row
    (other numbers are bucketed instead). Shared with the Spark engine."""
    if distinct <= max(options.id_share * n_rows, options.id_min_distinct):
        return False
    return not numeric or (integer and distinct > 0.5 * n_rows)


def bucket_labels(quantiles: list[float]) -> tuple[list[float], list[str]]:
    """The distinct finite bucket edges among ``quantiles``, ascending, and the label of each
    bucket (one more than the edges): ``< a``, ``[a, b)``, ..., ``>= z``. Shared with the Spark
    engine, so both engines name a bucket alike."""
    edges = sorted({float(e) for e in quantiles if e is not None and math.isfinite(e)})
    if not edges:
        return [], []
    for digits in (4, 6, 9, 12, 17):  # as few digits as keep every edge apart (17: any two)
        shown = [_fmt(e, digits) for e in edges]
        if len(set(shown)) == len(shown):
            break
    labels = [f"< {shown[0]}"]
    labels += [f"[{a}, {b})" for a, b in itertools.pairwise(shown)]
    labels.append(f">= {shown[-1]}")
    return edges, labels


def _bucket(src: Source, column: str, sql_type: str, buckets: int) -> tuple[str | None, str]:
    q = identifier(column)
    probs = [k / buckets for k in range(1, buckets)]
    row = src.sql(
        f"SELECT quantile_cont(CAST({q} AS DOUBLE), {probs}) FROM {{src}} WHERE {q} IS NOT NULL"
    ).fetchall()[0]
    edges, labels = bucket_labels(row[0] if row and row[0] else [])
    if not edges:
        return None, ""
    cases = [f"WHEN {q} IS NULL THEN '{NULL_VALUE}'"]
    cases += [f"WHEN {q} < {e!r} THEN '{lab}'" for e, lab in zip(edges, labels, strict=False)]
    expr = f"CASE {' '.join(cases)} ELSE '{labels[-1]}' END"
    return expr, f"{len(labels)} quantile buckets ({', '.join(labels)})"


def _fold(
    src: Source,
    column: str,
    base: str,
    n_rows: int,
    failures: float,
    target_sql: str,
    weight_sql: str,
    options: DiagnoseOptions,
) -> tuple[str, str]:
    # A value is kept when it is common, or when its failures could reach min_support: folding
    # the others loses no frequent item-set, and shrinks the aggregate.
    min_rows = options.rare_share * n_rows
    min_fail = options.min_support * failures
    rows = src.sql(
        f"SELECT v, r, t FROM (SELECT {base} AS v, sum({weight_sql}) AS r, sum({target_sql}) AS t "
        f"FROM {{src}} GROUP BY 1) WHERE r >= {min_rows!r} OR t >= {min_fail!r} "
        f"ORDER BY t DESC, r DESC LIMIT {_MAX_KEPT + 1}"
    ).fetchall()
    kept = [str(r[0]) for r in rows[:_MAX_KEPT]]
    if OTHER_VALUE in kept:
        kept.remove(OTHER_VALUE)
    if not kept:
        return f"'{OTHER_VALUE}'", "every value rare; all folded into 'other'"
    expr = f"CASE WHEN {base} IN ({literals(kept)}) THEN {base} ELSE '{OTHER_VALUE}' END"
    return expr, f"kept {len(kept)} values, folded the rarer ones into '{OTHER_VALUE}'"
