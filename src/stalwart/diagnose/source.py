"""Open any supported input as one DuckDB view, and turn bad input into clear ``ConfigError``\\s.

Accepted: a CSV or Parquet path (or glob), a SQL query string, a DuckDB relation, a pandas or
polars DataFrame, an Arrow table. Files are scanned lazily so DuckDB can aggregate tables larger
than memory, spilling to its temporary directory under ``memory_limit``; a CSV is parsed once into
a DuckDB temporary table (compressed, spillable) since the analysis reads it several times.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from stalwart.errors import ConfigError

__all__ = ["Source", "open_source", "quote", "suggest"]

log = logging.getLogger(__name__)

_SQL_START = re.compile(r"^\s*(select|with|from|values|\()", re.IGNORECASE)
_CSV_SUFFIXES = (".csv", ".tsv", ".txt", ".csv.gz", ".tsv.gz", ".csv.zst")
_PARQUET_SUFFIXES = (".parquet", ".pq", ".parq")


def quote(name: str) -> str:
    """Quote a column name for DuckDB SQL."""
    return '"' + name.replace('"', '""') + '"'


def suggest(name: str, names: list[str]) -> str:
    """`` Did you mean 'x'?`` for the closest names, or a list of the names when none is close."""
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    if not close:
        lowered = {n.lower(): n for n in names}
        close = [lowered[name.lower()]] if name.lower() in lowered else []
    if close:
        return " Did you mean " + " or ".join(repr(c) for c in close) + "?"
    shown = ", ".join(repr(n) for n in names[:20])
    return f" The columns are: {shown}{' ...' if len(names) > 20 else ''}."


@dataclass
class Source:
    """A view named ``name`` on ``con`` over the user's data, with its columns and types."""

    con: duckdb.DuckDBPyConnection
    name: str
    columns: list[str]
    types: dict[str, str]
    notes: list[str] = field(default_factory=list)
    owns_connection: bool = True
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    def sql(self, query: str) -> duckdb.DuckDBPyRelation:
        """Run ``query`` (which may name ``{src}``) against the source."""
        return self.con.sql(query.replace("{src}", self.name))

    def close(self) -> None:
        if self.owns_connection:
            self.con.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _connect(
    memory_limit: str | None, temp_directory: str | None, threads: int | None
) -> tuple[duckdb.DuckDBPyConnection, tempfile.TemporaryDirectory[str] | None]:
    tmp = None
    if temp_directory is None:
        tmp = tempfile.TemporaryDirectory(prefix="stalwart-rca-")
        temp_directory = tmp.name
    config: dict[str, Any] = {"temp_directory": temp_directory}
    if memory_limit:
        config["memory_limit"] = memory_limit
    if threads:
        config["threads"] = threads
    try:
        con = duckdb.connect(config=config)
    except duckdb.Error as e:
        raise ConfigError(f"DuckDB refused the engine settings {config}: {e}") from e
    return con, tmp


def open_source(
    data: Any,
    *,
    connection: duckdb.DuckDBPyConnection | None = None,
    memory_limit: str | None = None,
    temp_directory: str | None = None,
    threads: int | None = None,
    skip_bad_lines: bool = False,
) -> Source:
    """Register ``data`` as a view and describe its columns.

    Raises:
        ConfigError: the file is missing, empty, not CSV/Parquet, malformed, or has no columns.
    """
    name = "stalwart_src_" + uuid.uuid4().hex[:8]
    owns = connection is None
    tmp = None
    if connection is None:
        con, tmp = _connect(memory_limit, temp_directory, threads)
    else:
        con = connection
    notes: list[str] = []
    try:
        _register(con, name, data, notes, skip_bad_lines)
        desc = con.sql(f"DESCRIBE SELECT * FROM {name}").fetchall()
    except ConfigError:
        if owns:
            con.close()
        if tmp is not None:
            tmp.cleanup()
        raise
    except duckdb.Error as e:
        if owns:
            con.close()
        if tmp is not None:
            tmp.cleanup()
        raise ConfigError(f"could not read the input: {_first_line(e)}") from e
    columns = [str(r[0]) for r in desc]
    types = {str(r[0]): str(r[1]) for r in desc}
    if not columns:
        raise ConfigError("the input has no columns")
    return Source(con, name, columns, types, notes, owns, tmp)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _register(
    con: duckdb.DuckDBPyConnection, name: str, data: Any, notes: list[str], skip_bad: bool
) -> None:
    if isinstance(data, duckdb.DuckDBPyRelation):
        # A relation belongs to its own connection; bring its rows over as Arrow.
        con.register(name + "_arrow", data.to_arrow_table())
        con.execute(f"CREATE TEMP VIEW {name} AS SELECT * FROM {name}_arrow")
        return
    if isinstance(data, (str, os.PathLike)):
        text = os.fspath(data)
        if isinstance(data, str) and _SQL_START.match(text) and not Path(text).exists():
            try:
                con.execute(f"CREATE TEMP VIEW {name} AS {text}")
            except duckdb.Error as e:
                raise ConfigError(f"the SQL query failed: {_first_line(e)}") from e
            return
        _register_file(con, name, text, notes, skip_bad)
        return
    mod = type(data).__module__.split(".")[0]
    if mod in ("pandas", "polars", "pyarrow"):
        arrow = data.to_arrow() if mod == "polars" else data
        con.register(name + "_frame", arrow)
        con.execute(f"CREATE TEMP VIEW {name} AS SELECT * FROM {name}_frame")
        return
    raise ConfigError(
        f"cannot analyse a {type(data).__name__}: pass a CSV or Parquet path, a SQL query, a "
        "DuckDB relation, a pandas or polars DataFrame, or an Arrow table"
    )


