"""The Spark engine on a local session gives the DuckDB engine's answer (one small test:
starting Spark dominates its time)."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pytest

from stalwart.diagnose import analyze
from stalwart.diagnose.synth import SyntheticLog

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas"),
]


@pytest.mark.skipif(shutil.which("java") is None, reason="Spark needs Java")
def test_spark_engine_matches_duckdb(log2: SyntheticLog) -> None:
    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    from stalwart.diagnose.spark import analyze_spark

    spark = (
        SparkSession.builder.master("local[1]")
        .appName("stalwart-rca-test")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    try:
        table = log2.table.slice(0, 8000)
        frame = spark.createDataFrame(
            table.cast(table.schema.set(0, table.schema.field(0).with_type(pa.string())))
        )
        d = analyze_spark(frame, "failed", spark=spark)
        want = analyze(table, "failed")
        assert [f.items for f in d.findings] == [f.items for f in want.findings]
        assert [f.failures for f in d.findings] == [f.failures for f in want.findings]
        assert ("host_id", "dropped") in {(c["column"], c["action"]) for c in d.cleaning}
    finally:
        spark.stop()
