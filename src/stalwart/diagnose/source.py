"""Open any supported input as one DuckDB view, and turn bad input into clear ``ConfigError``\\s.

Accepted: a CSV, Parquet or JSON lines path (or glob), local or a URL any fsspec filesystem
reads (``s3://bucket/logs/*.parquet``), a SQL query string, a DuckDB relation, a pandas or polars
DataFrame, a polars LazyFrame, an Arrow table. Files are scanned lazily so DuckDB can aggregate
tables larger than memory, spilling to its temporary directory under ``memory_limit``; a CSV or
JSON lines file is parsed once into a DuckDB temporary table (compressed, spillable) since the
analysis reads it several times.

URLs go through fsspec (``s3fs`` for ``s3://``, the ``s3`` extra), registered on the DuckDB
connection, so Parquet is read in byte ranges of the columns each pass needs; credentials and
endpoints come from ``storage_options`` or the filesystem's usual environment. DuckDB's own
``httpfs`` extension is not used: it downloads itself on first use, which air-gapped clusters
cannot do.

A polars ``LazyFrame`` is never collected: polars' streaming engine sinks it, morsel by morsel,
into a Parquet file in a private temporary folder (``temp_directory`` when given), and DuckDB
scans that file like any other. Peak memory is bounded by the two engines' batch sizes, not by
the table, and each of the analysis' passes reads only the columns it needs. Once the input
is registered, stalwart's own connection loses external access (``access``).
"""

from __future__ import annotations

import difflib
import glob
import logging
import os
import re
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import fsspec

from stalwart.diagnose.access import Reads, forget, lock, one_query
from stalwart.diagnose.access import first_line as _first_line
from stalwart.diagnose.budget import duckdb_limit
from stalwart.diagnose.quoting import literal
from stalwart.diagnose.text_logs import register_csv, register_jsonl
from stalwart.errors import ConfigError, require

__all__ = ["Source", "open_source", "suggest"]

log = logging.getLogger(__name__)

_SQL_START = re.compile(r"^\s*(select|with|from|values|\()", re.IGNORECASE)
_CSV_SUFFIXES = (".csv", ".tsv", ".txt", ".csv.gz", ".tsv.gz", ".csv.zst")
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".jsonl.zst", ".ndjson.zst")
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_PARQUET_SUFFIXES = (".parquet", ".pq", ".parq")


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
    _sink: tempfile.TemporaryDirectory[str] | None = None
    """Where a LazyFrame was streamed to; removed on close."""
    scratch: list[tempfile.TemporaryDirectory[str]] = field(default_factory=list)
    """Private folders of the analysis (its row cache); removed on close."""

    def sql(self, query: str) -> duckdb.DuckDBPyRelation:
        """Run ``query`` (which may name ``{src}``) against the source."""
        return self.con.sql(query.replace("{src}", self.name))

    def close(self) -> None:
        if self.owns_connection:
            self.con.close()
        else:  # a caller's connection: leave it as it was given, less our view and its data
            forget(self.con, self.name)
        for tmp in (*self.scratch, self._tmp, self._sink):
            if tmp is not None:
                tmp.cleanup()
        self._tmp = self._sink = None
        self.scratch.clear()

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
        config["memory_limit"] = duckdb_limit(memory_limit)
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
    storage_options: dict[str, Any] | None = None,
) -> Source:
    """Register ``data`` as a view and describe its columns.

    Args:
        storage_options: passed to the fsspec filesystem of a URL (``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}`` for s3fs); ignored for local paths.

    Raises:
        ConfigError: the file is missing, empty, not CSV/Parquet/JSON lines, malformed, or has
            no columns.
        MissingDependencyError: a URL's filesystem (``s3fs``) or polars is not installed.
    """
    name = "stalwart_src_" + uuid.uuid4().hex[:8]
    owns = connection is None
    tmp = None
    if connection is None:
        con, tmp = _connect(memory_limit, temp_directory, threads)
    else:
        con = connection
    notes: list[str] = []
    where = _Where(notes, skip_bad_lines, storage_options, temp_directory)
    try:
        _register(con, name, data, where)
        desc = con.sql(f"DESCRIBE SELECT * FROM {name}").fetchall()
        if not desc:
            raise ConfigError("the input has no columns")
        if owns:  # never a caller's connection: the lock is for good
            lock(con, where.reads)
    except BaseException as e:
        if owns:
            con.close()
        else:
            forget(con, name)
        for t in (tmp, where.sink):
            if t is not None:
                t.cleanup()
        if isinstance(e, duckdb.Error):
            raise ConfigError(f"could not read the input: {_first_line(e)}") from e
        raise
    columns = [str(r[0]) for r in desc]
    types = {str(r[0]): str(r[1]) for r in desc}
    return Source(con, name, columns, types, notes, owns, tmp, where.sink)


@dataclass
class _Where:
    """How to read the input: options of ``open_source`` and what reading it left behind."""

    notes: list[str]
    skip_bad: bool
    storage_options: dict[str, Any] | None
    temp_directory: str | None
    sink: tempfile.TemporaryDirectory[str] | None = None
    fs: Any = None
    """The fsspec filesystem of a URL input (None for local paths)."""
    reads: Reads = field(default_factory=Reads)
    """What the input's view scans after registration (``access.lock`` leaves it readable)."""


