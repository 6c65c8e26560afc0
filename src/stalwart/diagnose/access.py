"""What the analysis' own DuckDB connection may touch once the input is registered.

Every label is checked to one expression before it reaches SQL (``expression``); as a second
wall, the connection stalwart opens for an analysis is locked once its input is in place:
``enable_external_access`` off, so no query on it can read or write a file, list a folder,
attach a database or install and load an extension, for the rest of its life (DuckDB refuses to
turn it back on). The files a lazy view still scans stay readable: a Parquet file (or folder, or
the folder of a glob) through ``allowed_paths``/``allowed_directories``, a polars LazyFrame's
sink file likewise. CSV and JSON lines inputs are parsed into temporary tables before the lock,
frames and relations are in memory, and spilling to ``temp_directory`` still works.

Left unlocked: a caller's own connection (locking it would change it for good), a SQL query
as input (it may read whatever its author wrote, each time the view is scanned) and URLs,
whose filesystem DuckDB reaches through fsspec under paths of its own. A caller's connection
is given back as it came (``forget``): the view, the table and the frames the analysis put
there are dropped when it ends.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import duckdb

from stalwart.diagnose.quoting import literals
from stalwart.errors import ConfigError

__all__ = ["Reads", "first_line", "forget", "lock", "one_query"]

_GLOB = "*?["


@dataclass
class Reads:
    """The files a registered input still scans lazily; ``lockable`` is False when unknown."""

    paths: list[str] = field(default_factory=list)
    directories: list[str] = field(default_factory=list)
    lockable: bool = True

    def add_parquet(self, path: str, is_dir: bool) -> None:
        """A Parquet input scanned by a view: a file, a folder or a glob."""
        cut = min((path.index(ch) for ch in _GLOB if ch in path), default=-1)
        if cut >= 0:
            head = path[:cut]
            self.directories.append(head[: head.rindex("/") + 1] if "/" in head else "./")
            return
        self.paths.append(path)
        if is_dir:
            self.directories.append(path.rstrip("/") + "/")


def first_line(e: BaseException) -> str:
    """The first line of an error's message (DuckDB's run on with context), or its type."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def lock(con: duckdb.DuckDBPyConnection, reads: Reads) -> None:
    """Turn off ``con``'s external access, leaving ``reads`` readable (module docstring)."""
    if not reads.lockable:
        return
    if reads.paths:
        con.execute(f"SET allowed_paths = [{literals(reads.paths)}]")
    if reads.directories:
        con.execute(f"SET allowed_directories = [{literals(reads.directories)}]")
    con.execute("SET enable_external_access = false")


def one_query(text: str) -> None:
    """Refuse a SQL input that is not exactly one query (``SELECT ...; COPY ...`` chains)."""
    try:
        statements = duckdb.extract_statements(text)
    except duckdb.Error as e:
        raise ConfigError(f"the SQL query failed: {first_line(e)}") from e
    kinds = [str(s.type).rsplit(".", 1)[-1] for s in statements]
    if kinds != ["SELECT"]:
        raise ConfigError(
            f"the SQL input holds {len(kinds)} statement(s) ({', '.join(kinds) or 'none'}): "
            "pass exactly one query (SELECT/FROM/WITH/VALUES), without ';' and more SQL after it"
        )


def forget(con: duckdb.DuckDBPyConnection, name: str) -> None:
    """Drop from a caller's connection what the source ``name`` made there: its view or table
    (a full copy of a CSV or JSON-lines input) and the frames it was a view of."""
    for kind in ("VIEW", "TABLE"):  # one of the two exists; dropping the other kind raises
        with contextlib.suppress(duckdb.Error):
            con.execute(f"DROP {kind} IF EXISTS {name}")
    for frame in (name + "_arrow", name + "_frame"):
        with contextlib.suppress(duckdb.Error):
            con.unregister(frame)
