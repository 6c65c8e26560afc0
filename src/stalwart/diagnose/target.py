"""Turn the user's label, weight and KPI arguments into SQL for the per-row failure mass (the
*target*) and the per-row total mass (the *reference*), with clear errors for misspelt columns.
A label that is not a column is checked by ``expression.check_expression`` first: only one
expression over the log's columns reaches DuckDB, as DuckDB prints it.

Labelled events: target = weight when the label holds, else 0; reference = weight (1 per row
without a weight column). KPI deviation (RiskLoc/RobustSpot style, one row per leaf):

- additive, ``actual=A, expected=E``: the deviation's direction s is the sign of sum(A - E);
  target = max(s * (A - E), 0), reference = |E| (a KPI may be negative: a net margin).
- ratio, ``actual=(An, Ad), expected=(En, Ed)``: the expected ratio of a leaf is En / Ed (the
  overall expected ratio where Ed = 0); target = max(s * (An - Ad * En / Ed), 0), the numerator
  mass the leaf lost or gained against its own expected ratio, and reference = Ad.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import duckdb

from stalwart.diagnose.clean import is_nan
from stalwart.diagnose.expression import check_expression
from stalwart.diagnose.quoting import as_double, identifier
from stalwart.diagnose.source import Source, suggest
from stalwart.errors import ConfigError

__all__ = ["Masses", "check_weights", "event_masses", "kpi_masses"]

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\- ]*$")
_TRUE = {"true", "t", "1", "yes", "y", "fail", "failed", "failure", "error", "bad", "crash"}
_FALSE = {"false", "f", "0", "no", "n", "ok", "pass", "passed", "success", "good", "succeeded"}


@dataclass(frozen=True)
class Masses:
    """SQL for the per-row target and reference masses, and the columns they consume."""

    target: str
    reference: str
    used: frozenset[str]
    counts: bool
    """Whether the masses are counts (so binomial intervals and tests apply)."""


def _column(src: Source, name: str, what: str) -> str:
    if name in src.columns:
        return name
    raise ConfigError(f"{what}: no column {name!r}.{suggest(name, src.columns)}")


def _check(src: Source, sql: str, text: str, what: str) -> None:
    """Bind and run the checked ``sql`` once: wrong types and names fail here, with ``text``."""
    try:
        src.sql(f"SELECT count(*) FILTER (WHERE {sql}) FROM {{src}}").fetchall()[0]
    except duckdb.Error as e:
        msg = str(e).splitlines()[0]
        missing = re.search(r'[Cc]olumn "?([^"\s]+)"? not found', msg)
        hint = suggest(missing.group(1), src.columns) if missing else ""
        raise ConfigError(f"{what} {text!r} is not a valid condition: {msg}.{hint}") from e


def _label_sql(src: Source, label: str) -> tuple[str, set[str]]:
    if label in src.columns:
        q, kind = identifier(label), src.types[label].upper()
        if kind == "BOOLEAN":
            return f"coalesce({q}, false)", {label}
        if kind.startswith(
            (
                "TINYINT",
                "SMALLINT",
                "INTEGER",
                "BIGINT",
                "HUGEINT",
                "U",
                "DOUBLE",
                "FLOAT",
                "DECIMAL",
            )
        ):
            odd = src.sql(
                f"SELECT DISTINCT {q} FROM {{src}} WHERE {q} IS NOT NULL AND {q} NOT IN (0, 1) "
                "LIMIT 3"
            ).fetchall()
            if odd:
                raise ConfigError(
                    f"label column {label!r} holds numbers other than 0 and 1, such as "
                    f"{[r[0] for r in odd]}: to count each row that many times pass it as "
                    f"weight={label!r} (--weight), or say which rows failed with a condition "
                    f'such as label="{label} > 0"'
                )
            return f"coalesce({q} <> 0, false)", {label}
        values = [
            str(r[0]).strip().lower()
            for r in src.sql(
                f"SELECT DISTINCT {q} FROM {{src}} WHERE {q} IS NOT NULL LIMIT 50"
            ).fetchall()
        ]
        odd = [v for v in values if v not in _TRUE | _FALSE]
        if odd:
            raise ConfigError(
                f"label column {label!r} holds values such as {odd[:3]}: say which rows failed "
                f"with a condition instead, e.g. label=\"{label} != 'ok'\""
            )
        lits = ", ".join(f"'{v}'" for v in sorted(_TRUE))
        return f"coalesce(lower(trim(CAST({q} AS VARCHAR))) IN ({lits}), false)", {label}
    if _IDENT.match(label) and not any(op in label for op in (" ", "-")):
        raise ConfigError(f"label: no column {label!r}.{suggest(label, src.columns)}")
    # Only DuckDB's rendering of a checked expression reaches the log's SQL, never the text.
    expr = check_expression(label, src.columns, "label")
    _check(src, expr.sql, label, "label")
    return f"coalesce({expr.sql}, false)", set(expr.columns)


def check_weights(bad: int, weight: str, missing: int = 0) -> None:
    """Refuse a weight column with ``bad`` negative or NaN values or ``missing`` NULLs (every
    engine's rule): a weight counts events, and read as 0 such a row would vanish unseen."""
    if bad:
        raise ConfigError(
            f"weight column {weight!r} has {bad} negative or NaN value(s); a weight counts "
            "the events a row stands for: fix those rows or filter them out first"
        )
    if missing:
        raise ConfigError(
            f"weight column {weight!r} has {missing} missing value(s) (NULL, as a pandas NaN "
            "arrives); a weight counts the events a row stands for: fill them in (0 leaves a "
            "row out) or filter those rows out first"
        )


def event_masses(src: Source, label: str, weight: str | None) -> Masses:
    """Masses of labelled events: failure weight, and weight (1 per row by default)."""
    cond, used = _label_sql(src, label)
    w = "1"
    if weight is not None:
        w = _numeric(src, weight, "weight", " (counts)")
        bad, missing = src.sql(  # DuckDB orders NaN above every number: its own test
            f"SELECT count(*) FILTER (WHERE {w} < 0 OR {is_nan(w)}), "
            f"count(*) FILTER (WHERE {identifier(weight)} IS NULL) FROM {{src}}"
        ).fetchall()[0]
        check_weights(bad, weight, missing)
        used.add(_column(src, weight, "weight"))
    return Masses(f"(CASE WHEN {cond} THEN {w} ELSE 0 END)", w, frozenset(used), True)


def _numeric(src: Source, name: str, role: str, what: str = "") -> str:
    """``name`` as DOUBLE in SQL, refusing a column of text, booleans or dates by name."""
    col = _column(src, name, role)
    kind = src.types[col].upper()
    if kind in ("VARCHAR", "BOOLEAN", "DATE") or kind.startswith("TIMESTAMP"):
        raise ConfigError(f"{role} column {col!r} is {kind}; it must hold numbers{what}")
    return as_double(col)


def kpi_masses(
    src: Source, actual: str | tuple[str, str], expected: str | tuple[str, str]
) -> Masses:
    """Masses of a KPI's deviation; pairs of columns mean a ratio (numerator, denominator)."""
    if isinstance(actual, str) != isinstance(expected, str):
        raise ConfigError(
            "actual and expected must both be single columns (additive KPI) or both "
            "(numerator, denominator) pairs (ratio KPI)"
        )
    if isinstance(actual, str) and isinstance(expected, str):
        a, e = _numeric(src, actual, "actual"), _numeric(src, expected, "expected")
        row = src.sql(f"SELECT sum({a} - {e}) FROM {{src}}").fetchall()[0]
        s = 1.0 if row is None or (row[0] or 0) >= 0 else -1.0
        return Masses(
            f"greatest({s} * ({a} - {e}), 0)",
            f"abs({e})",  # the expectation's magnitude: a KPI may be negative (net margin)
            frozenset({actual, expected}),
            False,
        )
    if len(actual) != 2 or len(expected) != 2:
        raise ConfigError("a ratio KPI needs (numerator, denominator) for actual and expected")
    an, ad = (_numeric(src, c, "actual") for c in actual)
    en, ed = (_numeric(src, c, "expected") for c in expected)
    row = src.sql(f"SELECT sum({an}), sum({ad}), sum({en}), sum({ed}) FROM {{src}}").fetchall()[0]
    assert row is not None
    tot_an, tot_ad, tot_en, tot_ed = (float(v or 0) for v in row)
    if tot_ad <= 0 or tot_ed <= 0:
        raise ConfigError("the KPI's denominators sum to zero; nothing to compare")
    overall = tot_en / tot_ed
    s = 1.0 if tot_an / tot_ad >= overall else -1.0
    ratio = f"(CASE WHEN {ed} > 0 THEN {en} / {ed} ELSE {overall!r} END)"
    return Masses(
        f"greatest({s} * ({an} - {ad} * {ratio}), 0)",
        f"greatest({ad}, 0)",
        frozenset({*actual, *expected}),
        True,
    )
