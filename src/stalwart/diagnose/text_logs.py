"""CSV and JSON lines files parsed once into DuckDB temporary tables, bad lines named.

:func:`~stalwart.diagnose.source.open_source` sends text inputs here. Each file is parsed
once into a temporary table (compressed, spillable) since the analysis reads it several times.
A malformed file is a ``ConfigError`` naming the line to fix, or, with ``skip_bad``, its
malformed lines are dropped and counted in ``notes``.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path
from typing import Any

import duckdb

from stalwart.diagnose.access import first_line
from stalwart.diagnose.quoting import identifier, literal
from stalwart.errors import ConfigError

__all__ = ["register_csv", "register_jsonl"]

_SKIP_HINT = "Fix the line, or skip such lines with skip_bad_lines=True (CLI: --skip-bad-lines)"
_LINE = re.compile(r"[Ll]ine:?\s*(\d+)")
_DELIMITERS = (",", "\t", ";", "|")


def register_jsonl(
    con: duckdb.DuckDBPyConnection, name: str, path: str, *, skip_bad: bool, notes: list[str]
) -> None:
    """One JSON object per line, parsed into table ``name`` (types sniffed by DuckDB)."""
    opts = ", ignore_errors=true" if skip_bad else ""
    try:
        con.execute(
            f"CREATE TEMP TABLE {name} AS SELECT * FROM "
            f"read_json_auto({literal(path)}, format='newline_delimited'{opts})"
        )
    except duckdb.Error as e:
        line = _LINE.search(str(e))
        at = f" at line {line.group(1)}" if line else ""
        raise ConfigError(f"{path}: malformed JSON lines{at}: {first_line(e)}. {_SKIP_HINT}") from e
    types = {str(r[0]): str(r[1]) for r in con.sql(f"DESCRIBE {name}").fetchall()}
    mixed = [identifier(c) for c, t in types.items() if t == "JSON"]  # a string here, 0 there
    if mixed:  # values as text, not JSON text: "h3" and 0, not '"h3"' and '0'
        plain = ", ".join(f"json_extract_string({c}, '$') AS {c}" for c in mixed)
        replace = f"SELECT * REPLACE ({plain}) FROM {name}"
        con.execute(f"CREATE OR REPLACE TEMP TABLE {name} AS {replace}")
    if skip_bad:
        # DuckDB keeps a skipped JSON line as a row of NULLs: drop those rows, and say so.
        cols = list(types)
        empty = " AND ".join(f"{identifier(c)} IS NULL" for c in cols) or "false"
        dropped = con.execute(f"DELETE FROM {name} WHERE {empty}").fetchall()[0][0]
        if dropped:
            notes.append(f"skipped {dropped} malformed or empty line(s) of {path}")


def register_csv(
    con: duckdb.DuckDBPyConnection,
    name: str,
    path: str,
    *,
    skip_bad: bool,
    notes: list[str],
    fs: Any = None,
) -> None:
    """A CSV (or TSV) file or glob parsed into table ``name``; UTF-8, else Latin-1 (noted).

    Args:
        fs: the fsspec filesystem of a URL ``path`` (None: a local path).
    """
    opts = ", ignore_errors=true" if skip_bad else ""
    delim = _delimiter(path, fs)
    if delim:
        # Without a hint a single bad line can make the sniffer settle on one column.
        opts += f", delim='{delim}'"
    attempts = [("", None), (", encoding='latin-1'", "decoded as Latin-1 (it is not valid UTF-8)")]
    last: duckdb.Error | None = None
    lit = literal(path)
    for enc, note in attempts:
        try:
            con.execute(f"CREATE TEMP TABLE {name} AS SELECT * FROM read_csv({lit}{enc}{opts})")
        except duckdb.Error as e:
            last = e
            msg = str(e)
            if "unicode" in msg.lower() or "utf-8" in msg.lower() or "utf8" in msg.lower():
                continue
            line = _LINE.search(msg)
            at = f" at line {line.group(1)}" if line else _ragged_line(path, fs, delim)
            raise ConfigError(f"{path}: malformed CSV{at}: {first_line(e)}. {_SKIP_HINT}") from e
        if note:
            notes.append(f"{Path(path).name}: {note}")
        if skip_bad:
            total = _count_records(path, fs, delim)
            kept = con.sql(f"SELECT count(*) FROM {name}").fetchall()[0]
            if total is not None and total - 1 > kept[0]:
                notes.append(f"skipped {total - 1 - kept[0]} malformed line(s) of {path}")
        return
    raise ConfigError(f"{path}: could not decode the text: {first_line(last or Exception())}")


def _single_plain_file(path: str) -> bool:
    """A path of one uncompressed text file (not a glob, not gzip or zstd)."""
    return not any(ch in path for ch in "*?[") and path.lower().endswith((".csv", ".tsv", ".txt"))


def _open_binary(path: str, fs: Any) -> Any:
    return fs.open(path, "rb") if fs is not None else open(path, "rb")


def _count_records(path: str, fs: Any, delim: str | None) -> int | None:
    """Non-blank CSV records of one plain file, the header included (a quoted field may span
    lines: counting lines took those for skipped ones); None for globs and compressed files."""
    if not _single_plain_file(path):
        return None
    try:
        with _open_binary(path, fs) as f:
            text = io.TextIOWrapper(f, encoding="latin-1", newline="")
            rows = csv.reader(text, delimiter=delim or ",")
            return sum(1 for row in rows if any(field.strip() for field in row))
    except (OSError, csv.Error):
        return None


def _delimiter(path: str, fs: Any = None) -> str | None:
    """The delimiter of the header line, when one stands out (None for globs and gzip)."""
    if not _single_plain_file(path):
        return None
    try:
        with _open_binary(path, fs) as f:
            header = f.readline().decode("latin-1")
    except OSError:
        return None
    counts = {d: header.count(d) for d in _DELIMITERS}
    best = max(counts, key=lambda d: counts[d])
    return best if counts[best] else None


def _ragged_line(path: str, fs: Any, delim: str | None) -> str:
    """`` at line N (k fields where the header has n)`` for the first row whose field count
    differs from the header's: DuckDB's sniffer fails on one without naming it. Empty when
    no such row is found (or the file is a glob or compressed)."""
    if not _single_plain_file(path):
        return ""
    try:
        with _open_binary(path, fs) as f:
            text = io.TextIOWrapper(f, encoding="latin-1", newline="")
            rows = csv.reader(text, delimiter=delim or ",")
            header = next(rows, None)
            for row in rows:
                if row and len(row) != len(header or ()):
                    return (
                        f" at line {rows.line_num} ({len(row)} fields where the header has "
                        f"{len(header or ())})"
                    )
    except (OSError, csv.Error):
        pass
    return ""
