"""The compact HTML fragment Jupyter shows for a diagnosis (``Diagnosis._repr_html_``), and the
finding rows the full report (``report.py``) shares with it.

It renders plain values and the findings' Arrow table (``Diagnosis.to_arrow()``) and knows no
result class, so the result can render through it without importing the report. The escaping,
clipping and table pieces are :mod:`stalwart.notebook`'s, shared with every other package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stalwart.notebook import CELL_CHARS, NOTEBOOK_ROWS, clip, escape, html_table, more_line

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["FINDING_NUMBERS", "finding_cells", "mass", "render_notebook"]

FINDING_NUMBERS = {0, 2, 3, 4, 5, 6}
"""Right-aligned columns of :func:`finding_cells`' rows."""


def mass(x: float) -> str:
    """A count or weighted mass: ``1,234`` when whole, ``1,234.50`` otherwise."""
    return f"{int(x):,}" if x == int(x) else f"{x:,.2f}"


def finding_cells(row: dict[str, Any], *, label_chars: int | None = None) -> list[str]:
    """One finding of the Arrow table as escaped cells: rank, label, mass, reference mass,
    support, lift with its interval, explained share."""
    label = row["finding"] if label_chars is None else clip(row["finding"], label_chars)
    return [
        str(row["rank"]),
        escape(label),
        mass(row["failures"]),
        mass(row["rows"]),
        f"{row['support']:.1%}",
        f"{row['lift']:.2f} [{row['lift_low']:.2f}, {row['lift_high']:.2f}]",
        f"{row['explained']:.1%}",
    ]


def render_notebook(
    findings: pa.Table,
    *,
    mode: str,
    total_failures: float,
    total_rows: float,
    covered: float,
    message: str = "",
    max_rows: int = NOTEBOOK_ROWS,
) -> str:
    """One summary line, the top ``max_rows`` findings and an "N more" line.

    Args:
        findings: ``Diagnosis.to_arrow()``, best first.
        mode, total_failures, total_rows, covered, message: the diagnosis' fields of those names.
    """
    what = "failures" if mode == "events" else "deviation"
    ref = "rows" if mode == "events" else "reference"
    head = f"<b>Diagnosis</b> ({escape(mode)}): {findings.num_rows} finding(s); "
    head += f"{mass(total_failures)} {what} over {mass(total_rows)} {ref}"
    if mode == "events":
        head += f", base rate {total_failures / total_rows if total_rows > 0 else 0.0:.3%}"
    head += f"; the findings' rows hold {covered:.1%} of the {what}."
    parts = [f"<div class='stalwart-diagnosis'><p>{head}</p>"]
    if message:
        parts.append(f"<p><i>{escape(clip(message, 400))}</i></p>")
    if findings.num_rows:
        rows = findings.slice(0, max_rows).to_pylist()
        head_row = ["#", "finding", what, ref, "support", "lift [interval]", "explains"]
        cells = (finding_cells(r, label_chars=CELL_CHARS) for r in rows)
        parts.append(html_table(head_row, cells, FINDING_NUMBERS))
        parts.append(more_line(findings.num_rows, max_rows, "finding(s)"))
    parts.append("</div>")
    return "".join(parts)
