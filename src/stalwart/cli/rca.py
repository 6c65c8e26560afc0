"""``stalwart rca``: which combinations of attribute values single out the failures in a log
(``--label``), or explain a KPI's deviation from its forecast (``--actual``/``--expected``), or,
given a folder of runs' fleet logs (docs/diagnose.md, "Fleet logs"), single out each kind of
fault (crash, hang, straggler, SDC suspect; ``--label KIND`` picks kinds).

Exit status: 0 when the analysis ran (with findings, or with a clear "nothing found"); 2 for bad
input (a missing or misspelt column, an unreadable file, a bad option), reported as one short
red line on stderr with what to do next, never a traceback. ``--json`` prints JSON alone on
stdout so it can be piped (stderr keeps the summary and notes, never the table);
``--json-out FILE`` writes it to a file. A ``--label`` that is not a column must be one SQL
expression over the log's columns (``stalwart.diagnose.expression`` checks it; anything more,
such as a second statement, a subquery or a file function, exits with 2 and names the part).
"""

from __future__ import annotations

import enum
import glob
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from stalwart.cli.conventions import JSON_HELP, check_outputs, file_out, handled, write_file

__all__ = ["rca", "register"]


class Engine(str, enum.Enum):
    """``--engine``: where the analysis runs."""

    duckdb = "duckdb"
    spark = "spark"


def _pair(value: str | None, what: str) -> str | tuple[str, str] | None:
    if value is None:
        return None
    parts = [p.strip() for p in value.split(",")]
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2 and all(parts):
        return (parts[0], parts[1])
    raise typer.BadParameter(f"{what}: one column, or NUMERATOR,DENOMINATOR")


_JsonOut = Annotated[Path | None, typer.Option(
    "--json-out", callback=file_out, help="Also write the JSON result to this file."
)]  # fmt: skip
_HtmlOut = Annotated[
    Path | None, typer.Option("--html", callback=file_out, help="Write an HTML report.")
]


def _names(values: list[str]) -> list[str]:
    return [n.strip() for v in values for n in v.split(",") if n.strip()]


def rca(
    data: Annotated[str, typer.Argument(help="CSV/Parquet file or glob, SQL, or folder of runs.")],
    label: Annotated[
        str | None,
        typer.Option(
            "--label",
            "-l",
            help="Failure label: a column, or one SQL condition over the columns such as "
            "\"status != 'ok'\" (no subqueries, no table or file functions).",
        ),
    ] = None,
    weight: Annotated[
        str | None, typer.Option(help="Column counting the events each row stands for.")
    ] = None,
    actual: Annotated[
        str | None, typer.Option(help="KPI mode: actual value column, or NUM,DEN of a ratio.")
    ] = None,
    expected: Annotated[
        str | None, typer.Option(help="KPI mode: expected value column, or NUM,DEN.")
    ] = None,
    columns: Annotated[
        list[str], typer.Option("--columns", help="Attribute columns (default: all).")
    ] = [],  # noqa: B006 - typer reads the default
    exclude: Annotated[list[str], typer.Option("--exclude", "-x", help="Columns to skip.")] = [],  # noqa: B006
    keep: Annotated[
        list[str], typer.Option(help="Columns never dropped as ID-like nor folded.")
    ] = [],  # noqa: B006
    hierarchy: Annotated[
        list[str], typer.Option(help="Nested columns, coarsest first: region,rack,host.")
    ] = [],  # noqa: B006
    min_support: Annotated[float, typer.Option(help="Share of failures a set must cover.")] = 0.05,
    max_len: Annotated[int, typer.Option(help="Most attribute values in one finding.")] = 3,
    min_lift: Annotated[float, typer.Option(help="Smallest lift of a finding.")] = 1.5,
    max_findings: Annotated[int, typer.Option(help="Most findings reported.")] = 10,
    memory_limit: Annotated[
        str | None, typer.Option(help="DuckDB memory limit, e.g. 4GB; spills beyond it.")
    ] = None,
    engine: Annotated[Engine, typer.Option(help="Query engine.")] = Engine["duckdb"],
    skip_bad_lines: Annotated[
        bool, typer.Option(metavar="", help="Skip malformed CSV lines.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", metavar="", help=JSON_HELP)] = False,
    json_out: _JsonOut = None,
    html_out: _HtmlOut = None,
) -> None:
    """Find the attribute combinations that single out failures, or explain a KPI deviation."""
    with handled():
        check_outputs({"--json-out": json_out, "--html": html_out}, _inputs(data))
        d = _analyse(
            data,
            label,
            weight,
            _pair(actual, "--actual"),
            _pair(expected, "--expected"),
            engine.value,
            skip_bad_lines,
            {
                "columns": _names(columns) or None,
                "exclude": tuple(_names(exclude)),
                "keep": tuple(_names(keep)),
                "hierarchies": tuple(tuple(_names([h])) for h in hierarchy),
                "min_support": min_support,
                "max_len": max_len,
                "min_lift": min_lift,
                "max_findings": max_findings,
                "memory_limit": memory_limit,
            },
        )
        if as_json:
            typer.echo(d.to_json())
        _write(d, json_out, html_out)
    _show(d, Console(stderr=as_json), table=not as_json, html_out=html_out)


def _write(d: Any, json_out: Path | None, html_out: Path | None) -> None:
    """The files asked for, each written atomically."""
    if json_out is not None:
        write_file(json_out, d.to_json())
    if html_out is not None:
        from stalwart.diagnose.report import render_html

        write_file(html_out, render_html(d, title="stalwart root-cause report"))


