"""analyze(): finds injected causes, prunes their neighbours, reads every input kind."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stalwart.diagnose import Diagnosis, analyze
from stalwart.diagnose.synth import SyntheticLog

pytestmark = pytest.mark.timeout(120)


def _found(d: Diagnosis) -> list[dict[str, str]]:
    return [f.items for f in d.findings]


def test_finds_each_injected_cause_and_nothing_else(log2: SyntheticLog) -> None:
    d = analyze(log2.table, "failed")
    assert sorted(map(str, _found(d))) == sorted(map(str, log2.causes))
    for f in d.findings:
        assert f.lift_low <= f.lift <= f.lift_high
        assert f.lift_low > 2
        assert 0 < f.support <= 1 and 0 < f.explained <= f.support
        assert f.examples and all(e[k] == v for e in f.examples for k, v in f.items.items())
    assert any(f.subsumed for f in d.findings)  # supersets of the cause were pruned into it
    assert {"column": "host_id", "action": "dropped"}.items() <= d.cleaning[0].items()


def test_json_shape(log2: SyntheticLog, tmp_path: Path) -> None:
    d = analyze(log2.table, "failed")
    data = json.loads(d.to_json(tmp_path / "out.json"))
    assert json.loads((tmp_path / "out.json").read_text()) == data
    first = data["findings"][0]
    assert set(first) >= {"items", "support", "lift", "failures", "rows"}
    assert isinstance(first["items"], dict)


@pytest.mark.parametrize("kind", ["csv", "parquet", "pandas", "polars", "relation", "sql"])
def test_every_input_kind_gives_the_same_answer(
    kind: str, log2: SyntheticLog, tmp_path: Path
) -> None:
    table = log2.table.cast(
        pa.schema(
            [(f.name, pa.string() if f.name != "failed" else pa.bool_()) for f in log2.table.schema]
        )
    )
    expected = _found(analyze(table, "failed"))
    path = tmp_path / "log.parquet"
    pq.write_table(table, path)
    con = duckdb.connect()
    data: object
    if kind == "csv":
        data = tmp_path / "log.csv"
        con.sql(f"COPY (SELECT * FROM read_parquet('{path}')) TO '{data}' (HEADER)")
    elif kind == "parquet":
        data = str(path)
    elif kind == "pandas":
        data = table.to_pandas()
    elif kind == "polars":
        import polars as pl

        data = pl.from_arrow(table)
    elif kind == "relation":
        data = con.sql(f"SELECT * FROM read_parquet('{path}')")
    else:
        data = f"SELECT * FROM read_parquet('{path}')"
    assert _found(analyze(data, "failed")) == expected


def test_predicate_label_and_weighted_input_agree(log2: SyntheticLog) -> None:
    con = duckdb.connect()
    con.register("log", log2.table)
    cols = ", ".join(c for c in log2.table.column_names if c.startswith("c"))
    raw = con.sql(
        f"SELECT {cols}, CASE WHEN failed THEN 'error' ELSE 'ok' END AS status FROM log"
    ).to_arrow_table()
    by_predicate = analyze(raw, "status != 'ok'")
    grouped = con.sql(f"SELECT {cols}, failed, count(*) AS n FROM log GROUP BY ALL")
    by_weight = analyze(grouped, "failed", weight="n")
    assert _found(by_predicate) == _found(by_weight)
    assert [f.failures for f in by_predicate.findings] == [f.failures for f in by_weight.findings]
    assert by_weight.total_rows == log2.table.num_rows
