"""The one-file HTML report: findings with lift intervals, their subsumed neighbours, example
rows, the cleaning applied, and a lift/support plot drawn by matplotlib as inline SVG (no
network, no external files); and the compact fragment notebooks show for a ``Diagnosis``."""

from __future__ import annotations

import html
import io
from typing import TYPE_CHECKING

from stalwart.errors import require

if TYPE_CHECKING:
    from stalwart.diagnose.result import Diagnosis

__all__ = ["NOTEBOOK_ROWS", "render_html", "render_notebook"]

NOTEBOOK_ROWS = 20
"""Findings a notebook shows; the rest are counted in an "N more" line."""
_CELL_CHARS = 160

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px}
th{background:#f2f2f2;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}
h2{border-bottom:1px solid #ddd}.muted{color:#777}details{margin:.3em 0 1em}
"""


def _e(x: object) -> str:
    return html.escape(str(x))


def _n(x: float) -> str:
    return f"{int(x):,}" if x == int(x) else f"{x:,.2f}"


def _table(head: list[str], rows: list[list[str]], numeric: set[int] | None = None) -> str:
    numeric = numeric or set()
    out = ["<table><tr>", *(f"<th>{_e(h)}</th>" for h in head), "</tr>"]
    for r in rows:
        cells = (
            f"<td class=n>{c}</td>" if i in numeric else f"<td>{c}</td>" for i, c in enumerate(r)
        )
        out += ["<tr>", *cells, "</tr>"]
    out.append("</table>")
    return "".join(out)


def _plot(d: Diagnosis) -> str:
    if not d.findings:
        return ""
    matplotlib = require("matplotlib", "rca", "the root-cause HTML report")
    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    labels = [f.label() if len(f.label()) < 60 else f.label()[:57] + "..." for f in d.findings]
    lifts = [f.lift for f in d.findings]
    err = [[f.lift - f.lift_low for f in d.findings], [f.lift_high - f.lift for f in d.findings]]
    fig = Figure(figsize=(9, 0.5 + 0.45 * len(labels)))
    ax, ax2 = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 2]})
    y = list(range(len(labels)))[::-1]
    ax.barh(y, lifts, xerr=err, color="#c0392b", alpha=0.8, capsize=3)
    ax.axvline(1.0, color="#555", lw=0.8, ls="--")
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel("lift (failure rate inside / overall), with interval")
    ax2.barh(y, [f.support for f in d.findings], color="#2c3e50", alpha=0.8, label="support")
    ax2.barh(y, [f.explained for f in d.findings], color="#e67e22", alpha=0.9, label="explains")
    ax2.set_xlabel("share of all failures")
    ax2.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    svg = buf.getvalue()
    return svg[svg.index("<svg") :]


def render_html(d: Diagnosis, *, title: str) -> str:
    """The report as one HTML document."""
    what = "failures" if d.mode == "events" else "deviation"
    parts = [
        f"<!doctype html><html><head><meta charset=utf-8><title>{_e(title)}</title>"
        f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>"
    ]
    parts.append(
        f"<p>Mode <b>{_e(d.mode)}</b>: {_n(d.total_failures)} {what} over {_n(d.total_rows)} "
        f"rows (base rate {d.base_rate:.4%}), {d.groups:,} coded rows or groups "
        f"counted, {d.candidates:,} item-sets scored. The findings' rows hold "
        f"{d.covered:.1%} of the {what}.</p>"
    )
    if d.message:
        parts.append(f"<p><b>{_e(d.message)}</b></p>")
    parts.append(_plot(d))
    parts.append("<h2>Findings</h2>")
    rows = [
        [
            str(i),
            _e(f.label()),
            _n(f.failures),
            _n(f.rows),
            f"{f.support:.1%}",
            f"{f.lift:.2f} [{f.lift_low:.2f}, {f.lift_high:.2f}]",
            f"{f.explained:.1%}",
        ]
        for i, f in enumerate(d.findings, 1)
    ]
    parts.append(
        _table(
            ["#", "finding", what, "rows", "support", "lift [interval]", "explains"],
            rows,
            {0, 2, 3, 4, 5, 6},
        )
    )
    for i, f in enumerate(d.findings, 1):
        parts.append(f"<h3>{i}. {_e(f.label())}</h3>")
        if f.subsumed:
            nrows = [
                [
                    _e(" & ".join(f"{k}={v}" for k, v in n.items.items())),
                    _n(n.failures),
                    _n(n.rows),
                    f"{n.lift:.2f}",
                    _e(n.reason),
                ]
                for n in f.subsumed
            ]
            parts.append(f"<details><summary>Subsumed neighbours ({len(f.subsumed)})</summary>")
            parts.append(_table(["item-set", what, "rows", "lift", "why pruned"], nrows, {1, 2, 3}))
            parts.append("</details>")
        if f.examples:
            head = list(f.examples[0])
            parts.append("<p class=muted>Example groups (most failures first):</p>")
            parts.append(_table(head, [[_e(e.get(h, "")) for h in head] for e in f.examples]))
    parts.append("<h2>Cleaning</h2>")
    if d.cleaning:
        parts.append(
            _table(
                ["column", "action", "detail"],
                [[_e(c["column"]), _e(c["action"]), _e(c["detail"])] for c in d.cleaning],
            )
        )
    else:
        parts.append("<p class=muted>Nothing to clean.</p>")
    if d.notes:
        parts.append("<ul>" + "".join(f"<li>{_e(n)}</li>" for n in d.notes) + "</ul>")
    parts.append(
        f"<p class=muted>Columns analysed: {_e(', '.join(d.columns))}. Timings (s): "
        f"{_e(d.timings_s)}.</p></body></html>"
    )
    return "\n".join(parts)


def _clip(text: str, limit: int = _CELL_CHARS) -> str:
    """``text`` cut to ``limit`` characters (before escaping), so one hostile value cannot
    blow up a notebook cell."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render_notebook(d: Diagnosis, *, max_rows: int = NOTEBOOK_ROWS) -> str:
    """A small self-contained HTML fragment: one summary line, the top ``max_rows`` findings
    and an "N more" line. No script, no external resources; every value is escaped."""
    what = "failures" if d.mode == "events" else "deviation"
    head = f"<b>Diagnosis</b> ({_e(d.mode)}): {len(d.findings)} finding(s); "
    ref = "rows" if d.mode == "events" else "reference"
    head += f"{_n(d.total_failures)} {what} over {_n(d.total_rows)} {ref}"
    if d.mode == "events":
        head += f", base rate {d.base_rate:.3%}"
    head += f"; the findings' rows hold {d.covered:.1%} of the {what}."
    parts = [f"<div class='stalwart-diagnosis'><p>{head}</p>"]
    if d.message:
        parts.append(f"<p><i>{_e(_clip(d.message, 400))}</i></p>")
    if d.findings:
        rows = [
            [
                str(i),
                _e(_clip(f.label())),
                _n(f.failures),
                _n(f.rows),
                f"{f.support:.1%}",
                f"{f.lift:.2f} [{f.lift_low:.2f}, {f.lift_high:.2f}]",
                f"{f.explained:.1%}",
            ]
            for i, f in enumerate(d.findings[:max_rows], 1)
        ]
        head_row = ["#", "finding", what, ref, "support", "lift [interval]", "explains"]
        parts.append(_table(head_row, rows, {0, 2, 3, 4, 5, 6}))
        if len(d.findings) > max_rows:
            parts.append(
                f"<p>… {len(d.findings) - max_rows} more finding(s): d.to_pandas() has them all</p>"
            )
    parts.append("</div>")
    return "".join(parts)
