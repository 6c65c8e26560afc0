"""More inputs for analyze(): JSON lines, s3:// URLs (local moto server), polars LazyFrames.

Each must give the same findings as the Parquet path on the same generated log.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet as pq
import pytest

from stalwart.diagnose import DiagnoseOptions, Diagnosis, analyze
from stalwart.diagnose.synth import SyntheticLog
from stalwart.errors import ConfigError

pytestmark = pytest.mark.timeout(180)


def _found(d: Diagnosis) -> list[dict[str, str]]:
    return [f.items for f in d.findings]


@pytest.fixture(scope="module")
def plain(log2: SyntheticLog) -> pa.Table:
    """The log with plain string columns (as every text format reads them back)."""
    schema = pa.schema(
        [(f.name, pa.string() if f.name != "failed" else pa.bool_()) for f in log2.table.schema]
    )
    return log2.table.cast(schema)


@pytest.fixture(scope="module")
def expected(plain: pa.Table, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    path = tmp_path_factory.mktemp("ref") / "log.parquet"
    pq.write_table(plain, path)
    found = _found(analyze(path, "failed"))
    assert found  # the generated causes are there to be found
    return found


def _write_jsonl(table: pa.Table, path: Path) -> None:
    con = duckdb.connect()
    con.register("t", table)
    con.sql(f"COPY t TO '{path}' (FORMAT JSON)")  # one object per line
    con.close()


@pytest.mark.parametrize("suffix", [".jsonl", ".ndjson"])
def test_json_lines_give_the_parquet_findings(
    suffix: str, plain: pa.Table, expected: list[dict[str, str]], tmp_path: Path
) -> None:
    path = tmp_path / f"log{suffix}"
    _write_jsonl(plain, path)
    assert path.read_text().startswith("{")
    assert _found(analyze(path, "failed")) == expected


def test_json_lines_glob(plain: pa.Table, expected: list[dict[str, str]], tmp_path: Path) -> None:
    half = plain.num_rows // 2
    _write_jsonl(plain.slice(0, half), tmp_path / "a.jsonl")
    _write_jsonl(plain.slice(half), tmp_path / "b.jsonl")
    assert _found(analyze(str(tmp_path / "*.jsonl"), "failed")) == expected


def test_malformed_json_line_is_a_config_error_and_can_be_skipped(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = [
        f'{{"a": "x{i % 3}", "b": "y{i % 2}", "failed": {str(i % 3 == 0).lower()}}}'
        for i in range(60)
    ]
    path.write_text("\n".join([*good[:30], '{"a": "x1", "b": ', *good[30:]]) + "\n")
    with pytest.raises(ConfigError, match=r"malformed JSON lines.*skip_bad_lines"):
        analyze(path, "failed")
    d = analyze(path, "failed", skip_bad_lines=True, options=DiagnoseOptions(min_lift=1.0))
    assert d.total_rows == 60
    assert any("skipped 1 malformed" in n for n in d.notes)


def test_lazyframe_gives_the_same_findings_without_collecting(
    plain: pa.Table, expected: list[dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pl = pytest.importorskip("polars")
    path = tmp_path / "log.parquet"
    pq.write_table(plain, path)
    lazy = pl.scan_parquet(path).filter(pl.col("failed").is_not_null())

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the LazyFrame was collected into memory")

    # The streaming path must not materialise the frame: collecting is refused outright.
    monkeypatch.setattr(pl.LazyFrame, "collect", refuse)
    monkeypatch.setattr(pl.LazyFrame, "to_arrow", refuse, raising=False)
    assert _found(analyze(lazy, "failed")) == expected


def test_lazyframe_with_a_failing_query_is_a_config_error() -> None:
    pl = pytest.importorskip("polars")
    lazy = pl.LazyFrame({"a": ["x", "y"], "failed": [True, False]}).select(pl.col("nope"))
    with pytest.raises(ConfigError, match="LazyFrame"):
        analyze(lazy, "failed")


@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl"])
def test_s3_url_gives_the_same_findings(
    fmt: str,
    plain: pa.Table,
    expected: list[dict[str, str]],
    s3_server: Any,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    import fsspec

    local = tmp_path / f"log.{fmt}"
    if fmt == "parquet":
        pq.write_table(plain, local)
    elif fmt == "csv":
        pyarrow.csv.write_csv(plain, local)
    else:
        _write_jsonl(plain, local)
    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    fs.put(str(local), f"{s3_bucket}/logs/log.{fmt}")
    url = f"s3://{s3_bucket}/logs/log.{fmt}"
    d = analyze(url, "failed", storage_options=s3_server.storage_options)
    assert _found(d) == expected


def test_s3_glob_over_parts(
    plain: pa.Table,
    expected: list[dict[str, str]],
    s3_server: Any,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    import fsspec

    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    half = plain.num_rows // 2
    for i, part in enumerate((plain.slice(0, half), plain.slice(half))):
        pq.write_table(part, tmp_path / f"part{i}.parquet")
        fs.put(str(tmp_path / f"part{i}.parquet"), f"{s3_bucket}/logs/part{i}.parquet")
    url = f"s3://{s3_bucket}/logs/*.parquet"
    assert _found(analyze(url, "failed", storage_options=s3_server.storage_options)) == expected


def test_s3_twice_on_the_callers_connection(s3_server: Any, s3_bucket: str) -> None:
    import fsspec

    from stalwart.diagnose.source import open_source

    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    with fs.open(f"{s3_bucket}/x.parquet", "wb") as f:
        pq.write_table(pa.table({"a": ["x", "y"], "failed": [True, False]}), f)
    con = duckdb.connect()
    for _ in range(2):  # the second registers its filesystem over the first one's
        src = open_source(
            f"s3://{s3_bucket}/x.parquet", connection=con, storage_options=s3_server.storage_options
        )
        assert src.sql("SELECT count(*) FROM {src}").fetchall() == [(2,)]
        src.close()
    con.close()


def test_s3_missing_object_says_what_to_check(s3_server: Any, s3_bucket: str) -> None:
    with pytest.raises(ConfigError, match=r"no such object.*storage_options"):
        analyze(
            f"s3://{s3_bucket}/nope.parquet", "failed", storage_options=s3_server.storage_options
        )


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("java") is None, reason="Spark needs Java")
@pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas")
def test_spark_engine_reads_json_lines(
    spark: Any, plain: pa.Table, expected: list[dict[str, str]], tmp_path: Path
) -> None:
    from stalwart.diagnose.spark import analyze_spark

    path = tmp_path / "log.jsonl"
    _write_jsonl(plain, path)
    assert _found(analyze_spark(str(path), "failed", spark=spark)) == expected


def test_the_callers_connection_is_left_as_it_was_given(tmp_path: Path) -> None:
    # Each open_source on a caller's connection left its view, a full temporary copy of a
    # CSV input, and the registered frame (holding the caller's data alive) behind.
    import gc
    import weakref

    import polars as pl

    from stalwart.diagnose.source import open_source

    table = pa.table({"a": ["x", "y", "x"], "failed": [True, False, True]})
    pyarrow.csv.write_csv(table, tmp_path / "log.csv")
    con = duckdb.connect()
    con.execute("CREATE TABLE mine AS SELECT 1 AS one")  # the caller's own: kept
    frame = pl.from_arrow(table)
    ref = weakref.ref(frame)
    for data in (str(tmp_path / "log.csv"), table, frame):
        src = open_source(data, connection=con)
        assert src.sql("SELECT count(*) FROM {src}").fetchall() == [(3,)]
        src.close()
    del frame, data
    gc.collect()
    names = {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
    names |= {
        r[0]
        for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()
    }
    assert names == {"mine"}, names
    assert ref() is None, "the caller's frame is still referenced by the connection"
    con.close()