def _register_file(
    con: duckdb.DuckDBPyConnection, name: str, path: str, notes: list[str], skip_bad: bool
) -> None:
    lower = path.lower()
    is_glob = any(ch in path for ch in "*?[")
    if not is_glob:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"{path}: no such file; check the path")
        if p.is_file() and p.stat().st_size == 0:
            raise ConfigError(f"{path}: the file is empty; nothing to analyse")
    lit = "'" + path.replace("'", "''") + "'"
    if lower.endswith(_PARQUET_SUFFIXES) or (not is_glob and Path(path).is_dir()):
        try:
            con.execute(f"CREATE TEMP VIEW {name} AS SELECT * FROM read_parquet({lit})")
        except duckdb.Error as e:
            raise ConfigError(f"{path}: not a readable Parquet file: {_first_line(e)}") from e
        return
    if not lower.endswith(_CSV_SUFFIXES) and not is_glob:
        log.info("%s: no known suffix, reading it as CSV", path)
    _register_csv(con, name, path, lit, notes, skip_bad)


def _register_csv(
    con: duckdb.DuckDBPyConnection, name: str, path: str, lit: str, notes: list[str], skip: bool
) -> None:
    opts = ", ignore_errors=true" if skip else ""
    delim = _delimiter(path)
    if delim:
        # Without a hint a single bad line can make the sniffer settle on one column.
        opts += f", delim='{delim}'"
    attempts = [("", None), (", encoding='latin-1'", "decoded as Latin-1 (it is not valid UTF-8)")]
    last: duckdb.Error | None = None
    for enc, note in attempts:
        try:
            con.execute(f"CREATE TEMP TABLE {name} AS SELECT * FROM read_csv({lit}{enc}{opts})")
        except duckdb.Error as e:
            last = e
            msg = str(e)
            if "unicode" in msg.lower() or "utf-8" in msg.lower() or "utf8" in msg.lower():
                continue
            line = re.search(r"[Ll]ine:?\s*(\d+)", msg)
            where = f" at line {line.group(1)}" if line else ""
            raise ConfigError(
                f"{path}: malformed CSV{where}: {_first_line(e)}. Fix the line, or skip such "
                "lines with skip_bad_lines=True (CLI: --skip-bad-lines)"
            ) from e
        if note:
            notes.append(f"{Path(path).name}: {note}")
        if skip:
            total = _count_lines(path)
            kept = con.sql(f"SELECT count(*) FROM {name}").fetchall()[0]
            if total is not None and total - 1 > kept[0]:
                notes.append(f"skipped {total - 1 - kept[0]} malformed line(s) of {path}")
        return
    raise ConfigError(f"{path}: could not decode the text: {_first_line(last or Exception())}")


def _count_lines(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return None


def _delimiter(path: str) -> str | None:
    """The delimiter of the header line, when one stands out (None for globs and gzip)."""
    if any(ch in path for ch in "*?[") or not path.lower().endswith((".csv", ".tsv", ".txt")):
        return None
    try:
        with open(path, encoding="latin-1") as f:
            header = f.readline()
    except OSError:
        return None
    counts = {d: header.count(d) for d in (",", "\t", ";", "|")}
    best = max(counts, key=lambda d: counts[d])
    return best if counts[best] else None
