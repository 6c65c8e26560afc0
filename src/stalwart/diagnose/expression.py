"""A user's expression (a failure label) checked to be one expression over the log's columns,
and nothing more, before any of it reaches DuckDB.

A label is text the user wrote, pasted into the analysis' SQL. Unchecked, it can end the
expression and chain statements (``1) ; COPY (SELECT 42) TO 'out.csv' ; SELECT (1``), read any
file (``read_text('/etc/passwd')``, a subquery over ``read_csv``), list folders (``glob``) or
change the engine (``SET``, ``ATTACH``, ``INSTALL``). So ``check_expression``:

1. parses ``SELECT (<label>) FROM <sentinel>`` with DuckDB's own parser only
   (``json_serialize_sql``, on a private connection with external access off: nothing is bound
   or run), and requires the statement to be exactly that shape: one statement, one item in
   the select list, no alias, the sentinel table and no WHERE, GROUP BY, CTE, set operation or
   modifier (``--`` comments, quotes or parentheses that close the expression early show up
   here);
2. walks the expression's tree against an allowlist: column references to columns the log
   has, constants, comparisons, AND/OR/NOT, IS NULL, IN lists, BETWEEN, CASE, CAST, COLLATE,
   arithmetic and string operators (LIKE, ILIKE, GLOB, ``||``) and the scalar functions of
   ``SCALAR_FUNCTIONS``, which compute from their arguments alone. Anything else (a subquery,
   a table or file function such as ``read_text``, ``*``/``COLUMNS``, a parameter, a lambda,
   a window or aggregate, a qualified name) is refused with a ``ConfigError`` that names it;
3. prints the checked tree back as DuckDB writes it (``json_deserialize_sql``) and parses
   that text again, which must give the same tree: the SQL that runs is DuckDB's rendering of
   the tree that was checked, never the user's text (no comments, no stray quotes).

The Spark engine checks its labels by the same rules with Spark's parser (``spark_expression``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import duckdb

from stalwart.diagnose.access import first_line
from stalwart.diagnose.source import suggest
from stalwart.errors import ConfigError

__all__ = ["ALLOWED", "MAX_CHARS", "SCALAR_FUNCTIONS", "Expression", "check_expression"]

MAX_CHARS = 20_000
"""Longest expression accepted (a long IN list fits; a parser bomb does not)."""

ALLOWED = (
    "a label is an expression over the log's columns: column names, constants, comparisons, "
    "AND/OR/NOT, IS NULL, IN (...) lists, BETWEEN, LIKE, CASE, CAST and scalar functions such "
    "as lower, coalesce, regexp_matches; see 'What a label may contain' in docs/diagnose.md"
)

# fmt: off
SCALAR_FUNCTIONS = frozenset((
    # text
    "lower", "lcase", "upper", "ucase", "trim", "ltrim", "rtrim", "btrim", "length", "len",
    "strlen", "char_length", "character_length", "octet_length", "concat", "concat_ws",
    "substring", "substr", "left", "right", "replace", "reverse", "starts_with", "startswith",
    "ends_with", "endswith", "prefix", "suffix", "contains", "instr", "strpos", "position",
    "locate", "split_part", "regexp_matches", "regexp_full_match", "regexp_extract",
    "regexp_replace", "regexp_like", "rlike", "like", "ilike", "like_escape", "not_like_escape",
    "ilike_escape", "not_ilike_escape", "strip_accents",
    # nulls and choices
    "coalesce", "ifnull", "nvl", "nvl2", "nullif", "if", "iif", "isnull", "isnotnull",
    "between", "greatest", "least",
    # numbers
    "abs", "sign", "round", "floor", "ceil", "ceiling", "trunc", "sqrt", "cbrt", "ln", "log",
    "log2", "log10", "exp", "pow", "power", "mod", "pmod", "isnan", "isinf", "isfinite",
    # dates and times
    "date_part", "datepart", "date_trunc", "datetrunc", "year", "month", "day", "hour",
    "minute", "second", "dayofweek", "dayofmonth", "dayofyear", "weekday", "week",
    "weekofyear", "quarter", "epoch", "epoch_ms", "to_timestamp", "to_date", "strftime",
    "strptime", "date_format",
    # operators, as the parser names them
    "+", "-", "*", "/", "//", "%", "^", "**", "||", "~~", "!~~", "~~*", "!~~*", "~~~", "!~~~",
))
# fmt: on
"""Functions a label may call: each computes a value from its arguments alone (no tables, no
files, no settings, no state). Names of both engines; one unknown to an engine fails there."""

_SENTINEL = "stalwart_label_sentinel"
_PREFIX, _SUFFIX = "SELECT ", f" FROM {_SENTINEL}"
_OPERATORS = frozenset((
    "OPERATOR_NOT", "OPERATOR_IS_NULL", "OPERATOR_IS_NOT_NULL", "COMPARE_IN", "COMPARE_NOT_IN",
    "OPERATOR_COALESCE", "OPERATOR_NULLIF", "ARRAY_EXTRACT",
))  # fmt: skip
_WORDS = {
    "SUBQUERY": "a subquery",
    "STAR": "* or COLUMNS(...)",
    "PARAMETER": "a prepared-statement parameter",
    "LAMBDA": "a lambda",
    "WINDOW": "a window function",
    "POSITIONAL_REFERENCE": "a positional reference (#n)",
    "FUNCTION_REF": "a function reference",
}


@dataclass(frozen=True)
class Expression:
    """A checked expression: DuckDB's SQL for it, and the log's columns it reads."""

    sql: str
    columns: frozenset[str]


def check_expression(text: str, columns: Sequence[str], what: str = "label") -> Expression:
    """``text`` as one safe expression over ``columns`` (see the module docstring).

    Args:
        text: the user's expression.
        columns: the log's column names (the only names the expression may read).
        what: how messages name the expression (``label``).

    Raises:
        ConfigError: ``text`` is not exactly one expression, or uses anything outside the
            allowlist; the message names the offending part.
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{what} {text!r}: expected a column name or a condition; {ALLOWED}")
    if len(text) > MAX_CHARS:
        raise ConfigError(f"{what} is {len(text):,} characters long: at most {MAX_CHARS:,}")
    with _parser() as con:
        # The label stands on lines of its own, so a `--` comment in it ends with it.
        tree = _select_item(con, f"SELECT (\n{text}\n) FROM {_SENTINEL}", text, what)
        walker = _Walker(columns, what)
        walker.visit(tree)
        if walker.seen != sum(1 for _ in _nodes(tree)):
            raise ConfigError(f"{what} {text!r} holds parts stalwart cannot check; {ALLOWED}")
        sql = _render(con, tree, text, what)
    return Expression(sql, frozenset(walker.used))


