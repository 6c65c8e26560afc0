"""A label is one expression over the log's columns and nothing more (issue 23): SQL payloads
that read or write files, chain statements, call table functions or hide a tail in comments are
refused with a ConfigError (CLI: exit 2) naming the bad part, before anything runs; legitimate
conditions keep working. Also: stalwart's own connection has no external access once the
input is in place, and ``rca --json`` keeps the table off stderr."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from stalwart.cli import rca
from stalwart.diagnose import DiagnoseOptions, analyze
from stalwart.diagnose.expression import check_expression
from stalwart.diagnose.source import open_source
from stalwart.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

SECRET = "CANARY-SECRET-5b1e"
N = 600


def _rows() -> dict[str, list[Any]]:
    # rack r1 with kernel k1 (i % 12 == 1) always fails: a cause to find
    fail = [i % 7 == 0 or i % 12 == 1 for i in range(N)]
    status = ["fail" if f else ("error" if i % 11 == 0 else "ok") for i, f in enumerate(fail)]
    return {
        "rack": [f"r{i % 4}" for i in range(N)],
        "kernel": [f"k{i % 3}" for i in range(N)],
        "region": ["eu" if i % 2 else "us" for i in range(N)],
        "status": status,
        "latency_ms": [(i * 37) % 1000 for i in range(N)],
        "ok": [s == "ok" for s in status],
        "latency ms": [(i * 37) % 1000 for i in range(N)],
    }


@pytest.fixture()
def canary(tmp_path: Path) -> dict[str, Path]:
    """A secret file a payload may try to read, and paths it may try to write."""
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET + "\n")
    pq.write_table(pa.table({"x": [SECRET]}), tmp_path / "secret.parquet")
    return {
        "secret": secret,
        "parquet": tmp_path / "secret.parquet",
        "out": tmp_path / "written.csv",
        "db": tmp_path / "attached.db",
        "dir": tmp_path,
    }


# (payload with {secret}/{parquet}/{out}/{db}/{dir} placeholders, what the message names)
PAYLOADS = [
    ("(select content from read_text('{secret}')) like 'CANARY%'", "subquery"),
    ("read_text('{secret}') IS NOT NULL", "function read_text"),
    ("length(CAST(read_blob('{secret}') AS VARCHAR)) > 0", "function read_blob"),
    ("status IN (SELECT column0 FROM read_csv('{secret}'))", "subquery"),
    ("EXISTS (SELECT * FROM read_parquet('{parquet}'))", "subquery"),
    ("read_parquet('{parquet}') IS NULL", "function read_parquet"),
    ("\"READ_TEXT\"('{secret}') = 'x'", "function read_text"),
    ("system.main.read_text('{secret}') = 'x'", "qualified function"),
    ("1) ; COPY (SELECT 42) TO '{out}' ; SELECT (1", "3 SQL statements"),
    ("status = 'fail'); COPY (SELECT '{secret}') TO '{out}'; SELECT ('", "unterminated string"),
    ("status = 'fail'); COPY (SELECT '{secret}') TO '{out}'; SELECT ('x'", "3 SQL statements"),
    ("status = 'fail'; COPY (SELECT 1) TO '{out}'", "not a valid expression"),
    ("1) ; SET enable_external_access = true ; SELECT (1", "3 SQL statements"),
    ("1) ; PRAGMA database_list ; SELECT (1", "3 SQL statements"),
    ("1) ; ATTACH '{db}' AS x ; SELECT (1", "3 SQL statements"),
    ("1) ; INSTALL httpfs ; LOAD httpfs ; SELECT (1", "4 SQL statements"),
    ("glob('{dir}/*') IS NOT NULL", "function glob"),
    ("(SELECT count(*) FROM glob('/etc/*')) > 0", "subquery"),
    ("status IN (SELECT range FROM range(3))", "subquery"),
    ("range(3) = [1]", "function range"),
    ("query('SELECT 42') IS NULL", "function query"),
    ("getenv('HOME') = 'x'", "function getenv"),
    ("current_setting('temp_directory') = ''", "function current_setting"),
    ("1), (SELECT content FROM read_text('{secret}')", "not one expression"),
    ("1) FROM read_text('{secret}') WHERE (1", "not a valid expression"),
    ("1)) UNION SELECT (content FROM read_text('{secret}')", "not a valid expression"),
    ("status = 'fail' --\n) FROM read_text('{secret}') --", "not a valid expression"),
    ("status = 'fail' /* ) FROM read_text('{secret}') */ OR (1", "not a valid expression"),
    ("status = 'fail' /*", "not a valid expression"),
    ('"status"" = 1; COPY (SELECT 1) TO \'{out}\'; --" = 1', "no column"),
    ("'it''s'); COPY (SELECT 1) TO '{out}'; SELECT ('it''s'", "3 SQL statements"),
    ("COLUMNS(*) IS NOT NULL", r"\* or COLUMNS"),
    ("t.status = 'fail'", "qualified name"),
    ("count(ok) > 1", "function count"),
    ("sum(latency_ms) OVER () > 1", "window function"),
    ("list_transform([1], x -> x) = [1]", "function list_transform"),
    ("$1", "not one expression"),
]

LEGIT = [
    ("status = 'fail'", lambda r: r["status"] == "fail"),
    (
        "latency_ms > 500 AND region <> 'eu'",
        lambda r: r["latency_ms"] > 500 and r["region"] != "eu",
    ),
    ("lower(status) IN ('fail','error')", lambda r: r["status"] in ("fail", "error")),
    ("NOT ok", lambda r: not r["ok"]),
    (
        "CASE WHEN latency_ms > 900 THEN true ELSE status = 'fail' END",
        lambda r: r["latency_ms"] > 900 or r["status"] == "fail",
    ),
    ('"latency ms" BETWEEN 100 AND 200', lambda r: 100 <= r["latency ms"] <= 200),
    ("upper(STATUS) = 'FAIL' -- a comment", lambda r: r["status"] == "fail"),
    (
        "status LIKE 'e%' OR CAST(latency_ms AS INTEGER) % 13 = 0",
        lambda r: r["status"] == "error" or r["latency_ms"] % 13 == 0,
    ),
]


def _fill(payload: str, canary: dict[str, Path]) -> str:
    return payload.format(**{k: str(v) for k, v in canary.items()})


def _no_side_effects(canary: dict[str, Path], *texts: str) -> None:
    assert not canary["out"].exists(), "a payload wrote a file"
    assert not canary["db"].exists(), "a payload attached a database"
    for text in texts:
        assert SECRET not in text, "the secret leaked into an output"


@pytest.mark.parametrize(("payload", "named"), PAYLOADS)
def test_payloads_are_refused_before_anything_runs(
    payload: str, named: str, canary: dict[str, Path]
) -> None:
    label = _fill(payload, canary)
    with pytest.raises(ConfigError, match=named) as info:
        analyze(pa.table(_rows()), label)
    _no_side_effects(canary, str(info.value))


@pytest.mark.parametrize(("label", "truth"), LEGIT, ids=[t for t, _ in LEGIT])
def test_legitimate_labels_keep_working(label: str, truth: Any) -> None:
    rows = _rows()
    table = pa.table(rows)
    want = sum(truth(r) for r in table.to_pylist())
    d = analyze(table, label, options=DiagnoseOptions(example_rows=0))
    assert d.total_failures == want
    read = check_expression(label, table.column_names).columns
    assert not read & set(d.columns), "columns the label reads are not attributes"


def test_a_bare_column_name_still_is_a_label() -> None:
    rows = _rows()
    rows["failed"] = [s != "ok" for s in rows["status"]]
    d = analyze(pa.table(rows), "failed", options=DiagnoseOptions(example_rows=0))
    assert d.total_failures == sum(rows["failed"])


def test_the_sql_that_runs_is_duckdbs_rendering_of_the_checked_tree() -> None:
    e = check_expression("status = 'fail' /* hidden */ -- tail", ["status"])
    assert e.sql == "((status = 'fail'))" and e.columns == {"status"}
    e = check_expression('"a""b" = 1 AND "select" > 2', ['a"b', "select"])
    assert e.sql == '((("a""b" = 1) AND ("select" > 2)))'


def test_own_connection_has_no_external_access(canary: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    data = tmp_path / "logs" / "log.parquet"
    pq.write_table(pa.table(_rows()), data)
    sources = (str(data), str(data.parent / "*.parquet"), str(data.parent), pa.table(_rows()))
    for source in sources:
        with open_source(source) as src:
            assert src.sql("SELECT count(*) FROM {src}").fetchall()[0][0] == N
            for sql in (
                f"SELECT content FROM read_text('{canary['secret']}')",
                f"COPY (SELECT 1) TO '{canary['out']}'",
                "SET enable_external_access = true",
            ):
                with pytest.raises(Exception, match=r"disabled|Cannot enable"):
                    src.sql(sql).fetchall()
    _no_side_effects(canary)


def test_sql_input_is_one_query(canary: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="2 statement"):
        open_source(f"SELECT 1 AS x; COPY (SELECT 1) TO '{canary['out']}'")
    _no_side_effects(canary)


def test_memory_limit_is_a_size() -> None:
    with pytest.raises(ConfigError, match="memory_limit"):
        DiagnoseOptions(memory_limit="1GB'; COPY (SELECT 1) TO 'x.csv'; SET a='")


# --- the CLI -----------------------------------------------------------------------------

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    local = typer.Typer()
    local.callback()(lambda: None)
    rca.register(local)
    return local


@pytest.fixture()
def csv(tmp_path: Path) -> Path:
    path = tmp_path / "log.csv"
    pacsv.write_csv(pa.table(_rows()), path)
    return path


def _run(app: typer.Typer, *args: object) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, ["rca", *map(str, args)], env=ENV)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.stdout, r.stderr


@pytest.mark.parametrize(("payload", "named"), PAYLOADS)
def test_cli_refuses_payloads_with_exit_2(
    app: typer.Typer, csv: Path, payload: str, named: str, canary: dict[str, Path]
) -> None:
    code, out, err = _run(app, csv, "--label", _fill(payload, canary))
    assert code == 2, err
    assert "Traceback" not in out + err and out == ""
    assert re.search(named, " ".join(err.split())), err
    _no_side_effects(canary, out, err)


def test_cli_json_keeps_stdout_pure_and_the_table_off_stderr(app: typer.Typer, csv: Path) -> None:
    code, out, err = _run(app, csv, "--label", "status = 'fail'", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["findings"], "the fixture's failures have a cause to find"
    assert "│" not in err and "finding(s)" in err
    code, out, _ = _run(app, csv, "--label", "status = 'fail'")
    assert code == 0 and "│" in out


def test_cli_boolean_flags_are_plain_switches(app: typer.Typer) -> None:
    code, out, _ = _run(app, "--help")
    assert code == 0
    lines = [ln for ln in out.splitlines() if "--json " in ln or "--skip-bad-lines" in ln]
    assert len(lines) == 2 and not any("<bool>" in ln for ln in lines)


# --- the Spark engine --------------------------------------------------------------------

SPARK_PAYLOADS = [
    ("reflect('java.lang.System', 'getenv', 'HOME') = 'x'", "function reflect"),
    ("java_method('java.lang.System', 'exit', 0) = 1", "function java_method"),
    ("(SELECT count(*) FROM text.`{secret}`) > 0", "subquery"),
    ("status IN (SELECT value FROM text.`{secret}`)", "subquery"),
    ("EXISTS (SELECT 1)", "subquery"),
    ("input_file_name() = ''", "function input_file_name"),
    ("'${{env:HOME}}' = status", r"\$\{"),
    ("status = 'fail'; SELECT 1", "not one valid Spark SQL expression"),
    ("t.status = 'fail'", "qualified name"),
]


def test_spark_labels_are_checked_by_the_same_rules(spark: Any, canary: dict[str, Path]) -> None:
    from stalwart.diagnose.spark import analyze_spark

    frame = spark.createDataFrame(pa.table(_rows()).to_pandas())
    for payload, named in SPARK_PAYLOADS:
        with pytest.raises(ConfigError, match=named) as info:
            analyze_spark(frame, _fill(payload, canary), spark=spark)
        _no_side_effects(canary, str(info.value))
    label = "lower(status) IN ('fail') AND `latency ms` >= 0"
    d = analyze_spark(frame, label, spark=spark, options=DiagnoseOptions(example_rows=0))
    assert d.total_failures == sum(s == "fail" for s in _rows()["status"])
    assert "status" not in d.columns and "latency ms" not in d.columns
