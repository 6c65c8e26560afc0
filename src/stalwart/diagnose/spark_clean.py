"""Cleaning of attribute columns in Spark, by the rules of the local engine (``clean.py``).

One Spark job profiles every attribute (approximate distinct count, nulls, the values a label
could collide with), and a second counts exactly the columns whose estimate lies near a
threshold (``clean.needs_exact``); a column is dropped as ID-like by ``clean.id_like`` over the
input's rows (the aggregate the driver receives has far fewer rows, so the rule must be applied
here); a numeric column with more than ``max_values`` distinct values becomes ``buckets``
quantile buckets, their edges placed on data values as ``clean.bucket_probes`` says and named
by ``clean.bucket_labels``; every other column is cast to text with NULL (and a float's NaN)
as the value ``(null)``, or ``clean.free_label``'s alternative where the column holds that text.

Quantiles are exact (Spark's ``percentile``, linear interpolation like DuckDB's
``quantile_cont``, so both engines cut at the same edges) when the column has at most
``_EXACT_DISTINCT`` distinct values: Spark keeps one count per distinct value to compute them.
Beyond that they are ``percentile_approx`` with a relative rank error of 1 / ``_ACCURACY``, whose
edges may differ from DuckDB's by that much.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stalwart.diagnose.clean import (
    ALTERNATIVE_LABELS,
    NULL_VALUE,
    bucket_labels,
    bucket_probes,
    free_label,
    id_like,
    needs_exact,
)
from stalwart.diagnose.options import DiagnoseOptions

__all__ = ["SparkCleaning", "clean_spark", "spark_name"]

_EXACT_DISTINCT = 1_000_000
_ACCURACY = 100_000
_RSD = 0.02  # relative error of the distinct counts (Spark defaults to 0.05)


@dataclass
class SparkCleaning:
    """The attributes kept, the Spark column cleaning each (aliased to its name), and the
    decisions in the local engine's ``cleaning`` format."""

    rows: int
    columns: list[str] = field(default_factory=list)
    exprs: list[Any] = field(default_factory=list)
    steps: list[dict[str, str]] = field(default_factory=list)


def clean_spark(df: Any, attrs: list[str], opts: DiagnoseOptions, F: Any) -> SparkCleaning:
    """Profile ``attrs`` of the Spark DataFrame ``df`` and clean each of them.

    Args:
        F: ``pyspark.sql.functions``.
    """
    from pyspark.sql import types as T

    kinds = {f.name: f.dataType for f in df.schema.fields}
    values = {c: _value(c, kinds[c], F, T) for c in attrs}
    distinct, nulls, taken, rows = _profile(df, values, kinds, opts, F, T)
    out = SparkCleaning(rows)
    bucketed: dict[str, int] = {}
    for c in attrs:
        numeric = isinstance(kinds[c], T.NumericType)
        if nulls[c]:
            null = free_label(NULL_VALUE, taken[c])
            out.steps.append(_step(c, "nulls", f"{nulls[c]} empty value(s) kept as {null}"))
        keep = c in opts.keep
        if not keep and id_like(
            distinct[c], out.rows, numeric, isinstance(kinds[c], T.IntegralType), opts
        ):
            detail = f"ID-like: ~{distinct[c]} distinct values in {out.rows} rows"
            out.steps.append(_step(c, "dropped", detail))
            continue
        if numeric and distinct[c] > opts.max_values and not keep:
            bucketed[c] = distinct[c]
        out.columns.append(c)
    edges = _edges(df, {c: values[c].cast("double") for c in bucketed}, bucketed, opts, F)
    for c in out.columns:
        cuts, labels = bucket_labels(edges.get(c) or [])
        if not cuts:
            null = F.lit(free_label(NULL_VALUE, taken[c]))
            out.exprs.append(F.coalesce(values[c].cast("string"), null).alias(c))
            continue
        x = values[c].cast("double")
        expr = F.when(x.isNull(), F.lit(NULL_VALUE))
        for e, label in zip(cuts, labels, strict=False):
            expr = expr.when(x < F.lit(e), F.lit(label))
        out.exprs.append(expr.otherwise(F.lit(labels[-1])).alias(c))
        how = "" if bucketed[c] <= _EXACT_DISTINCT else f", approximate to 1/{_ACCURACY} in rank"
        detail = f"{len(labels)} quantile buckets ({', '.join(labels)}){how}"
        out.steps.append(_step(c, "bucketed", detail))
    return out