@contextlib.contextmanager
def _parser() -> Iterator[duckdb.DuckDBPyConnection]:
    """A private connection that only parses: external access off, nothing registered."""
    con = duckdb.connect(config={"enable_external_access": False})
    try:
        yield con
    finally:
        con.close()


def _serialize(con: duckdb.DuckDBPyConnection, sql: str) -> dict[str, Any]:
    row = con.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()
    assert row is not None
    return json.loads(row[0])


def _shape(statement: dict[str, Any]) -> dict[str, Any]:
    """The statement without its select list and source positions, to compare shapes."""
    node = dict(statement.get("node", {}))
    node.pop("select_list", None)
    return _strip({**statement, "node": node})


def _strip(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {
            k: _strip(v)
            for k, v in tree.items()
            if k not in ("query_location", "query_location_length")
        }
    if isinstance(tree, list):
        return [_strip(v) for v in tree]
    return tree


def _select_item(con: duckdb.DuckDBPyConnection, sql: str, text: str, what: str) -> Any:
    """The one expression of ``SELECT (<text>) FROM <sentinel>``, or a ConfigError."""
    try:
        n = len(duckdb.extract_statements(sql))
    except duckdb.Error as e:
        raise ConfigError(
            f"{what} {text!r} is not a valid expression: {first_line(e)}; {ALLOWED}"
        ) from e
    if n != 1:
        raise ConfigError(
            f"{what} {text!r} holds {n} SQL statements (a ';' ends the expression): a label "
            f"is one expression, never statements; {ALLOWED}"
        )
    out = _serialize(con, sql)
    if out.get("error"):
        if "Only SELECT" in str(out.get("error_message")):
            raise ConfigError(
                f"{what} {text!r} is not an expression: it closes the expression and adds SQL "
                f"of its own; {ALLOWED}"
            )
        raise ConfigError(
            f"{what} {text!r} is not a valid expression: {out.get('error_message')}; {ALLOWED}"
        )
    ref = _serialize(con, f"SELECT (\n1\n) FROM {_SENTINEL}")["statements"][0]
    stmt = out["statements"][0]
    items = stmt.get("node", {}).get("select_list") or []
    if len(out["statements"]) != 1 or len(items) != 1 or _shape(stmt) != _shape(ref):
        raise ConfigError(
            f"{what} {text!r} is not one expression: its parentheses, quotes or comments end "
            f"the expression early and add more SQL (items, FROM, WHERE, UNION...); {ALLOWED}"
        )
    if items[0].get("alias"):
        raise ConfigError(f"{what} {text!r}: an alias (AS ...) is not part of a condition")
    return items[0]


def _render(con: duckdb.DuckDBPyConnection, tree: Any, text: str, what: str) -> str:
    """DuckDB's SQL for the checked ``tree``, re-parsed to the same tree (the invariant)."""
    ref = _serialize(con, f"SELECT (\n1\n) FROM {_SENTINEL}")
    ref["statements"][0]["node"]["select_list"] = [tree]
    row = con.execute("SELECT json_deserialize_sql(?::JSON)", [json.dumps(ref)]).fetchone()
    printed = str(row[0]) if row else ""
    if not (printed.startswith(_PREFIX) and printed.endswith(_SUFFIX)):
        raise ConfigError(f"{what} {text!r}: DuckDB printed it as {printed!r}, not one expression")
    sql = printed[len(_PREFIX) : -len(_SUFFIX)]
    again = _select_item(con, f"SELECT (\n{sql}\n) FROM {_SENTINEL}", sql, what)
    if _strip(again) != _strip(tree):
        raise ConfigError(f"{what} {text!r}: DuckDB does not print it back as the same tree")
    return f"({sql})"


def _nodes(tree: Any) -> Iterator[dict[str, Any]]:
    """Every expression node under ``tree`` (dictionaries with a ``class``), itself included."""
    if isinstance(tree, dict):
        if "class" in tree:
            yield tree
        for v in tree.values():
            yield from _nodes(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _nodes(v)


class _Walker:
    """Visits an expression tree, refusing what the allowlist lacks; counts what it saw."""

    def __init__(self, columns: Sequence[str], what: str) -> None:
        self.columns = list(columns)
        self.lower: dict[str, list[str]] = {}
        for c in self.columns:
            self.lower.setdefault(c.lower(), []).append(c)
        self.what = what
        self.used: set[str] = set()
        self.seen = 0

    def refuse(self, part: str) -> ConfigError:
        return ConfigError(f"{self.what} uses {part}, which is not allowed: {ALLOWED}")

    def visit(self, node: Any) -> None:
        if not isinstance(node, dict) or "class" not in node:
            raise self.refuse(f"an unexpected part {str(node)[:60]!r}")
        self.seen += 1
        kind = node["class"]
        if kind == "COLUMN_REF":
            self.column(node["column_names"])
        elif kind == "CONSTANT":
            pass
        elif kind == "COMPARISON":
            self.visit(node["left"])
            self.visit(node["right"])
        elif kind == "CONJUNCTION":
            self.each(node["children"])
        elif kind == "OPERATOR":
            if node["type"] not in _OPERATORS:
                raise self.refuse(f"the operator {node['type']}")
            self.each(node["children"])
        elif kind == "BETWEEN":
            self.each([node["input"], node["lower"], node["upper"]])
        elif kind == "CASE":
            for check in node["case_checks"]:
                self.each([check["when_expr"], check["then_expr"]])
            self.visit(node["else_expr"])
        elif kind == "CAST":
            self.visit(node["child"])
            self.visit(node["type_expr"])
        elif kind == "TYPE":
            if node.get("catalog") or node.get("schema"):
                raise self.refuse(f"a qualified type {node.get('type_name')!r}")
            self.each(node.get("children") or [])
        elif kind == "COLLATE":
            self.visit(node["child"])
        elif kind == "FUNCTION":
            self.function(node)
        else:
            raise self.refuse(_WORDS.get(kind, f"a {kind.lower()} expression"))

    def each(self, nodes: Sequence[Any]) -> None:
        for n in nodes:
            self.visit(n)

    def column(self, parts: list[str]) -> None:
        if len(parts) != 1:
            raise self.refuse(
                f"the qualified name {'.'.join(parts)!r} (write a column name alone, in double "
                "quotes when it holds a dot)"
            )
        name = parts[0]
        found = [name] if name in self.columns else self.lower.get(name.lower(), [])
        if not found:
            raise ConfigError(
                f"{self.what}: no column {name!r}.{suggest(name, self.columns)} (a name that "
                'needs quoting goes in double quotes: "my col"; text in single quotes)'
            )
        self.used.update(found)

    def function(self, node: dict[str, Any]) -> None:
        name = str(node.get("function_name", ""))
        if node.get("schema") or node.get("catalog"):
            raise self.refuse(f"the qualified function {node['schema'] or node['catalog']}.{name}")
        if name.lower() not in SCALAR_FUNCTIONS:
            raise self.refuse(f"function {name}")
        if node.get("filter") is not None or node.get("distinct") or node.get("export_state"):
            raise self.refuse(f"{name} as an aggregate (DISTINCT, FILTER)")
        if (node.get("order_bys") or {}).get("orders"):
            raise self.refuse(f"{name} with ORDER BY")
        for arg in node.get("arguments") or []:
            if arg.get("name"):
                raise self.refuse(f"the named argument {arg['name']} := of {name}")
            self.visit(arg["expression"])
