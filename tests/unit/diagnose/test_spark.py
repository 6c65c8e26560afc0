"""The Spark engine on a local session gives the DuckDB engine's answer (one small test on the
run's shared session, ``spark`` in conftest.py: starting Spark dominates its time)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from stalwart.diagnose import analyze
from stalwart.diagnose.synth import SyntheticLog

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas"),
]


def test_spark_engine_matches_duckdb(spark: Any, log2: SyntheticLog) -> None:
    from stalwart.diagnose.spark import analyze_spark

    table = log2.table.slice(0, 8000)
    frame = spark.createDataFrame(
        table.cast(table.schema.set(0, table.schema.field(0).with_type(pa.string())))
    )
    d = analyze_spark(frame, "failed", spark=spark)
    want = analyze(table, "failed")
    assert [f.items for f in d.findings] == [f.items for f in want.findings]
    assert [f.failures for f in d.findings] == [f.failures for f in want.findings]
    assert ("host_id", "dropped") in {(c["column"], c["action"]) for c in d.cleaning}
