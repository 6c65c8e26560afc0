"""Automatic, reported cleaning of attribute columns, expressed as DuckDB SQL.

Each attribute column becomes one VARCHAR expression: NULL (and a float's NaN, as missing) becomes
the value ``(null)``, a numeric column with more than ``max_values`` distinct values becomes
quantile buckets, a categorical one keeps its values that could matter and folds the rest into
``other``, and an ID-like column (distinct values above ``id_share`` of the rows, the FDA paper's
variability filter) is dropped. Every decision is recorded as a ``CleaningStep`` so the report
can say what was done.

Decisions rest on exact distinct counts: the profiling scan estimates them (HyperLogLog, a few
percent off) and a second scan counts exactly the columns whose estimate lies near a threshold
(``needs_exact``). A label never merges with a real value: a column holding the text ``(null)``
or ``other`` gets ``(null value)`` or ``other (folded)`` instead (``free_label``).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from stalwart.diagnose.mining import support_floor
from stalwart.diagnose.options import DiagnoseOptions
from stalwart.diagnose.quoting import identifier, literal, literals
from stalwart.diagnose.source import Source

__all__ = [
    "ALTERNATIVE_LABELS",
    "CleanPlan",
    "CleaningStep",
    "bucket_labels",
    "bucket_probes",
    "free_label",
    "id_like",
    "is_nan",
    "needs_exact",
    "plan_cleaning",
]

log = logging.getLogger(__name__)

NULL_VALUE = "(null)"
"""The value NULL takes, unless the column holds this text (``free_label``)."""
OTHER_VALUE = "other"
"""The value rare values fold into, unless the column holds this text (``free_label``)."""
ALTERNATIVE_LABELS = {NULL_VALUE: "(null value)", OTHER_VALUE: "other (folded)"}
"""The label used instead of each when a column holds it; numbered (``#2``...) if taken too."""
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
_FLOAT = ("FLOAT", "DOUBLE", "REAL")
_NOT_TEXT = ("BOOLEAN", "DATE", "TIME", "INTERVAL", "UUID")  # as text never a label
_MAX_KEPT = 5000  # values kept per folded column; beyond this the IN list gets slow
_ESTIMATE_ERROR = 1.25  # HyperLogLog estimates measured within 10% of the count; margin beyond


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
    value that is kept, and much cheaper to evaluate. A column whose fold label is not
    ``OTHER_VALUE`` (it holds the text ``other``) has its folded expression here too: readers
    test for ``OTHER_VALUE`` to know when folding matters."""
    rows: int = 0
    total_target: float = 0.0
    """Summed failure mass of the whole input."""
    total_reference: float = 0.0
    """Summed total mass (rows, or weights) of the whole input."""


def is_nan(x: str) -> str:
    """SQL: whether the number ``x`` is NaN. Not ``isnan``: DuckDB folds that to false where
    a Parquet file's statistics claim no NaN, as PyArrow's do whatever the file holds
    (duckdb/duckdb#25521); ``isfinite`` and ``isinf`` are evaluated row by row."""
    return f"(NOT isfinite({x}) AND NOT isinf({x}))"


def _fmt(x: float, digits: int = 4) -> str:
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.{digits}g}"


def free_label(label: str, taken: Collection[str]) -> str:
    """``label`` (``NULL_VALUE`` or ``OTHER_VALUE``), or when the column holds that text, the
    first of its alternative (``ALTERNATIVE_LABELS``), ``alternative #2``, ``#3``... that it
    does not hold: a label never merges with a real value. ``taken`` holds the column's values
    equal to ``label`` or starting with its alternative. Shared with the Spark engine."""
    alt = ALTERNATIVE_LABELS[label]
    names = itertools.chain((label, alt), (f"{alt} #{k}" for k in itertools.count(2)))
    return next(n for n in names if n not in taken)


def _collides(text: str) -> str:
    """SQL: whether the VARCHAR ``text`` is a value ``free_label`` must avoid."""
    starts = " OR ".join(f"starts_with({text}, {literal(a)})" for a in ALTERNATIVE_LABELS.values())
    return f"{text} IN ({literals(ALTERNATIVE_LABELS)}) OR {starts}"


def needs_exact(estimate: int, n_rows: int, options: DiagnoseOptions) -> bool:
    """Whether an estimated distinct count lies near a threshold a cleaning decision compares
    it with (a single value, ``max_values``, the ID-like limits), so that the decision needs
    the exact count. Shared with the Spark engine."""
    limits = (1, options.max_values, max(options.id_share * n_rows, options.id_min_distinct))
    return any(
        t / _ESTIMATE_ERROR - 2 <= estimate <= t * _ESTIMATE_ERROR + 2
        for t in (*limits, 0.5 * n_rows)
    )


@dataclass(frozen=True)
class _Profile:
    """What profiling learnt of one attribute column."""

    name: str
    sql_type: str
    distinct: int
    """Distinct values besides NULL and NaN: exact wherever a decision depends on it."""
    nulls: int
    """Rows holding NULL or NaN."""
    taken: frozenset[str]
    """The column's values that a label could collide with (``free_label``)."""

    @property
    def numeric(self) -> bool:
        return self.sql_type.upper().startswith(_NUMERIC)

    @property
    def integer(self) -> bool:
        return self.sql_type.upper().startswith(_INTEGER)

    @property
    def value(self) -> str:
        """The column as SQL, a float's NaN read as NULL: both are a missing value."""
        q = identifier(self.name)
        if self.sql_type.upper().startswith(_FLOAT):
            return f"(CASE WHEN {is_nan(q)} THEN NULL ELSE {q} END)"
        return q


def _profile(
    src: Source, attributes: list[str], sums: list[str], options: DiagnoseOptions
) -> tuple[list[float], list[_Profile]]:
    """``sums`` over the input and a ``_Profile`` of each attribute, in one scan (two when an
    estimated distinct count needs confirming)."""
    cols = [_Profile(c, src.types.get(c, "VARCHAR"), 0, 0, frozenset()) for c in attributes]
    parts = ["count(*)", *sums]
    texts = [f"CAST({identifier(p.name)} AS VARCHAR)" for p in cols]
    for p, text in zip(cols, texts, strict=True):
        textual = not p.numeric and not p.sql_type.upper().startswith(_NOT_TEXT)
        taken = f"bool_or({_collides(text)})" if textual else "NULL"  # streams; lists later
        parts += [f"approx_count_distinct({p.value})", f"count(*) - count({p.value})", taken]
    row = list(src.sql(f"SELECT {', '.join(parts)} FROM {{src}}").fetchall()[0])
    totals = [float(v or 0.0) for v in row[: 1 + len(sums)]]
    at = 1 + len(sums)
    distinct = [int(row[at + 3 * i] or 0) for i in range(len(cols))]
    for i, text in enumerate(texts):  # the rare column holding a label's text: which ones
        if row[at + 3 * i + 2]:
            found = f"SELECT list(DISTINCT {text}) FROM {{src}} WHERE {_collides(text)}"
            row[at + 3 * i + 2] = src.sql(found).fetchall()[0][0]
    near = [i for i, d in enumerate(distinct) if needs_exact(d, int(totals[0]), options)]
    if near:
        counts = ", ".join(f"count(DISTINCT {cols[i].value})" for i in near)
        exact = src.sql(f"SELECT {counts} FROM {{src}}").fetchall()[0]
        for i, d in zip(near, exact, strict=True):
            distinct[i] = int(d or 0)
    return totals, [
        _Profile(
            p.name,
            p.sql_type,
            distinct[i],
            int(row[at + 3 * i + 1] or 0),
            frozenset(row[at + 3 * i + 2] or ()),
        )
        for i, p in enumerate(cols)
    ]


def plan_cleaning(
    src: Source,
    attributes: list[str],
    *,
    target_sql: str,
    weight_sql: str,
    options: DiagnoseOptions,
) -> CleanPlan:
    """Profile ``attributes`` and decide how to clean each.

    ``target_sql`` is the per-row failure mass (0 for a non-failure) and ``weight_sql`` the
    per-row weight; both are used to keep the values that could still reach ``min_support``.
    """
    totals, profiles = _profile(
        src, attributes, [f"sum({weight_sql})", f"sum({target_sql})"], options
    )
    n_rows = int(totals[0])
    steps: dict[str, list[CleaningStep]] = {p.name: [] for p in profiles}
    kept: list[_Profile] = []
    for p in profiles:
        if p.nulls:
            null = free_label(NULL_VALUE, p.taken)
            steps[p.name].append(
                CleaningStep(p.name, "nulls", f"{p.nulls} empty value(s) kept as {null}")
            )
        why = _dropped(p, n_rows, options)
        if why:
            steps[p.name].append(CleaningStep(p.name, "dropped", why))
        else:
            kept.append(p)
    many = [p for p in kept if p.distinct > options.max_values and p.name not in options.keep]
    buckets = _buckets(src, [p for p in many if p.numeric], options.buckets)
    fold = {p.name for p in many}
    exprs: list[str] = []
    unfolded: list[str] = []
    for p in kept:
        if p.name in buckets:
            expr, detail = buckets[p.name]
            steps[p.name].append(CleaningStep(p.name, "bucketed", detail))
            exprs.append(expr)
            unfolded.append(expr)
            continue
        base = f"coalesce(CAST({p.value} AS VARCHAR), {literal(free_label(NULL_VALUE, p.taken))})"
        expr, label = base, free_label(OTHER_VALUE, p.taken)
        if p.name in fold:
            masses = (n_rows, totals[2], target_sql, weight_sql)
            expr, detail = _fold(src, base, label, masses, options)
            if detail:
                steps[p.name].append(CleaningStep(p.name, "folded", detail))
        exprs.append(expr)
        unfolded.append(base if label == OTHER_VALUE else expr)
    return CleanPlan(
        tuple(p.name for p in kept),
        tuple(exprs),
        tuple(s for p in profiles for s in steps[p.name]),
        tuple(unfolded),
        n_rows,
        totals[2],
        totals[1],
    )


def _dropped(p: _Profile, n_rows: int, options: DiagnoseOptions) -> str:
    """Why column ``p`` is dropped; empty when it is kept."""
    if p.distinct + (1 if p.nulls else 0) <= 1:
        return "a single value in every row"
    if p.name not in options.keep and id_like(p.distinct, n_rows, p.numeric, p.integer, options):
        return f"ID-like: {p.distinct} distinct values in {n_rows} rows"
    return ""


def id_like(
    distinct: int, n_rows: int, numeric: bool, integer: bool, options: DiagnoseOptions
) -> bool:
    """Whether a column is ID-like (dropped): more distinct values than ``id_share`` of the
    rows and ``id_min_distinct``; a number only when it is an integer nearly unique per row
    (other numbers are bucketed instead). Shared with the Spark engine."""
    if distinct <= max(options.id_share * n_rows, options.id_min_distinct):
        return False
    return not numeric or (integer and distinct > 0.5 * n_rows)


def bucket_probes(
    quantiles: Sequence[float | None], minimum: float | None
) -> tuple[list[float], list[float]]:
    """The data values to look up to place bucket edges: for each value of ``at_least`` the
    smallest value >= it, for each of ``above`` the smallest value > it. Shared with the Spark
    engine, which looks them up alike.

    ``at_least`` holds the quantiles above the ``minimum`` (a bucket ``< minimum`` is empty):
    moved onto the next data value, an edge moves no row across it, and every bucket holds a
    row (``[a, b)`` holds ``a``), where an interpolated quantile could leave one empty.
    ``above`` holds each dominant value, one that fills two quantiles (as any value holding
    two buckets' share of the rows does) or is the minimum and the first (90% zeros): an edge
    just above it gives it its own bucket, so the other rows are not lumped in with it. Edges
    stay at most one fewer than the buckets: a dominant value took the place of two quantiles,
    or of one below the minimum.
    """
    qs = [float(e) for e in quantiles if e is not None and math.isfinite(e)]
    if minimum is None or not qs:
        return [], []
    at_least = sorted({e for e in qs if e > minimum})
    above = sorted({e for e in qs if e == minimum or qs.count(e) > 1})
    return at_least, above


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


def _buckets(src: Source, columns: list[_Profile], buckets: int) -> dict[str, tuple[str, str]]:
    """The bucketing expression and its report of each of ``columns`` that gets edges, in two
    scans: the quantiles and minimum of each, then the data values ``bucket_probes`` names."""
    if not columns:
        return {}
    probs = [k / buckets for k in range(1, buckets)]
    xs = [f"CAST({p.value} AS DOUBLE)" for p in columns]
    parts = [f"min({x}), quantile_cont({x}, {probs})" for x in xs]
    row = src.sql(f"SELECT {', '.join(parts)} FROM {{src}}").fetchall()[0]
    probes = [bucket_probes(row[2 * i + 1] or [], row[2 * i]) for i in range(len(columns))]
    lookups = [
        f"min({x}) FILTER (WHERE {x} {op} {e!r})"
        for x, (at_least, above) in zip(xs, probes, strict=True)
        for op, values in ((">=", at_least), (">", above))
        for e in values
    ]
    found = src.sql(f"SELECT {', '.join(lookups)} FROM {{src}}").fetchall()[0] if lookups else ()
    out: dict[str, tuple[str, str]] = {}
    start = 0
    for p, x, (at_least, above) in zip(columns, xs, probes, strict=True):
        end = start + len(at_least) + len(above)
        edges, labels = bucket_labels(list(found[start:end]))
        start = end
        if edges:
            cases = [f"WHEN {x} IS NULL THEN {literal(NULL_VALUE)}"]
            cases += [
                f"WHEN {x} < {e!r} THEN {literal(lab)}"
                for e, lab in zip(edges, labels[:-1], strict=True)
            ]
            expr = f"CASE {' '.join(cases)} ELSE {literal(labels[-1])} END"
            out[p.name] = expr, f"{len(labels)} quantile buckets ({', '.join(labels)})"
    return out


def _fold(
    src: Source,
    base: str,
    label: str,
    masses: tuple[int, float, str, str],
    options: DiagnoseOptions,
) -> tuple[str, str]:
    """``base`` with its rare values folded into ``label``, and the report. ``masses``: the
    input's rows and failure mass, and the SQL of a row's failure mass and weight."""
    # A value is kept when it is common, or when its failures could reach min_support: folding
    # the others loses no frequent item-set, and shrinks the aggregate.
    n_rows, failures, target_sql, weight_sql = masses
    min_rows = options.rare_share * n_rows
    min_fail = support_floor(failures, options.min_support)
    rows = src.sql(
        f"SELECT v, n FROM (SELECT {base} AS v, sum({weight_sql}) AS r, sum({target_sql}) AS t, "
        f"count(*) OVER () AS n FROM {{src}} GROUP BY 1) WHERE r >= {min_rows!r} "
        f"OR t >= {min_fail!r} ORDER BY t DESC, r DESC, v LIMIT {_MAX_KEPT + 1}"
    ).fetchall()
    kept = [str(r[0]) for r in rows[:_MAX_KEPT]]
    if rows and len(kept) == rows[0][1]:
        return base, f"kept {len(kept)} values: none is rare enough to fold"
    if not kept:
        return literal(label), f"every value rare; all folded into {label!r}"
    expr = f"CASE WHEN {base} IN ({literals(kept)}) THEN {base} ELSE {literal(label)} END"
    return expr, f"kept {len(kept)} values, folded the rarer ones into {label!r}"
