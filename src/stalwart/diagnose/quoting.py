"""SQL text for DuckDB: names and values quoted here, once, for every statement the package builds.

A column name goes in double quotes and a value in single quotes, the quote character doubled
inside; nothing else needs escaping in DuckDB's grammar, so a name or value quoted here reaches
the statement as exactly one identifier or one string literal, whatever it holds. Labels written
by users are SQL of their own and are checked by ``expression``, not quoted.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["as_double", "identifier", "literal", "literals"]


def identifier(name: str) -> str:
    """A column (or table) name as one DuckDB identifier: ``a"b`` -> ``"a""b"``."""
    return '"' + name.replace('"', '""') + '"'


def literal(text: str) -> str:
    """A text value as one DuckDB string literal: ``it's`` -> ``'it''s'``."""
    return "'" + text.replace("'", "''") + "'"


def as_double(name: str) -> str:
    """A numeric column as DOUBLE, NULL read as 0: ``coalesce(CAST("x" AS DOUBLE), 0)``."""
    return f"coalesce(CAST({identifier(name)} AS DOUBLE), 0)"


def literals(values: Iterable[str]) -> str:
    """Text values as a comma-separated list of literals (for ``IN (...)`` or ``[...]``)."""
    return ", ".join(literal(v) for v in values)
