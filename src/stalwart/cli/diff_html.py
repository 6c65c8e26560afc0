"""Render a :class:`~stalwart.checkpoint.diff.DiffReport` as one self-contained HTML page.

The page needs nothing but a browser: inline CSS, inline SVG bars of each tensor's relative
change, and a dozen lines of inline script that sort the table when a header is clicked (the
table reads fine without it). No external fonts, libraries or network requests. Every
string from the checkpoint is HTML-escaped: tensor names come from user state dicts.
"""

from __future__ import annotations

import html
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from stalwart.cli.conventions import write_file

if TYPE_CHECKING:
    from stalwart.checkpoint.tools.diff import DiffReport, TensorDiff

__all__ = ["write_diff_html"]

_BAR_W = 240  # px, the width of a full bar (the largest finite relative change)

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em;color:#1d2330}
h1{font-size:1.4em;margin:0 0 .3em}h2{font-size:1.1em;margin:1.6em 0 .4em}
.cards{display:flex;gap:.8em;flex-wrap:wrap;margin:1em 0}
.card{border:1px solid #d8dde6;border-radius:6px;padding:.5em .9em;min-width:6em}
.card b{display:block;font-size:1.3em}
table{border-collapse:collapse;font-size:13px}
th,td{padding:.25em .6em;border-bottom:1px solid #eceff4;text-align:left;white-space:nowrap}
th{background:#f5f7fa;cursor:pointer;user-select:none;position:sticky;top:0}
th:after{content:" \\2195";color:#9aa3b2}
td.n{text-align:right;font-variant-numeric:tabular-nums}
.s-changed{color:#b54708}.s-added{color:#067647}.s-removed{color:#b42318}
.s-reshaped{color:#6941c6}.s-unchanged{color:#667085}
code{font-size:12px}
"""

_JS = """
document.querySelectorAll('table.sortable th').forEach(function(th,i){
 th.addEventListener('click',function(){
  var tb=th.closest('table').tBodies[0],rows=Array.from(tb.rows),up=th.dataset.up!=='1';
  th.dataset.up=up?'1':'0';
  rows.sort(function(a,b){
   var x=a.cells[i].dataset.v||a.cells[i].textContent;
   var y=b.cells[i].dataset.v||b.cells[i].textContent;
   var p=parseFloat(x),q=parseFloat(y);
   var c=(!isNaN(p)&&!isNaN(q))?p-q:x.localeCompare(y);return up?c:-c;});
  rows.forEach(function(r){tb.appendChild(r);});});});
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _fmt(x: float | None) -> str:
    if x is None:
        return "—"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "∞"
    return f"{x:.3g}"


def _sort_key(x: float | None) -> str:
    """``data-v`` for numeric sorting: missing sorts first, infinity last."""
    if x is None or math.isnan(x):
        return "-1"
    return "1e308" if math.isinf(x) else repr(x)


def _bar(row: TensorDiff, scale: float) -> str:
    """An inline SVG bar of ``row.relative`` (``scale`` is the value of a full bar)."""
    rel = row.relative
    if rel is None or row.status in ("added", "removed", "reshaped"):
        return ""
    inf = math.isinf(rel) or math.isnan(rel)
    w = _BAR_W if inf else (0 if scale <= 0 else max(1.0 if rel > 0 else 0.0, rel / scale * _BAR_W))
    color = "#d92d20" if inf or row.nonfinite else "#f79009"
    return (
        f'<svg width="{_BAR_W + 70}" height="14" role="img" aria-label="relative change '
        f'{_e(_fmt(rel))}"><rect x="0" y="2" width="{_BAR_W}" height="10" fill="#f2f4f7"/>'
        f'<rect x="0" y="2" width="{w:.1f}" height="10" fill="{color}"/>'
        f'<text x="{_BAR_W + 6}" y="11" font-size="11">{_e(_fmt(rel))}</text></svg>'
    )


def _tensor_rows(report: DiffReport) -> str:
    rows = sorted(
        report.tensors,
        key=lambda r: (
            r.status == "unchanged",
            -(r.relative if r.relative is not None and not math.isnan(r.relative) else -1.0),
            r.name,
        ),
    )
    finite = [
        r.relative
        for r in rows
        if r.relative is not None and math.isfinite(r.relative) and r.status == "changed"
    ]
    scale = max(finite, default=0.0)
    out = []
    for r in rows:
        shape = list(r.shape) if r.old_shape is None else f"{list(r.old_shape)} → {list(r.shape)}"
        dtype = r.dtype if r.old_dtype is None else f"{r.old_dtype} → {r.dtype}"
        frac = (
            f" ({100 * r.changed_elements / r.numel:.1f}%)"
            if r.changed_elements and r.numel
            else ""
        )
        changed = "—" if r.changed_elements is None else f"{r.changed_elements}{frac}"
        out.append(
            f"<tr><td><code>{_e(r.name)}</code></td>"
            f'<td class="s-{_e(r.status)}">{_e(r.status)}</td><td>{_e(dtype)}</td>'
            f"<td>{_e(shape)}</td>"
            f'<td class="n" data-v="{r.changed_elements or 0}">{_e(changed)}</td>'
            f'<td class="n" data-v="{_sort_key(r.l2)}">{_fmt(r.l2)}</td>'
            f'<td class="n" data-v="{_sort_key(r.max_abs)}">{_fmt(r.max_abs)}</td>'
            f'<td data-v="{_sort_key(r.relative)}">{_bar(r, scale)}</td></tr>'
        )
    return "\n".join(out)


def _value_rows(report: DiffReport) -> str:
    return "\n".join(
        f'<tr><td><code>{_e(v.path)}</code></td><td class="s-{_e(v.status)}">'
        f"{_e(v.status)}</td><td><code>{_e(v.old if v.old is not None else '—')}</code></td>"
        f"<td><code>{_e(v.new if v.new is not None else '—')}</code></td></tr>"
        for v in report.values
    )


def render_diff_html(report: DiffReport) -> str:
    """The HTML page for ``report``, as a string."""
    counts = report.counts()
    cards = "".join(
        f'<div class="card"><b class="s-{k}">{n}</b>{k}</div>' for k, n in counts.items()
    )
    cards += (
        f'<div class="card"><b>{len(report.values)}</b>values differ</div>'
        f'<div class="card"><b>{report.bytes_read:,}</b>bytes read</div>'
    )
    verdict = (
        "identical"
        if report.identical
        else f"{len(report.tensors) - counts['unchanged']} tensors differ"
    )
    values = (
        '<h2>Non-tensor values</h2><table class="sortable"><thead><tr><th>path</th>'
        f"<th>status</th><th>step {report.a}</th><th>step {report.b}</th></tr></thead>"
        f"<tbody>{_value_rows(report)}</tbody></table>"
        if report.values
        else ""
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width,initial-scale=1">
<title>stalwart diff: step {report.a} → step {report.b}</title><style>{_CSS}</style></head>
<body><h1>Checkpoint diff: step {report.a} → step {report.b}</h1>
<p>{_e(verdict)}; {report.tensors_read} tensors read ({report.bytes_read:,} bytes), the rest
settled by chunk hashes without reading data. Relative change is
‖b - a‖₂ / ‖a‖₂; bars are scaled to the largest finite one, red marks a NaN/inf.</p>
<div class="cards">{cards}</div>
<h2>Tensors</h2>
<table class="sortable"><thead><tr><th>tensor</th><th>status</th><th>dtype</th><th>shape</th>
<th>changed elements</th><th>L2 of change</th><th>max |Δ|</th><th>relative change</th></tr>
</thead><tbody>
{_tensor_rows(report)}
</tbody></table>
{values}
<script>{_JS}</script>
</body></html>
"""


def write_diff_html(report: DiffReport, path: str | os.PathLike[str]) -> Path:
    """Write ``report`` as one self-contained HTML file at ``path`` (atomically, by
    :func:`~stalwart.cli.conventions.write_file`).

    Returns:
        The path written.
    """
    return write_file(Path(path), render_diff_html(report))
