"""Small generated logs shared by the diagnose tests, and one Spark session for all of them."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from stalwart.diagnose.synth import SyntheticLog, make_failure_log


@pytest.fixture(scope="session")
def log2() -> SyntheticLog:
    """20k rows, 8 columns, a 1-item and a 2-item cause."""
    return make_failure_log(
        20_000, columns=8, causes=2, depth=(1, 2), seed=3, coverage=(0.02, 0.08)
    )


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One ``local[1]`` Spark session for every Spark test of the run; skips without Java or
    pyspark.

    Starting the JVM and compiling the first query's code take most of a Spark test's time: the
    driver JVM gets the client JIT only and the serial GC (half the JVM's CPU time for these
    small queries on 2 cores; neither changes what a query computes).
    """
    if shutil.which("java") is None:
        pytest.skip("Spark needs Java")
    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[1]")
        .appName("stalwart-rca-test")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        .getOrCreate()
    )
    yield session
    session.stop()
