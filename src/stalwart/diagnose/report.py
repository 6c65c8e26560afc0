"""The one-file HTML report of a diagnosis: findings with lift intervals, their subsumed
neighbours, example rows, the cleaning applied, and a lift/support plot drawn by matplotlib as
inline SVG (no network, no external files). The compact fragment a notebook shows is
``notebook.py``'s, which the result renders through without importing this module."""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from stalwart.diagnose.notebook import FINDING_NUMBERS, finding_cells, mass
from stalwart.diagnose.result import FleetDiagnosis
from stalwart.errors import require
from stalwart.notebook import escape, html_table

if TYPE_CHECKING:
    from stalwart.diagnose.result import Diagnosis, Finding

__all__ = ["render_html", "write_html"]

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px}
th{background:#f2f2f2;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}
h2{border-bottom:1px solid #ddd}.muted{color:#777}details{margin:.3em 0 1em}
"""


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
    ax.set_yticks(y, [t.replace("$", r"\$") for t in labels], fontsize=8)  # no math: "${HOME}"
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


def render_html(d: Diagnosis | FleetDiagnosis, *, title: str) -> str:
    """The report as one HTML document; a fleet's gets a section per kind of fault."""
    head = (
        f"<!doctype html><html><head><meta charset=utf-8><title>{escape(title)}</title>"
        f"<style>{_CSS}</style></head><body><h1>{escape(title)}</h1>"
    )
    if not isinstance(d, FleetDiagnosis):
        return "\n".join([head, *_sections(d, 2), "</body></html>"])
    parts = [head, f"<p>{escape(d.summary())}.</p>"]
    if d.notes:
        parts.append("<ul>" + "".join(f"<li>{escape(n)}</li>" for n in d.notes) + "</ul>")
    for kind, k in d.kinds.items():
        parts += [f"<h2>{escape(kind)}</h2>", *_sections(k, 3)]
    return "\n".join([*parts, "</body></html>"])


def _sections(d: Diagnosis, level: int) -> list[str]:
    """A diagnosis' summary, plot, findings and cleaning, its headings at ``level``."""
    what = "failures" if d.mode == "events" else "deviation"
    h, sub = f"h{level}", f"h{level + 1}"
    parts = [
        f"<p>Mode <b>{escape(d.mode)}</b>: {mass(d.total_failures)} {what} over "
        f"{mass(d.total_rows)} rows (base rate {d.base_rate:.4%}), {d.groups:,} coded rows or "
        f"groups counted, {d.candidates:,} item-sets scored. The findings' rows hold "
        f"{d.covered:.1%} of the {what}.</p>",
    ]
    if d.message:
        parts.append(f"<p><b>{escape(d.message)}</b></p>")
    parts += [_plot(d), f"<{h}>Findings</{h}>"]
    head = ["#", "finding", what, "rows", "support", "lift [interval]", "explains"]
    rows = [finding_cells(r) for r in d.to_arrow().to_pylist()]
    parts.append(html_table(head, rows, FINDING_NUMBERS))
    for i, f in enumerate(d.findings, 1):
        parts += _finding_details(i, f, what, sub)
    parts.append(f"<{h}>Cleaning</{h}>")
    if d.cleaning:
        cleaning = [[escape(c[k]) for k in ("column", "action", "detail")] for c in d.cleaning]
        parts.append(html_table(["column", "action", "detail"], cleaning))
    else:
        parts.append("<p class=muted>Nothing to clean.</p>")
    if d.notes:
        parts.append("<ul>" + "".join(f"<li>{escape(n)}</li>" for n in d.notes) + "</ul>")
    parts.append(
        f"<p class=muted>Columns analysed: {escape(', '.join(d.columns))}. Timings (s): "
        f"{escape(d.timings_s)}.</p>"
    )
    return parts


def _finding_details(i: int, f: Finding, what: str, h: str) -> list[str]:
    """A finding's heading (an ``h`` element), its subsumed neighbours (folded) and its example
    groups."""
    parts = [f"<{h}>{i}. {escape(f.label())}</{h}>"]
    if f.subsumed:
        nrows = [
            [
                escape(" & ".join(f"{k}={v}" for k, v in n.items.items())),
                mass(n.failures),
                mass(n.rows),
                f"{n.lift:.2f}",
                escape(n.reason),
            ]
            for n in f.subsumed
        ]
        parts.append(f"<details><summary>Subsumed neighbours ({len(f.subsumed)})</summary>")
        parts.append(html_table(["item-set", what, "rows", "lift", "why pruned"], nrows, {1, 2, 3}))
        parts.append("</details>")
    if f.examples:
        head = list(f.examples[0])
        parts.append("<p class=muted>Example groups (most failures first):</p>")
        parts.append(html_table(head, [[escape(e.get(h, "")) for h in head] for e in f.examples]))
    return parts


def write_html(
    d: Diagnosis | FleetDiagnosis, path: str | Path, *, title: str = "stalwart root-cause report"
) -> Path:
    """Write the one-file HTML report of ``d`` (findings, neighbours, examples, a plot; a
    fleet's with one section per kind of fault) to ``path``, and return it as a ``Path``.

    The report is written to a temporary file beside ``path`` and renamed over it, so a full
    disk or a crash leaves an earlier report whole (``stalwart rca --html`` writes through
    the command line's own writer, :func:`stalwart.cli.conventions.write_file`)."""
    out = Path(path)
    text = render_html(d, title=title)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a report is for sharing
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
