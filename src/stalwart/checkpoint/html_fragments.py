"""Small self-contained HTML fragments for notebooks (``_repr_html_``) of checkpoint results.

A fragment has no script and no external resources: a summary line, a table of the top
``NOTEBOOK_ROWS`` rows and an "N more" line, so a step with a million tensors still renders
in a few kilobytes. Every string from a checkpoint (tensor names, metadata, values) comes
from user state and is escaped, and cut to ``CELL_CHARS``. A leaf: it imports nothing of
stalwart, so the durable engine's records and the tools' reports both render with it.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

__all__ = [
    "CELL_CHARS",
    "NOTEBOOK_ROWS",
    "STATUS_COLOR",
    "escape_cell",
    "format_number",
    "format_size",
    "html_table",
    "more_line",
]

NOTEBOOK_ROWS = 20
"""Rows a notebook shows; the rest are counted in an "N more" line."""
CELL_CHARS = 160
"""Characters a cell shows; longer text is cut with an ellipsis."""
STATUS_COLOR = {
    "changed": "#b54708",
    "added": "#067647",
    "removed": "#b42318",
    "reshaped": "#6941c6",
    "unchanged": "#667085",
}


def escape_cell(value: object, limit: int = CELL_CHARS) -> str:
    """``value`` as text, cut to ``limit`` characters, then escaped."""
    text = str(value)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return html.escape(text, quote=True)


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


def html_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Cells are HTML already (escaped by the caller); headers are escaped here."""
    th = "".join(f"<th>{escape_cell(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def more_line(total: int, shown: int, what: str) -> str:
    """The "N more" paragraph when ``shown`` of ``total`` rows are in the table, else ""."""
    if total <= shown:
        return ""
    return f"<p>… {total - shown} more {what}; to_pandas() has them all</p>"
