"""A Spark engine label checked by the rules of ``expression``, with Spark's own parser.

``analyze_spark`` hands a label that is not a column to ``F.expr``, which parses it with the
session's SQL parser. Before that, ``check_spark_expression`` parses the same text with the same
parser (``parseExpression``: exactly one expression, or an error; it never runs anything) and
walks the unresolved Catalyst tree against an allowlist: column references to the DataFrame's
columns, literals, comparisons, AND/OR/NOT, IS NULL, IN lists, LIKE/ILIKE/RLIKE, CASE, CAST,
arithmetic and the scalar functions of ``expression.SCALAR_FUNCTIONS``. A subquery
(``ScalarSubquery``, ``Exists``, ``InSubquery``), ``reflect``/``java_method``, a file function, a
lambda, ``*`` or anything else is refused with a ``ConfigError`` naming it. ``${...}`` is
refused outright: Spark substitutes variables (``${env:NAME}``) before it parses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stalwart.diagnose.expression import ALLOWED, MAX_CHARS, SCALAR_FUNCTIONS
from stalwart.diagnose.source import suggest
from stalwart.errors import ConfigError

__all__ = ["check_spark_expression"]

# fmt: off
_NODES = frozenset((
    "Literal", "EqualTo", "EqualNullSafe", "LessThan", "LessThanOrEqual", "GreaterThan",
    "GreaterThanOrEqual", "Not", "And", "Or", "In", "IsNull", "IsNotNull", "Like", "ILike",
    "RLike", "CaseWhen", "Cast", "Add", "Subtract", "Multiply", "Divide", "IntegralDivide",
    "Remainder", "UnaryMinus", "UnaryPositive", "Concat",
))
# fmt: on
"""Catalyst expression classes a label may hold besides column references and functions."""

_WORDS = {
    "ScalarSubquery": "a subquery",
    "Exists": "a subquery (EXISTS)",
    "InSubquery": "a subquery (IN (SELECT ...))",
    "ListQuery": "a subquery",
    "UnresolvedStar": "*",
    "LambdaFunction": "a lambda",
    "UnresolvedWindowExpression": "a window function",
    "WindowExpression": "a window function",
    "Alias": "an alias (AS ...)",
}


def check_spark_expression(
    df: Any, text: str, columns: Sequence[str], what: str = "label"
) -> set[str]:
    """The columns ``text`` reads, once it is checked to be one allowed expression over
    ``columns`` by the session's parser of the Spark DataFrame ``df``.

    Raises:
        ConfigError: not one expression, or a part outside the allowlist (named).
    """
    if "${" in text:
        raise ConfigError(
            f"{what} {text!r} holds '${{': Spark substitutes variables (${{env:...}}) into the "
            f"text before parsing it; {ALLOWED}"
        )
    if len(text) > MAX_CHARS:
        raise ConfigError(f"{what} is {len(text):,} characters long: at most {MAX_CHARS:,}")
    parser = df.sparkSession._jsparkSession.sessionState().sqlParser()
    try:
        tree = parser.parseExpression(text)
    except Exception as e:  # py4j carries Spark's ParseException
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"{what} {text!r} is not one valid Spark SQL expression: {first}; {ALLOWED}"
        ) from e
    used: set[str] = set()
    _visit(tree, list(columns), what, used)
    return used


def _parts(seq: Any) -> list[str]:
    return [str(seq.apply(i)) for i in range(seq.size())]


def _visit(node: Any, columns: list[str], what: str, used: set[str]) -> None:
    kind = str(node.nodeName())
    if kind == "UnresolvedAttribute":
        parts = _parts(node.nameParts())
        name = parts[0] if len(parts) == 1 else None
        if name is None:
            raise ConfigError(
                f"{what} uses the qualified name {'.'.join(parts)!r}, which is not allowed: "
                f"write a column name alone, in backticks when it holds a dot; {ALLOWED}"
            )
        found = [c for c in columns if c == name] or [
            c for c in columns if c.lower() == name.lower()
        ]
        if not found:
            raise ConfigError(f"{what}: no column {name!r}.{suggest(name, columns)}")
        used.update(found)
    elif kind == "UnresolvedFunction":
        parts = _parts(node.nameParts())
        name = ".".join(parts)
        if len(parts) != 1 or parts[0].lower() not in SCALAR_FUNCTIONS:
            raise ConfigError(f"{what} uses function {name}, which is not allowed: {ALLOWED}")
        if node.isDistinct() or node.filter().isDefined():
            raise ConfigError(f"{what} uses {name} as an aggregate, which is not allowed")
    elif kind not in _NODES:
        part = _WORDS.get(kind, f"a {kind} expression")
        raise ConfigError(f"{what} uses {part}, which is not allowed: {ALLOWED}")
    children = node.children()
    for i in range(children.size()):
        _visit(children.apply(i), columns, what, used)
