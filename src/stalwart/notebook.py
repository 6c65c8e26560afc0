"""The HTML pieces every notebook fragment (``_repr_html_``) and HTML report of stalwart share.

A fragment has no script and no external resources. Every string that can come from user
state (tensor names, metadata, attribute values, messages) is escaped, and cut to
:data:`CELL_CHARS` where it fills a cell, so one hostile value can neither break out of its
cell nor blow the fragment up; a table shows :data:`NOTEBOOK_ROWS` rows and counts the rest
in an "N more" line, so a step with a million tensors still renders in a few kilobytes.

A leaf: it imports nothing of stalwart and knows no result class, so the records of every
package render with it (checkpoint inspections and diffs, campaigns, PVF reports, protection
results, diagnoses) without a package importing another.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "CELL_CHARS",
    "NOTEBOOK_ROWS",
    "cell",
    "clip",
    "escape",
    "escape_cell",
    "format_number",
    "format_size",
    "html_table",
    "more_line",
    "render_table",
]

NOTEBOOK_ROWS = 20
"""Rows a notebook shows; the rest are counted in an "N more" line."""
CELL_CHARS = 160
"""Characters one value shows in a cell; longer text is cut with an ellipsis."""


def clip(text: str, limit: int = CELL_CHARS) -> str:
    """``text`` cut to ``limit`` characters (before escaping)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def escape(value: object) -> str:
    """``value`` as text, HTML-escaped (quotes too), not cut."""
    return html.escape(str(value), quote=True)


def escape_cell(value: object, limit: int = CELL_CHARS) -> str:
    """``value`` as text, cut to ``limit`` characters, then escaped."""
    return escape(clip(str(value), limit))


def cell(value: object) -> str:
    """One value of an Arrow row as a cell: floats to four significant digits, the rest cut
    and escaped."""
    return f"{value:.4g}" if isinstance(value, float) else escape_cell(value)


def format_number(x: float | None) -> str:
    """``x`` to three significant digits; a dash for None, nan and ∞ spelled out."""
    if x is None:
        return "—"
    if math.isnan(x):
        return "nan"
    return "∞" if math.isinf(x) else f"{x:.3g}"


def format_size(n: float) -> str:
    """``n`` bytes in binary units (``12 B``, ``3.5 MiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def html_table(
    head: Sequence[str], rows: Iterable[Sequence[str]], numeric: set[int] | None = None
) -> str:
    """A ``<table>``: ``head`` is escaped here, ``rows`` hold cells already escaped; the
    columns in ``numeric`` are right-aligned (``class=n``)."""
    numeric = numeric or set()
    out = ["<table><tr>", *(f"<th>{escape_cell(h)}</th>" for h in head), "</tr>"]
    for r in rows:
        out.append("<tr>")
        out += (
            f"<td class=n>{c}</td>" if i in numeric else f"<td>{c}</td>" for i, c in enumerate(r)
        )
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


def more_line(total: int, shown: int, what: str) -> str:
    """The "N more" paragraph when ``shown`` of ``total`` rows are in the table, else ""."""
    if total <= shown:
        return ""
    return f"<p>… {total - shown} more {escape(what)}; to_pandas() has them all</p>"


def render_table(
    title: str,
    summary: str,
    table: Any,
    *,
    max_rows: int = NOTEBOOK_ROWS,
    more: str = "row(s)",
    order_note: str = "",
) -> str:
    """``title``, ``summary`` (already HTML), the first ``max_rows`` rows of the Arrow
    ``table`` and an "N more" line, in one ``<div class='stalwart-result'>``.

    Args:
        order_note: appended to the "N more" line, e.g. how the shown rows were chosen.
    """
    cols = table.column_names
    rows = ([cell(r[c]) for c in cols] for r in table.slice(0, max_rows).to_pylist())
    return (
        f"<div class='stalwart-result'><p><b>{escape(title)}</b>: {summary}</p>"
        f"{html_table(cols, rows)}{more_line(table.num_rows, max_rows, more + order_note)}</div>"
    )