_READ = (".csv", ".parquet", ".pq", ".parq", ".jsonl")  # in a folder DATA: what may be read


def _inputs(data: str) -> dict[str, Path | None]:
    """The files DATA names, which no output may replace: a file, a glob's matches, the logs
    in a folder (its Parquet files, or its runs' fleet logs)."""
    try:  # SQL is no path: one past NAME_MAX raises ENAMETOOLONG
        paths = [Path(p) for p in glob.glob(data)] if glob.has_magic(data) else [Path(data)]
        found = [q for p in paths if p.is_dir() for q in p.rglob("*") if q.suffix in _READ]
        return {f"the log {p}": p for p in [*found, *paths] if p.is_file()}
    except OSError:
        return {}


def _show(d: Any, out: Console, *, table: bool, html_out: Path | None) -> None:
    """The summary and notes on ``out``; the findings' table only when ``table`` (with
    ``--json`` stdout holds the JSON document alone and stderr only messages). A fleet's
    analysis shows its summary, then each kind of fault as a section."""
    if d.mode == "fleet":
        out.print(escape(d.summary()))
        for note in d.notes:
            out.print(f"[dim]{escape(note)}[/]")
        for kind, k in d.kinds.items():
            out.rule(f"[bold]{escape(kind)}[/]", align="left")
            _show(k, out, table=table, html_out=None)
        if html_out is not None:
            out.print(f"report: {html_out}")
        return
    what = "failures" if d.mode == "events" else "deviation"
    out.print(
        f"{d.total_failures:,.0f} {what} in {d.total_rows:,.0f} rows "
        f"({d.groups:,} groups, {d.candidates:,} item-sets scored)"
    )
    for step in d.cleaning:
        if step["action"] != "nulls":
            out.print(
                f"[dim]cleaning: {escape(step['column'])} {step['action']}: "
                f"{escape(step['detail'])}[/]"
            )
    for note in d.notes:
        out.print(f"[dim]{escape(note)}[/]")
    if d.findings and table:
        out.print(d.table())
    elif d.findings:
        out.print(f"{len(d.findings)} finding(s): see the JSON document")
    else:
        out.print(f"[yellow]{escape(d.message)}[/]")
    if html_out is not None:
        out.print(f"report: {html_out}")


def _analyse(
    data: str,
    label: str | None,
    weight: str | None,
    actual: Any,
    expected: Any,
    engine: str,
    skip_bad_lines: bool,
    kw: dict[str, Any],
) -> Any:
    from stalwart.diagnose import DiagnoseOptions, analyze, localize
    from stalwart.diagnose.fleet import fleet_runs
    from stalwart.errors import ConfigError

    if engine not in ("duckdb", "spark"):
        raise ConfigError(f"--engine {engine!r}: use duckdb or spark")
    runs = fleet_runs(data)
    if runs == []:
        raise ConfigError(
            f"{data} is a folder with nothing to analyse: no runs (folders with a members.jsonl, "
            "as `stalwart run` writes them) and no Parquet files; give a folder of runs, or a "
            "CSV/Parquet log file or a glob of them"
        )
    if runs is not None:
        if weight is not None or actual is not None or expected is not None or engine != "duckdb":
            raise ConfigError(
                f"{data} is a folder of runs: it is analysed per fault kind with the duckdb "
                "engine; drop --weight, --actual, --expected and --engine (--label KIND picks "
                "kinds)"
            )
        return _fleet(data, label, skip_bad_lines, kw)
    kpi = actual is not None or expected is not None
    if kpi and label is not None:
        raise ConfigError(
            "--label and --actual/--expected exclude each other: --label analyses labelled "
            "events, --actual with --expected explains a KPI's deviation; drop one of them"
        )
    if kpi and (actual is None or expected is None):
        raise ConfigError("KPI mode needs both --actual and --expected")
    if not kpi and label is None:
        raise ConfigError("give --label (labelled events) or --actual and --expected (a KPI)")
    columns = kw.pop("columns")
    opts = DiagnoseOptions(**kw)
    if kpi:
        if engine == "spark":
            from stalwart.diagnose.spark import localize_spark

            return localize_spark(data, actual, expected, columns=columns, options=opts)
        return localize(
            data, actual, expected, columns=columns, options=opts, skip_bad_lines=skip_bad_lines
        )
    assert label is not None
    if engine == "spark":
        from stalwart.diagnose.spark import analyze_spark

        return analyze_spark(data, label, weight=weight, columns=columns, options=opts)
    return analyze(
        data, label, weight=weight, columns=columns, options=opts, skip_bad_lines=skip_bad_lines
    )


def _fleet(data: str, label: str | None, skip_bad_lines: bool, kw: dict[str, Any]) -> Any:
    """A folder of runs: one analysis per fault kind (``--label`` names the kinds wanted)."""
    from stalwart.diagnose import DiagnoseOptions, analyze_fleet

    columns = kw.pop("columns")
    kinds = _names([label]) if label is not None else None
    return analyze_fleet(
        data,
        kinds=kinds,
        columns=columns,
        options=DiagnoseOptions(**kw),
        skip_bad_lines=skip_bad_lines,
    )


def register(app: typer.Typer) -> None:
    """Add the ``rca`` command to ``app``."""
    app.command("rca")(rca)