def _value(name: str, kind: Any, F: Any, T: Any) -> Any:
    """Column ``name``, a float's NaN read as NULL: both are a missing value."""
    col = F.col(spark_name(name))
    if isinstance(kind, (T.FloatType, T.DoubleType)):
        return F.when(F.isnan(col), F.lit(None)).otherwise(col)
    return col


def _profile(
    df: Any, values: dict[str, Any], kinds: dict[str, Any], opts: DiagnoseOptions, F: Any, T: Any
) -> tuple[dict[str, int], dict[str, int], dict[str, frozenset[str]], int]:
    """Per column: distinct values (exact where a decision depends on it), NULL or NaN rows,
    and the values a label could collide with; and the rows. One job, two when an estimated
    distinct count needs confirming."""
    never_text = (T.NumericType, T.BooleanType, T.DateType, T.TimestampType, T.TimestampNTZType)
    parts = [F.count(F.lit(1)).alias("__rows")]
    for i, (c, x) in enumerate(values.items()):
        parts += [
            F.approx_count_distinct(x, rsd=_RSD).alias(f"d{i}"),
            (F.count(F.lit(1)) - F.count(x)).alias(f"n{i}"),
        ]
        if not isinstance(kinds[c], never_text):
            text = F.col(spark_name(c)).cast("string")
            hit = text.isin(*ALTERNATIVE_LABELS)
            for alt in ALTERNATIVE_LABELS.values():
                hit = hit | text.startswith(alt)
            parts.append(F.collect_set(F.when(hit, text)).alias(f"t{i}"))
    row = df.agg(*parts).collect()[0].asDict()
    rows = int(row["__rows"])
    distinct = {c: int(row[f"d{i}"] or 0) for i, c in enumerate(values)}
    near = [c for c in values if needs_exact(distinct[c], rows, opts)]
    if near:
        exact = df.agg(*(F.countDistinct(values[c]) for c in near)).collect()[0]
        distinct.update({c: int(exact[i] or 0) for i, c in enumerate(near)})
    nulls = {c: int(row[f"n{i}"] or 0) for i, c in enumerate(values)}
    taken = {c: frozenset(row.get(f"t{i}") or ()) for i, c in enumerate(values)}
    return distinct, nulls, taken, rows


def _edges(
    df: Any, xs: dict[str, Any], distinct: dict[str, int], opts: DiagnoseOptions, F: Any
) -> dict[str, list[float]]:
    """The bucket edges of each column of ``xs`` (as DOUBLE), on data values: its quantiles
    and minimum in one job, then the values ``clean.bucket_probes`` names in a second."""
    if not xs:
        return {}
    probs = [k / opts.buckets for k in range(1, opts.buckets)]
    parts = []
    for i, (c, x) in enumerate(xs.items()):
        exact = distinct[c] <= _EXACT_DISTINCT
        q = F.percentile(x, probs) if exact else F.percentile_approx(x, probs, _ACCURACY)
        parts += [q.alias(f"q{i}"), F.min(x).alias(f"m{i}")]
    row = df.agg(*parts).collect()[0]
    probes = {c: bucket_probes(row[f"q{i}"] or [], row[f"m{i}"]) for i, c in enumerate(xs)}
    lookups = {
        c: [F.min(F.when(xs[c] >= F.lit(e), xs[c])) for e in at_least]
        + [F.min(F.when(xs[c] > F.lit(e), xs[c])) for e in above]
        for c, (at_least, above) in probes.items()
    }
    flat = [col for cols in lookups.values() for col in cols]
    found = list(df.agg(*flat).collect()[0]) if flat else []
    out, start = {}, 0
    for c, cols in lookups.items():
        out[c] = found[start : start + len(cols)]
        start += len(cols)
    return out


def _step(column: str, action: str, detail: str) -> dict[str, str]:
    return {"column": column, "action": action, "detail": detail}


def spark_name(name: str) -> str:
    """A column name quoted for ``F.col`` (dots and spaces are literal)."""
    return "`" + name.replace("`", "``") + "`"
