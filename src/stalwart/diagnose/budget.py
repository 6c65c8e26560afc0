"""How an analysis' ``memory_limit`` is shared between DuckDB and the arrays outside it.

``memory_limit`` is the user's word on what the whole analysis may take, but DuckDB's own
``memory_limit`` covers only its buffer manager (tables, hash tables, spilled blocks). Outside it
live the interpreter and its libraries (about 0.2 GB resident), query results on their way to
Arrow, the failing groups and the FP-Growth arrays, and the coded rows that counting holds in
NumPy (all of them, or one streamed batch). So DuckDB gets ``DUCKDB_SHARE`` of the limit, and
the coded rows may take an eighth of it in memory before they are streamed instead. The split
was measured at 10 M and 100 M rows with bench/rca_scale_bench.py.
"""

from __future__ import annotations

import re

__all__ = ["DUCKDB_SHARE", "IN_MEMORY_BYTES", "duckdb_limit", "in_memory_budget", "parse_bytes"]

DUCKDB_SHARE = 0.5
"""Share of ``memory_limit`` given to DuckDB's buffer manager."""
IN_MEMORY_BYTES = 1 << 30
"""Bytes the coded rows may take in NumPy when no ``memory_limit`` is set."""
_MIN_DUCKDB_MIB = 64
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE = re.compile(r"\s*([\d.]+)\s*([kmgt]?)(i?)b?\s*")


def parse_bytes(size: str | None) -> int | None:
    """Bytes in a DuckDB-style size (``"4GB"``, ``"512MiB"``, ``"1.5 gb"``); None when absent
    or not understood (DuckDB then reports the bad value itself)."""
    m = _SIZE.fullmatch(size.lower()) if size else None
    if m is None:
        return None
    unit = 1024 ** "bkmgt".index(m.group(2) or "b") if m.group(3) else _UNITS[m.group(2)]
    return int(float(m.group(1)) * unit)


def duckdb_limit(memory_limit: str | None) -> str | None:
    """DuckDB's own ``memory_limit`` for an analysis allowed ``memory_limit`` in all."""
    size = parse_bytes(memory_limit)
    if size is None:
        return memory_limit
    return f"{max(int(size * DUCKDB_SHARE) >> 20, _MIN_DUCKDB_MIB)}MiB"


def in_memory_budget(memory_limit: str | None) -> int:
    """Bytes the coded rows may take in NumPy: ``IN_MEMORY_BYTES``, or an eighth of
    ``memory_limit`` when one is set (they live outside DuckDB's buffer manager)."""
    size = parse_bytes(memory_limit)
    return IN_MEMORY_BYTES if size is None else min(IN_MEMORY_BYTES, size // 8)
