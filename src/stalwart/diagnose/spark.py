"""The same analyses with Apache Spark doing the heavy part (optional extra ``spark``).

Spark reads the rows, cleans the attributes by the local engine's rules (``spark_clean``: ID-like
columns dropped, many-valued numbers in quantile buckets, nulls as a value) and aggregates; only
the aggregate reaches the driver (as Arrow), where the local engine mines, scores and selects as
usual. Tables far larger than one machine's memory work as long as their distinct cleaned
combinations fit, which is the point of the FDA paper's pre-aggregation.

- ``analyze_spark`` (labelled events): GROUP BY every cleaned attribute and the label, summing
  the weight; the driver runs ``analyze`` with the count as the weight.
- ``localize_spark`` (KPI deviation): GROUP BY every attribute first (one row per leaf, its KPI
  columns summed), then each leaf's deviation and reference masses exactly as ``target.py``
  defines them, then GROUP BY the cleaned attributes summing the masses. The driver runs
  ``localize`` on that table, with the masses written as a KPI whose masses are those sums:
  additive: actual = target + reference, expected = reference; ratio: actual = (target,
  reference), expected = (0, reference). So both engines score the same masses.

Configuration is the ``DiagnoseOptions`` dataclass only, as for the local engine.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import pyarrow.compute as pc

from stalwart.diagnose.analyze import analyze, localize
from stalwart.diagnose.options import DiagnoseOptions
from stalwart.diagnose.result import Diagnosis
from stalwart.diagnose.source import suggest
from stalwart.diagnose.spark_clean import SparkCleaning, clean_spark
from stalwart.diagnose.spark_clean import spark_name as _q
from stalwart.errors import ConfigError, require

__all__ = ["analyze_spark", "localize_spark"]

log = logging.getLogger(__name__)

_FAILED, _COUNT = "__stalwart_failed", "__stalwart_count"
_TARGET, _REF, _ACTUAL, _ZERO = (
    "__stalwart_target",
    "__stalwart_reference",
    "__stalwart_actual",
    "__stalwart_zero",
)


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
        label: a column or a Spark SQL condition that is true for failures.
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
    w = F.lit(1.0) if weight is None else F.coalesce(F.col(_q(weight)).cast("double"), F.lit(0.0))
    cleaned = _cleaned(df, attrs, opts, F)
    keyed = df.select(
        *cleaned.exprs,
        F.coalesce(cond.cast("boolean"), F.lit(False)).alias(_FAILED),
        w.alias(_COUNT),
    )
    table = keyed.groupBy(*cleaned.columns, _FAILED).agg(F.sum(_COUNT).alias(_COUNT)).toArrow()
    d = analyze(
        table, _FAILED, weight=_COUNT, columns=cleaned.columns, options=_local(opts, cleaned)
    )
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
    """``localize`` with Spark for the scan, the leaves, the cleaning and the aggregation.

    Args:
        data: a Spark DataFrame, or a CSV, Parquet or JSON lines path Spark can read; rows
            with the same attribute values are one leaf (their KPI columns are summed).
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
    sums = [
        F.sum(F.coalesce(F.col(_q(c)).cast("double"), F.lit(0.0))).alias(f"__k{i}")
        for i, c in enumerate(kpi)
    ]
    leaves = df.groupBy(*(F.col(_q(c)) for c in attrs)).agg(*sums).persist()
    try:
        target, reference = _masses(leaves, len(kpi) == 4, F)
        cleaned = _cleaned(leaves, attrs, opts, F)
        table = (
            leaves.select(*cleaned.exprs, target.alias(_TARGET), reference.alias(_REF))
            .groupBy(*cleaned.columns)
            .agg(F.sum(_TARGET).alias(_TARGET), F.sum(_REF).alias(_REF))
            .toArrow()
        )
    finally:
        leaves.unpersist()
    local = _local(opts, cleaned)
    if len(kpi) == 4:
        table = table.append_column(_ZERO, pc.multiply(table[_REF], 0.0))
        d = localize(table, (_TARGET, _REF), (_ZERO, _REF), columns=cleaned.columns, options=local)
    else:
        table = table.append_column(_ACTUAL, pc.add(table[_TARGET], table[_REF]))
        d = localize(table, _ACTUAL, _REF, columns=cleaned.columns, options=local)
    return _finish(d, cleaned, f"{cleaned.rows:,} leaves into {table.num_rows:,} groups")


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
    return [c for c, _ in cols]


def _masses(leaves: Any, ratio: bool, F: Any) -> tuple[Any, Any]:
    """Each leaf's deviation (target) and reference mass, as ``target.kpi_masses`` defines them."""
    if not ratio:
        a, e = F.col("__k0"), F.col("__k1")
        total = leaves.agg(F.sum(a - e)).collect()[0][0] or 0.0
        s = 1.0 if total >= 0 else -1.0
        return F.greatest(F.lit(s) * (a - e), F.lit(0.0)), F.greatest(e, F.lit(0.0))
    an, ad, en, ed = (F.col(f"__k{i}") for i in range(4))
    row = leaves.agg(F.sum(an), F.sum(ad), F.sum(en), F.sum(ed)).collect()[0]
    tot_an, tot_ad, tot_en, tot_ed = (float(v or 0.0) for v in row)
    if tot_ad <= 0 or tot_ed <= 0:
        raise ConfigError("the KPI's denominators sum to zero; nothing to compare")
    overall = tot_en / tot_ed
    s = 1.0 if tot_an / tot_ad >= overall else -1.0
    own = F.when(ed > 0, en / ed).otherwise(F.lit(overall))
    return F.greatest(F.lit(s) * (an - ad * own), F.lit(0.0)), F.greatest(ad, F.lit(0.0))


def _label(df: Any, label: str, F: Any) -> tuple[Any, set[str]]:
    """The failure condition as a Spark column, and the columns it reads."""
    names = list(df.columns)
    if label in names:
        return F.col(_q(label)), {label}
    if all(ch.isalnum() or ch == "_" for ch in label):
        raise ConfigError(f"label: no column {label!r}.{suggest(label, names)}")
    try:
        cond = F.expr(label)
        df.select(cond).limit(1).collect()
    except Exception as e:  # Spark raises AnalysisException and friends
        raise ConfigError(
            f"label {label!r} is not a valid Spark condition: {str(e).splitlines()[0]}"
        ) from e
    return cond, {n for n in names if n in label}


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


def _local(opts: DiagnoseOptions, cleaned: SparkCleaning) -> DiagnoseOptions:
    """The options of the local engine on Spark's aggregate: ID-like columns were decided over
    the input's rows already (the aggregate has far fewer, so the rule must not run twice), and
    names of columns the aggregate lacks are left out."""
    kept = set(cleaned.columns)
    levels = [tuple(c for c in h if c in kept) for h in opts.hierarchies]
    return dataclasses.replace(
        opts,
        id_share=1.0,
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
