"""Cleaning of attribute columns in Spark, by the rules of the local engine (``clean.py``).

One Spark job profiles every attribute (approximate distinct count, nulls); a column is dropped
as ID-like by ``clean.id_like`` over the input's rows (the aggregate the driver receives has far
fewer rows, so the rule must be applied here); a numeric column with more than ``max_values``
distinct values becomes ``buckets`` quantile buckets named by ``clean.bucket_labels``; every
other column is cast to text with NULL as the value ``(null)``.

Quantiles are exact (Spark's ``percentile``, linear interpolation like DuckDB's
``quantile_cont``, so both engines cut at the same edges) when the column has at most
``_EXACT_DISTINCT`` distinct values: Spark keeps one count per distinct value to compute them.
Beyond that they are ``percentile_approx`` with a relative rank error of 1 / ``_ACCURACY``, whose
edges may differ from DuckDB's by that much.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stalwart.diagnose.clean import NULL_VALUE, bucket_labels, id_like
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
    """Profile ``attrs`` of the Spark DataFrame ``df`` in one job and clean each of them.

    Args:
        F: ``pyspark.sql.functions``.
    """
    from pyspark.sql import types as T

    parts = [F.count(F.lit(1)).alias("__rows")]
    for i, c in enumerate(attrs):
        col = F.col(spark_name(c))
        parts += [
            F.approx_count_distinct(col, rsd=_RSD).alias(f"d{i}"),
            (F.count(F.lit(1)) - F.count(col)).alias(f"n{i}"),
        ]
    row = df.agg(*parts).collect()[0]
    out = SparkCleaning(int(row["__rows"]))
    kinds = {f.name: f.dataType for f in df.schema.fields}
    bucketed: dict[str, int] = {}
    for i, c in enumerate(attrs):
        distinct, nulls = int(row[f"d{i}"] or 0), int(row[f"n{i}"] or 0)
        numeric = isinstance(kinds[c], T.NumericType)
        if nulls:
            out.steps.append(_step(c, "nulls", f"{nulls} empty value(s) kept as {NULL_VALUE}"))
        keep = c in opts.keep
        if not keep and id_like(
            distinct, out.rows, numeric, isinstance(kinds[c], T.IntegralType), opts
        ):
            detail = f"ID-like: ~{distinct} distinct values in {out.rows} rows"
            out.steps.append(_step(c, "dropped", detail))
            continue
        if numeric and distinct > opts.max_values and not keep:
            bucketed[c] = distinct
        out.columns.append(c)
    edges = _quantiles(df, bucketed, opts.buckets, F)
    for c in out.columns:
        text = F.coalesce(F.col(spark_name(c)).cast("string"), F.lit(NULL_VALUE))
        cuts, labels = bucket_labels(edges.get(c) or [])
        if not cuts:
            out.exprs.append(text.alias(c))
            continue
        x = F.col(spark_name(c)).cast("double")
        expr = F.when(x.isNull(), F.lit(NULL_VALUE))
        for e, label in zip(cuts, labels, strict=False):
            expr = expr.when(x < F.lit(e), F.lit(label))
        out.exprs.append(expr.otherwise(F.lit(labels[-1])).alias(c))
        how = "" if bucketed[c] <= _EXACT_DISTINCT else f", approximate to 1/{_ACCURACY} in rank"
        detail = f"{len(labels)} quantile buckets ({', '.join(labels)}){how}"
        out.steps.append(_step(c, "bucketed", detail))
    return out


def _quantiles(df: Any, distinct: dict[str, int], buckets: int, F: Any) -> dict[str, list[float]]:
    """The ``buckets``-quantiles of each column of ``distinct``, in one Spark job."""
    if not distinct:
        return {}
    probs = [k / buckets for k in range(1, buckets)]
    parts = []
    for i, (c, n) in enumerate(distinct.items()):
        x = F.col(spark_name(c)).cast("double")
        q = (
            F.percentile(x, probs)
            if n <= _EXACT_DISTINCT
            else F.percentile_approx(x, probs, _ACCURACY)
        )
        parts.append(q.alias(f"q{i}"))
    row = df.agg(*parts).collect()[0]
    return {c: list(row[f"q{i}"] or []) for i, c in enumerate(distinct)}


def _step(column: str, action: str, detail: str) -> dict[str, str]:
    return {"column": column, "action": action, "detail": detail}


def spark_name(name: str) -> str:
    """A column name quoted for ``F.col`` (dots and spaces are literal)."""
    return "`" + name.replace("`", "``") + "`"
