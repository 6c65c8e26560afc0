"""The same analysis with Apache Spark doing the heavy scan (optional extra ``spark``).

Spark reads the rows, drops ID-like columns (approximate distinct counts), casts attributes to
text with nulls as a value, and pre-aggregates: GROUP BY every attribute and the label, summing
the weight. Only that aggregate, one row per distinct combination and outcome, reaches the
driver (as Arrow), where the embedded engine cleans, mines, scores and selects as usual with the
count as the weight. Tables far larger than one machine's memory work as long as their distinct
combinations fit, which is the point of the FDA paper's pre-aggregation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from stalwart.diagnose.analyze import analyze
from stalwart.diagnose.options import DiagnoseOptions
from stalwart.diagnose.result import Diagnosis
from stalwart.diagnose.source import suggest
from stalwart.errors import ConfigError, require

__all__ = ["analyze_spark"]

log = logging.getLogger(__name__)

_FAILED, _COUNT = "__stalwart_failed", "__stalwart_count"


def _pyspark() -> Any:
    require("pyspark", "spark", "the spark engine (with Java 17+)")
    import pyspark.sql.functions as F
    from pyspark.sql import SparkSession

    return SparkSession, F


def analyze_spark(
    data: Any,
    label: str,
    *,
    weight: str | None = None,
    columns: Sequence[str] | None = None,
    spark: Any = None,
    options: DiagnoseOptions | None = None,
    **overrides: Any,
) -> Diagnosis:
    """``analyze`` with Spark for the scan and the pre-aggregation.

    Args:
        data: a Spark DataFrame, or a CSV, Parquet or JSON lines path Spark can read.
        label: a column or a Spark SQL condition that is true for failures.
        spark: the SparkSession to use; the active (or a new local) one when omitted.
    """
    session_cls, F = _pyspark()
    opts = options or DiagnoseOptions()
    if overrides:
        opts = DiagnoseOptions(**{**opts.__dict__, **overrides})
    if spark is None:
        spark = session_cls.builder.getOrCreate()
    df = _read(spark, data)
    names = list(df.columns)
    if label in names:
        cond = F.col(f"`{label}`")
        used = {label}
    else:
        if all(ch.isalnum() or ch == "_" for ch in label):
            raise ConfigError(f"label: no column {label!r}.{suggest(label, names)}")
        try:
            cond = F.expr(label)
            df.select(cond).limit(1).collect()
        except Exception as e:  # Spark raises AnalysisException and friends
            raise ConfigError(
                f"label {label!r} is not a valid Spark condition: {str(e).splitlines()[0]}"
            ) from e
        used = {n for n in names if n in label}
    if weight is not None and weight not in names:
        raise ConfigError(f"weight: no column {weight!r}.{suggest(weight, names)}")
    attrs = [
        c for c in (columns or names) if c not in used and c != weight and c not in opts.exclude
    ]
    if not attrs:
        raise ConfigError("no attribute columns to analyse")
    total = df.count()
    if total == 0:
        raise ConfigError("the input has no rows; nothing to analyse")
    distinct = df.agg(*(F.approx_count_distinct(F.col(f"`{c}`")).alias(c) for c in attrs))
    counts = distinct.collect()[0].asDict()
    limit = max(opts.id_share * total, opts.id_min_distinct)
    dropped = [c for c in attrs if counts[c] > limit and c not in opts.keep]
    attrs = [c for c in attrs if c not in dropped]
    w = (
        F.lit(1.0)
        if weight is None
        else F.coalesce(F.col(f"`{weight}`").cast("double"), F.lit(0.0))
    )
    keyed = df.select(
        *(F.coalesce(F.col(f"`{c}`").cast("string"), F.lit("(null)")).alias(c) for c in attrs),
        F.coalesce(cond.cast("boolean"), F.lit(False)).alias(_FAILED),
        w.alias(_COUNT),
    )
    agg = keyed.groupBy(*attrs, _FAILED).agg(F.sum(_COUNT).alias(_COUNT))
    table = agg.toArrow()
    log.info("spark pre-aggregated %d rows into %d", total, table.num_rows)
    d = analyze(table, _FAILED, weight=_COUNT, columns=attrs, options=opts)
    d.cleaning[:0] = [
        {
            "column": c,
            "action": "dropped",
            "detail": f"ID-like: ~{counts[c]} distinct values in {total} rows",
        }
        for c in dropped
    ]
    d.notes.append(f"spark pre-aggregated {total:,} rows into {table.num_rows:,}")
    return d


def _read(spark: Any, data: Any) -> Any:
    if hasattr(data, "sparkSession") and hasattr(data, "groupBy"):
        return data
    if isinstance(data, str):
        lower = data.lower()
        if lower.endswith((".parquet", ".pq")):
            return spark.read.parquet(data)
        if lower.endswith((".csv", ".csv.gz", ".tsv")):
            return spark.read.option("header", True).option("inferSchema", True).csv(data)
        if lower.endswith((".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")):
            return spark.read.json(data)  # Spark's JSON source is one object per line
    raise ConfigError(
        "the spark engine reads a Spark DataFrame, or a CSV, Parquet or JSON lines path"
    )