def _register(con: duckdb.DuckDBPyConnection, name: str, data: Any, where: _Where) -> None:
    if isinstance(data, duckdb.DuckDBPyRelation):
        # A relation belongs to its own connection; bring its rows over as Arrow.
        con.register(name + "_arrow", data.to_arrow_table())
        con.execute(f"CREATE TEMP VIEW {name} AS SELECT * FROM {name}_arrow")
        return
    if isinstance(data, (str, os.PathLike)):
        text = os.fspath(data)
        if isinstance(data, str) and _SQL_START.match(text) and not Path(text).exists():
            one_query(text)
            where.reads.lockable = False
            try:
                con.execute(f"CREATE TEMP VIEW {name} AS {text}")
            except duckdb.Error as e:
                raise ConfigError(f"the SQL query failed: {_first_line(e)}") from e
            return
        return _register_file(con, name, text, where)
    mod = type(data).__module__.split(".")[0]
    if mod == "polars" and type(data).__name__ == "LazyFrame":
        return _register_lazy(con, name, data, where)
    if mod in ("pandas", "polars", "pyarrow"):
        arrow = data.to_arrow() if mod == "polars" else data
        con.register(name + "_frame", arrow)
        con.execute(f"CREATE TEMP VIEW {name} AS SELECT * FROM {name}_frame")
        return
    raise ConfigError(
        f"cannot analyse a {type(data).__name__}: pass a CSV, Parquet or JSON lines path or URL, "
        "a SQL query, a DuckDB relation, a pandas or polars DataFrame, a polars LazyFrame, or an "
        "Arrow table"
    )


def _register_lazy(con: duckdb.DuckDBPyConnection, name: str, lazy: Any, where: _Where) -> None:
    """Stream a polars LazyFrame into a Parquet file and scan it (see the module docstring)."""
    where.sink = tempfile.TemporaryDirectory(prefix="stalwart-rca-lazy-", dir=where.temp_directory)
    path = os.path.join(where.sink.name, "frame.parquet")
    try:
        lazy.sink_parquet(path)
    except Exception as e:  # polars raises its own tree (ComputeError, ColumnNotFoundError...)
        raise ConfigError(
            f"the polars LazyFrame failed while streaming it: {_first_line(e)}; check its query "
            "with lazy.explain(), or pass lazy.collect() if it needs the in-memory engine"
        ) from e
    con.execute(f"CREATE TEMP VIEW {name} AS SELECT * FROM read_parquet({literal(path)})")
    where.reads.paths.append(path)


def _filesystem(con: duckdb.DuckDBPyConnection, url: str, where: _Where) -> Any:
    """The fsspec filesystem of ``url``, registered on ``con`` so DuckDB reads through it."""
    protocol = _URL.match(url).group(1).lower()  # type: ignore[union-attr]
    if protocol in ("s3", "s3a"):
        require("s3fs", "s3", "s3:// inputs of stalwart.diagnose")
    try:
        fs = fsspec.filesystem(protocol, **(where.storage_options or {}))
    except (ImportError, ValueError) as e:
        raise ConfigError(
            f"{url}: no filesystem for {protocol}:// ({_first_line(e)}); install the fsspec "
            "implementation for it, or download the file and pass its local path"
        ) from e
    try:
        con.register_filesystem(fs)
    except duckdb.Error as e:  # the caller's connection may hold one already: use ours
        name = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        log.debug("replacing DuckDB's %s filesystem: %s", name, e)
        con.unregister_filesystem(name)
        con.register_filesystem(fs)
    where.fs = fs
    return fs


def _check_remote(fs: Any, url: str) -> None:
    try:
        if not fs.exists(url):
            raise ConfigError(
                f"{url}: no such object; check the bucket and key, and the endpoint and "
                "credentials in storage_options"
            )
        size = None if fs.isdir(url) else fs.size(url)
    except (OSError, PermissionError) as e:
        raise ConfigError(
            f"{url}: cannot reach it ({_first_line(e)}); check the credentials and endpoint in "
            "storage_options (or the filesystem's environment variables)"
        ) from e
    if size == 0:
        raise ConfigError(f"{url}: the file is empty; nothing to analyse")


def _register_file(con: duckdb.DuckDBPyConnection, name: str, path: str, where: _Where) -> None:
    lower = path.lower()
    is_glob = any(ch in path for ch in "*?[")
    is_dir = False
    if _URL.match(path):
        where.reads.lockable = False
        fs = _filesystem(con, path, where)
        if not is_glob:
            _check_remote(fs, path)
            is_dir = bool(fs.isdir(path))
    elif is_glob and not glob.glob(path):  # DuckDB's own words blamed "the line" of a CSV
        raise ConfigError(f"{path}: no file matches the pattern; check the path")
    elif not is_glob:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"{path}: no such file; check the path")
        if p.is_file() and p.stat().st_size == 0:
            raise ConfigError(f"{path}: the file is empty; nothing to analyse")
        is_dir = p.is_dir()
    lit = literal(path)
    if lower.endswith(_PARQUET_SUFFIXES) or is_dir:
        try:
            con.execute(f"CREATE TEMP VIEW {name} AS SELECT * FROM read_parquet({lit})")
        except duckdb.Error as e:
            raise ConfigError(f"{path}: not a readable Parquet file: {_first_line(e)}") from e
        where.reads.add_parquet(path, is_dir)
        return
    if lower.endswith(_JSONL_SUFFIXES):
        register_jsonl(con, name, path, skip_bad=where.skip_bad, notes=where.notes)
        return
    if not lower.endswith(_CSV_SUFFIXES) and not is_glob:
        log.info("%s: no known suffix, reading it as CSV", path)
    register_csv(con, name, path, skip_bad=where.skip_bad, notes=where.notes, fs=where.fs)
