"""Notebook renderings (``_repr_html_``) of the tools' results: checkpoint diffs and step
inspections.

Each is a small self-contained HTML fragment (no script, no external resources): a summary
line, a table of the top ``NOTEBOOK_ROWS`` rows and an "N more" line, so a step with a
million tensors still renders in a few kilobytes. Every string from a checkpoint (tensor
names, metadata, values) comes from user state and is escaped, and cut to ``_CELL_CHARS``.
The full page for a diff is ``stalwart.cli.diff_html``; all rows are in ``to_pandas()``.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stalwart.checkpoint.tools.diff import DiffReport
    from stalwart.checkpoint.tools.inspection import Inspection

__all__ = ["NOTEBOOK_ROWS", "render_diff", "render_inspection"]

NOTEBOOK_ROWS = 20
"""Rows a notebook shows; the rest are counted in an "N more" line."""
_CELL_CHARS = 160
_STATUS_COLOR = {
    "changed": "#b54708",
    "added": "#067647",
    "removed": "#b42318",
    "reshaped": "#6941c6",
    "unchanged": "#667085",
}


def _e(value: object, limit: int = _CELL_CHARS) -> str:
    """``value`` as text, cut to ``limit`` characters, then escaped."""
    text = str(value)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return html.escape(text, quote=True)


def _fmt(x: float | None) -> str:
    if x is None:
        return "—"
    if math.isnan(x):
        return "nan"
    return "∞" if math.isinf(x) else f"{x:.3g}"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Cells are HTML already (escaped by the caller); headers are escaped here."""
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _more(total: int, shown: int, what: str) -> str:
    if total <= shown:
        return ""
    return f"<p>… {total - shown} more {what}; to_pandas() has them all</p>"


def render_diff(report: DiffReport, *, max_rows: int = NOTEBOOK_ROWS) -> str:
    """The fragment for a :class:`~stalwart.checkpoint.tools.diff.DiffReport`: the counts,
    the most changed tensors first, and the non-tensor values that differ."""
    counts = report.counts()
    differ = len(report.tensors) - counts["unchanged"]
    verdict = "identical" if report.identical else f"{differ} tensor(s) differ"
    by_status = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    summary = (
        f"<b>Checkpoint diff</b> step {report.a} → step {report.b}: {verdict} "
        f"({by_status or 'no tensors'}); {len(report.values)} value(s) differ; "
        f"{report.tensors_read} tensor(s) read ({_size(report.bytes_read)}), the rest settled "
        "by chunk hashes."
    )

    def key(r: object) -> tuple[bool, float, str]:
        rel = getattr(r, "relative", None)
        size = -1.0 if rel is None or math.isnan(rel) else rel
        return (getattr(r, "status", "") == "unchanged", -size, getattr(r, "name", ""))

    rows = sorted(report.tensors, key=key)[:max_rows]
    cells = [
        [
            f"<code>{_e(r.name)}</code>",
            f"<span style='color:{_STATUS_COLOR.get(r.status, '#000')}'>{_e(r.status)}</span>",
            _e(r.dtype if r.old_dtype is None else f"{r.old_dtype} → {r.dtype}"),
            _e(list(r.shape) if r.old_shape is None else f"{list(r.old_shape)} → {list(r.shape)}"),
            "—" if r.changed_elements is None else f"{r.changed_elements:,}",
            _fmt(r.max_abs),
            _fmt(r.relative),
        ]
        for r in rows
    ]
    head = ["tensor", "status", "dtype", "shape", "changed elements", "max |Δ|", "relative"]
    parts = [f"<div class='stalwart-diff'><p>{summary}</p>", _table(head, cells)]
    parts.append(_more(len(report.tensors), len(rows), "tensor(s)"))
    if report.values:
        vals = report.values[:max_rows]
        vcells = [
            [
                f"<code>{_e(v.path)}</code>",
                _e(v.status),
                f"<code>{_e('—' if v.old is None else v.old)}</code>",
                f"<code>{_e('—' if v.new is None else v.new)}</code>",
            ]
            for v in vals
        ]
        parts.append(_table(["value", "status", f"step {report.a}", f"step {report.b}"], vcells))
        parts.append(_more(len(report.values), len(vals), "value(s)"))
    parts.append("</div>")
    return "".join(parts)


def render_inspection(ins: Inspection, *, max_rows: int = NOTEBOOK_ROWS) -> str:
    """The fragment for an :class:`~stalwart.checkpoint.tools.inspection.Inspection`: the
    totals, the largest tensors first, and the metadata."""
    t = ins.totals
    ratio = t.get("dedup_ratio")
    summary = (
        f"<b>Checkpoint step {ins.step}</b>: {t.get('tensors', 0):,} tensor(s), "
        f"{_size(t.get('logical_bytes', 0))} logical in {t.get('chunk_refs', 0):,} chunk refs; "
        f"{t.get('distinct_chunks', 0):,} distinct chunks, {_size(t.get('stored_bytes', 0))} "
        f"stored in {t.get('packs', 0):,} pack(s); dedup ratio "
        f"{'—' if ratio is None else f'{ratio:.2f}x'}; world size {ins.world_size}."
    )
    rows = sorted(ins.tensors, key=lambda r: (-r.nbytes, r.name))[:max_rows]
    cells = [
        [
            f"<code>{_e(r.name)}</code>",
            _e(r.dtype),
            _e(list(r.shape)),
            f"{r.shards:,}",
            _size(r.nbytes),
            f"{r.chunks:,}",
        ]
        for r in rows
    ]
    head = ["tensor", "dtype", "shape", "shards", "bytes", "chunks"]
    parts = [f"<div class='stalwart-inspection'><p>{summary}</p>", _table(head, cells)]
    parts.append(_more(len(ins.tensors), len(rows), "tensor(s) (shown: largest first)"))
    if ins.metadata:
        items = list(ins.metadata.items())
        meta = [[f"<code>{_e(k)}</code>", _e(v)] for k, v in items[:max_rows]]
        parts.append(_table(["metadata", "value"], meta))
        parts.append(_more(len(items), len(meta), "metadata entries"))
    parts.append("</div>")
    return "".join(parts)
