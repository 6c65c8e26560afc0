"""The Spark engine gives the local engine's findings: labelled events with a numeric column it
must bucket, and KPI localization of an additive and a ratio KPI. One local[1] session for the
run (``spark`` in conftest.py: starting Spark dominates the time)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from stalwart.diagnose import DiagnoseOptions, Diagnosis, analyze, localize
from stalwart.errors import ConfigError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas"),
    pytest.mark.skipif(shutil.which("java") is None, reason="Spark needs Java"),
]


def _same(got: Diagnosis, want: Diagnosis) -> None:
    assert want.findings, want.message
    assert [f.items for f in got.findings] == [f.items for f in want.findings]
    assert [f.failures for f in got.findings] == pytest.approx([f.failures for f in want.findings])
    assert [f.rows for f in got.findings] == pytest.approx([f.rows for f in want.findings])
    assert [f.lift for f in got.findings] == pytest.approx([f.lift for f in want.findings])
    assert got.mode == want.mode
    assert got.total_failures == pytest.approx(want.total_failures)


def _events(n: int = 6000) -> pa.Table:
    rng = np.random.default_rng(7)
    zone = rng.choice(["z1", "z2", "z3", "z4"], n)
    kind = rng.choice(["a", "b", "c", "d", "e"], n)
    latency = np.round(rng.gamma(2.0, 50.0, n), 3)  # thousands of distinct values: bucketed
    slow = latency >= np.quantile(latency, 0.8)
    rate = np.where(slow & (zone == "z2"), 0.6, 0.03)
    rate = np.where(kind == "e", np.maximum(rate, 0.4), rate)
    failed = rng.random(n) < rate
    nulls = rng.random(n) < 0.02
    return pa.table(
        {
            "request": [f"req-{i}" for i in range(n)],  # ID-like: dropped by both engines
            "net.zone": zone,  # a dot in a name: no struct field for Spark
            "kind": kind,
            "latency_ms": pa.array(latency, mask=nulls),
            "failed": failed,
        }
    )


def test_events_with_numeric_buckets_match_local(spark: Any) -> None:
    from stalwart.diagnose.spark import analyze_spark

    table = _events()
    got = analyze_spark(spark.createDataFrame(table), "failed", spark=spark)
    want = analyze(table, "failed")
    _same(got, want)
    assert any("latency_ms" in f.items for f in want.findings)

    def steps(d: Diagnosis) -> set[tuple[str, str, str]]:
        return {
            (s["column"], s["action"], s["detail"])
            for s in d.cleaning
            if s["action"] in ("bucketed", "nulls")
        }

    assert steps(got) == steps(want)
    assert ("request", "dropped") in {(s["column"], s["action"]) for s in got.cleaning}


def _leaves(ratio: bool) -> pa.Table:
    rng = np.random.default_rng(11)
    dims = {"dc": 4, "svc": 6, "os": 3, "ver": 5}
    grid = np.stack(np.meshgrid(*(np.arange(k) for k in dims.values()), indexing="ij"), -1).reshape(
        -1, len(dims)
    )
    cols: dict[str, Any] = {n: [f"{n}{v}" for v in grid[:, i]] for i, n in enumerate(dims)}
    hit = (grid[:, 0] == 1) & (grid[:, 1] == 2)  # dc1 & svc2
    hit2 = grid[:, 3] == 4  # ver4
    expected = rng.uniform(100, 200, len(grid))
    if not ratio:
        actual = expected * rng.normal(1.0, 0.01, len(grid))
        actual[hit] *= 0.4
        actual[hit2] *= 0.6
        return pa.table({**cols, "revenue": actual, "forecast": expected})
    ok_rate = np.full(len(grid), 0.98)
    ok_rate[hit] = 0.6
    ok_rate[hit2] = 0.8
    requests = np.round(expected)
    ok = np.round(requests * ok_rate * rng.normal(1.0, 0.002, len(grid)))
    return pa.table(
        {**cols, "ok": ok, "req": requests, "ok_fc": np.round(requests * 0.98), "req_fc": requests}
    )


def test_kpi_additive_matches_local(spark: Any) -> None:
    from stalwart.diagnose.spark import localize_spark

    table = _leaves(ratio=False)
    got = localize_spark(spark.createDataFrame(table), "revenue", "forecast", spark=spark)
    _same(got, localize(table, "revenue", "forecast"))
    assert got.mode == "kpi-additive"


def test_kpi_ratio_matches_local(spark: Any) -> None:
    from stalwart.diagnose.spark import localize_spark

    table = _leaves(ratio=True)
    opts = DiagnoseOptions(max_findings=5)
    got = localize_spark(
        spark.createDataFrame(table), ("ok", "req"), ("ok_fc", "req_fc"), options=opts
    )
    _same(got, localize(table, ("ok", "req"), ("ok_fc", "req_fc"), options=opts))
    assert got.mode == "kpi-ratio"


def test_options_are_the_dataclass_only(spark: Any) -> None:
    from stalwart.diagnose.spark import analyze_spark, localize_spark

    frame = spark.createDataFrame(_events(50))
    with pytest.raises(ConfigError, match="expected a DiagnoseOptions"):
        analyze_spark(frame, "failed", options={"min_support": 0.1})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        analyze_spark(frame, "failed", min_support=0.1)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="both be single columns"):
        localize_spark(frame, "latency_ms", ("zone", "kind"))
    with pytest.raises(ConfigError, match="Did you mean 'latency_ms'"):
        localize_spark(frame, "latency", "latency_ms")
    weighted = spark.createDataFrame(_events(50).append_column("n", pa.array([-1.0] + [1.0] * 49)))
    with pytest.raises(ConfigError, match="weight column 'n' has 1 negative or NaN"):
        analyze_spark(weighted, "failed", weight="n")  # as the local engine refuses it
    missing = spark.createDataFrame(_events(50).append_column("n", pa.array([None] + [1.0] * 49)))
    with pytest.raises(ConfigError, match="weight column 'n' has 1 missing value"):
        analyze_spark(missing, "failed", weight="n")  # read as 0 the row would vanish unseen


def test_cli_kpi_mode_runs_on_spark(spark: Any, tmp_path: Path) -> None:
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from stalwart.cli.main import app

    table = _leaves(ratio=False)
    path = tmp_path / "leaves.parquet"
    pq.write_table(table, path)
    args = ["rca", str(path), "--actual", "revenue", "--expected", "forecast", "--json"]
    got = CliRunner().invoke(app, [*args, "--engine", "spark"], env={"NO_COLOR": "1"})
    want = CliRunner().invoke(app, args, env={"NO_COLOR": "1"})
    assert got.exit_code == 0, got.output
    found = json.loads(got.stdout)["findings"]
    assert found
    assert [f["items"] for f in found] == [f["items"] for f in json.loads(want.stdout)["findings"]]
