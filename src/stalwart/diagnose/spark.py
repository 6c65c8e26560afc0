"""The same analyses with Apache Spark doing the heavy part (optional extra ``spark``).

Spark reads the rows and aggregates them; only the aggregate reaches the driver (as Arrow),
where the local engine mines, scores and selects as usual. Tables far larger than one machine's
memory work as long as their aggregate fits, which is the point of the FDA paper's
pre-aggregation.

- ``analyze_spark`` (labelled events): the attributes are cleaned in Spark by the local
  engine's rules (``spark_clean``: ID-like columns dropped over the input's rows, many-valued
  numbers in quantile buckets, nulls as a value), then GROUP BY every cleaned attribute and the
  label, summing the weight; the driver runs ``analyze`` with the count as the weight.
- ``localize_spark`` (KPI deviation): GROUP BY every attribute, summing the KPI columns: one
  row per leaf, which is what ``localize`` searches. The leaves reach the driver as they are
  (cleaning them is ``localize``'s own first step, on the same leaves the local engine would
  see), so both engines give the same answer; Spark does the scan and the summing.

Configuration is the ``DiagnoseOptions`` dataclass only, as for the local engine.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from stalwart.diagnose.analyze import analyze, localize
from stalwart.diagnose.options import DiagnoseOptions
from stalwart.diagnose.result import Diagnosis
from stalwart.diagnose.source import suggest
from stalwart.diagnose.spark_clean import SparkCleaning, clean_spark
from stalwart.diagnose.spark_clean import spark_name as _q
from stalwart.diagnose.spark_expression import check_spark_expression
from stalwart.diagnose.target import check_weights
from stalwart.errors import ConfigError, require

__all__ = ["analyze_spark", "localize_spark"]

log = logging.getLogger(__name__)

_FAILED, _COUNT = "__stalwart_failed", "__stalwart_count"


def _pyspark() -> Any:
    require("pyspark", "spark", "the spark engine (with Java 17+)")
    import pyspark.sql.functions as F

    return F


def _start(data: Any, spark: Any, options: DiagnoseOptions | None) -> tuple[Any, DiagnoseOptions]:
    """The input as a Spark DataFrame, and the checked options."""
    if options is not None and not isinstance(options, DiagnoseOptions):
        raise ConfigError(
            f"options: expected a DiagnoseOptions, got {type(options).__name__}; build one "
            "with DiagnoseOptions(min_support=..., ...), which refuses unknown names"
        )
    if spark is None:
        from pyspark.sql import SparkSession

        spark = SparkSession.builder.getOrCreate()
    return _read(spark, data), options or DiagnoseOptions()


def analyze_spark(
    data: Any,
    label: str,
    *,
    weight: str | None = None,
    columns: Sequence[str] | None = None,
    spark: Any = None,
    options: DiagnoseOptions | None = None,
) -> Diagnosis:
    """``analyze`` with Spark for the scan, the cleaning and the pre-aggregation.

    Args:
        data: a Spark DataFrame, or a CSV, Parquet or JSON lines path Spark can read.
        label: a column or a Spark SQL condition that is true for failures: one expression
            over the columns, checked by ``spark_expression`` before Spark runs it.
        weight: a column counting the events each row stands for.
        columns: the attribute columns; all others but the label and weight when omitted.
        spark: the SparkSession to use; the active (or a new local) one when omitted.
        options: the analysis' settings, as for ``analyze``.

    Raises:
        ConfigError: a missing column, an invalid condition, no rows, or bad options.
    """
    F = _pyspark()
    df, opts = _start(data, spark, options)
    names = list(df.columns)
    cond, used = _label(df, label, F)
    if weight is not None and weight not in names:
        raise ConfigError(f"weight: no column {weight!r}.{suggest(weight, names)}")
    attrs = _attributes(names, columns, used | {weight}, opts)
    w = F.lit(1.0)
    if weight is not None:  # as the local engine reads a weight: a count, never negative
        raw = F.col(_q(weight)).cast("double")
        w = F.coalesce(raw, F.lit(0.0))
        bad = F.count(F.when((raw < 0) | F.isnan(raw), 1))
        negative_or_nan, missing = df.agg(bad, F.count(F.when(raw.isNull(), 1))).first()
        check_weights(negative_or_nan, weight, missing)
    cleaned = _cleaned(df, attrs, opts, F)
    keyed = df.select(
        *cleaned.exprs,
        F.coalesce(cond.cast("boolean"), F.lit(False)).alias(_FAILED),
        w.alias(_COUNT),
    )
    keys = [F.col(_q(c)) for c in cleaned.columns]  # quoted: a dot in a name is no field
    table = keyed.groupBy(*keys, _FAILED).agg(F.sum(_COUNT).alias(_COUNT)).toArrow()
    # ID-like columns were decided over the input's rows: the aggregate has far fewer, so
    # the rule must not run again there
    local = _local(opts, cleaned.columns, id_share=1.0)
    d = analyze(table, _FAILED, weight=_COUNT, columns=cleaned.columns, options=local)
    return _finish(d, cleaned, f"{cleaned.rows:,} rows into {table.num_rows:,}")


def localize_spark(
    data: Any,
    actual: str | tuple[str, str],
    expected: str | tuple[str, str],
    *,
    columns: Sequence[str] | None = None,
    spark: Any = None,
    options: DiagnoseOptions | None = None,
) -> Diagnosis:
    """``localize`` with Spark for the scan and the leaves.

    Spark sums the KPI columns per leaf (GROUP BY every attribute: rows that share their
    attribute values are one leaf, as ``localize`` defines it); only the leaves reach the
    driver, where ``localize`` cleans (buckets, drops ID-like columns) and searches them.

    Args:
        data: a Spark DataFrame, or a CSV, Parquet or JSON lines path Spark can read.
        actual: the actual value column (additive KPI), or its (numerator, denominator).
        expected: the forecast column, or its (numerator, denominator).
        columns: the attribute columns; all others but the KPI columns when omitted.
        spark: the SparkSession to use; the active (or a new local) one when omitted.
        options: the analysis' settings, as for ``localize``.

    Raises:
        ConfigError: a missing column, mismatched KPI arguments, zero denominators, bad options.
    """
    F = _pyspark()
    df, opts = _start(data, spark, options)
    kpi = _kpi_columns(list(df.columns), actual, expected)
    attrs = _attributes(list(df.columns), columns, set(kpi), opts)
    sums = [F.sum(F.col(_q(c)).cast("double")).alias(c) for c in kpi]
    table = df.groupBy(*(F.col(_q(c)) for c in attrs)).agg(*sums).toArrow()
    if table.num_rows == 0:
        raise ConfigError("the input has no rows; nothing to analyse")
    d = localize(table, actual, expected, columns=attrs, options=_local(opts, attrs))
    d.notes.append(f"spark summed the KPI into {table.num_rows:,} leaves")
    return d


def _kpi_columns(
    names: list[str], actual: str | tuple[str, str], expected: str | tuple[str, str]
) -> list[str]:
    """The KPI columns, checked as ``target.kpi_masses`` checks them: [A, E] or [An, Ad, En, Ed]."""
    if isinstance(actual, str) != isinstance(expected, str):
        raise ConfigError(
            "actual and expected must both be single columns (additive KPI) or both "
            "(numerator, denominator) pairs (ratio KPI)"
        )
    if isinstance(actual, str) and isinstance(expected, str):
        cols = [(actual, "actual"), (expected, "expected")]
    else:
        if len(actual) != 2 or len(expected) != 2:
            raise ConfigError("a ratio KPI needs (numerator, denominator) for actual and expected")
        cols = [(c, "actual") for c in actual] + [(c, "expected") for c in expected]
    for c, what in cols:
        if c not in names:
            raise ConfigError(f"{what}: no column {c!r}.{suggest(c, names)}")
    return list(dict.fromkeys(c for c, _ in cols))


def _label(df: Any, label: str, F: Any) -> tuple[Any, set[str]]:
    """The failure condition as a Spark column, and the columns it reads."""
    names = list(df.columns)
    if label in names:
        return F.col(_q(label)), {label}
    if all(ch.isalnum() or ch == "_" for ch in label):
        raise ConfigError(f"label: no column {label!r}.{suggest(label, names)}")
    # checked by the parser F.expr uses, so what runs is the tree that was checked
    used = check_spark_expression(df, label, names)
    try:
        cond = F.expr(label)
        df.select(cond).limit(1).collect()
    except Exception as e:  # Spark raises AnalysisException and friends
        raise ConfigError(
            f"label {label!r} is not a valid Spark condition: {str(e).splitlines()[0]}"
        ) from e
    return cond, used


def _attributes(
    names: list[str], columns: Sequence[str] | None, used: set[Any], opts: DiagnoseOptions
) -> list[str]:
    for name in [*(columns or ()), *opts.exclude, *opts.keep]:
        if name not in names:
            raise ConfigError(f"no column {name!r}.{suggest(name, names)}")
    attrs = [c for c in (columns or names) if c not in used and c not in opts.exclude]
    if not attrs:
        raise ConfigError("no attribute columns to analyse: name them with columns=[...]")
    return attrs


def _cleaned(df: Any, attrs: list[str], opts: DiagnoseOptions, F: Any) -> SparkCleaning:
    cleaned = clean_spark(df, attrs, opts, F)
    if cleaned.rows == 0:
        raise ConfigError("the input has no rows; nothing to analyse")
    if not cleaned.columns:
        raise ConfigError(
            "every attribute column was dropped as ID-like; name columns to keep with "
            "DiagnoseOptions(keep=(...))"
        )
    return cleaned


def _local(opts: DiagnoseOptions, columns: list[str], **changes: Any) -> DiagnoseOptions:
    """The options of the local engine on Spark's aggregate, which holds only ``columns``:
    names of columns it lacks are left out."""
    kept = set(columns)
    levels = [tuple(c for c in h if c in kept) for h in opts.hierarchies]
    return dataclasses.replace(
        opts,
        **changes,
        exclude=(),
        keep=tuple(c for c in opts.keep if c in kept),
        hierarchies=tuple(h for h in levels if len(h) >= 2),
    )


def _finish(d: Diagnosis, cleaned: SparkCleaning, what: str) -> Diagnosis:
    d.cleaning[:0] = cleaned.steps
    d.notes.append(f"spark aggregated {what}")
    log.info("spark aggregated %s", what)
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
