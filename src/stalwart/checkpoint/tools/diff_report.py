"""The result of comparing two committed steps: rows per tensor and per value, as data.

``DiffReport.to_json()`` is the machine-readable form, ``to_arrow()`` / ``to_pandas()`` /
``to_polars()`` the tabular one (``stalwart.frames``), ``_repr_html_`` a compact fragment for
notebooks (:func:`render_diff`). The comparison itself is :func:`~.diff.diff_steps`; the
records are re-exported there, the path users import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from stalwart.errors import ConfigError, require
from stalwart.frames import to_pandas, to_polars
from stalwart.notebook import (
    NOTEBOOK_ROWS,
    escape_cell,
    format_number,
    format_size,
    html_table,
    more_line,
)

__all__ = ["DiffReport", "TensorDiff", "ValueDiff", "render_diff"]

STATUS_COLOR = {
    "changed": "#b54708",
    "added": "#067647",
    "removed": "#b42318",
    "reshaped": "#6941c6",
    "unchanged": "#667085",
}
"""A tensor's status as the notebook fragment colours it."""


@dataclass
class TensorDiff:
    """How one tensor differs between step ``a`` and step ``b``.

    Attributes:
        name: the tensor's FQN.
        status: ``unchanged``, ``changed``, ``added`` (only in b), ``removed`` (only in a)
            or ``reshaped`` (shape differs; values not compared).
        dtype: dtype in b (in a when removed).
        shape: shape in b (in a when removed).
        numel: elements of ``shape``.
        old_dtype: dtype in a when it differs from ``dtype``, else None.
        old_shape: shape in a when it differs from ``shape``, else None.
        changed_elements: elements whose values differ (NaN equals NaN); None when not
            compared.
        l2: L2 norm of ``b - a`` over the changed elements whose difference is finite.
        max_abs: largest ``|b - a|`` among those.
        relative: ``l2 / ||a||`` (``inf`` when a is all zeros and something changed).
        nonfinite: changed elements whose difference is not finite (a NaN or inf appeared).
        compared_by: ``hash`` when settled by chunk hashes, ``data`` when values were read,
            ``none`` when not compared (added, removed, reshaped).
    """

    name: str
    status: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    old_dtype: str | None = None
    old_shape: tuple[int, ...] | None = None
    changed_elements: int | None = None
    l2: float | None = None
    max_abs: float | None = None
    relative: float | None = None
    nonfinite: int = 0
    compared_by: str = "none"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "numel": self.numel,
            "old_dtype": self.old_dtype,
            "old_shape": None if self.old_shape is None else list(self.old_shape),
            "changed_elements": self.changed_elements,
            "l2": _num(self.l2),
            "max_abs": _num(self.max_abs),
            "relative": _num(self.relative),
            "nonfinite": self.nonfinite,
            "compared_by": self.compared_by,
        }


@dataclass
class ValueDiff:
    """A non-tensor value (from the skeleton) that differs between the two steps.

    Attributes:
        path: the value's path, keys joined with ``.`` like tensor FQNs (where two paths would
            join to one name, each is shown as its tuple of keys).
        status: ``changed``, ``added`` or ``removed``.
        old: a short rendering of the value in a (None when added).
        new: a short rendering of the value in b (None when removed).
    """

    path: str
    status: str
    old: str | None
    new: str | None

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "status": self.status, "old": self.old, "new": self.new}


@dataclass
class DiffReport:
    """Everything :func:`diff_steps` found.

    Attributes:
        a: the older (reference) step.
        b: the step compared against it.
        tensors: one row per tensor in either step, in a's order then b's new ones.
        values: non-tensor values that differ.
        bytes_read: stored bytes read to compare tensors (0 when the hashes settled all).
        tensors_read: tensors whose data was read.
        seconds: wall time.
    """

    a: int
    b: int
    tensors: list[TensorDiff] = field(default_factory=list)
    values: list[ValueDiff] = field(default_factory=list)
    bytes_read: int = 0
    tensors_read: int = 0
    seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        """Tensors per status (every status present, zero when none)."""
        out = dict.fromkeys(("unchanged", "changed", "added", "removed", "reshaped"), 0)
        for row in self.tensors:
            out[row.status] += 1
        return out

    @property
    def identical(self) -> bool:
        """True when no tensor and no value differs."""
        return not self.values and all(r.status == "unchanged" for r in self.tensors)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict (non-finite floats become the strings inf / nan)."""
        return {
            "a": self.a,
            "b": self.b,
            "identical": self.identical,
            "counts": self.counts(),
            "bytes_read": self.bytes_read,
            "tensors_read": self.tensors_read,
            "seconds": self.seconds,
            "tensors": [r.to_json() for r in self.tensors],
            "values": [v.to_json() for v in self.values],
        }

    def to_arrow(self, kind: str = "tensors") -> Any:
        """The tensor rows (``kind="tensors"``: the fields of :class:`TensorDiff`, non-finite
        floats kept as floats) or the value rows (``kind="values"``) as a pyarrow Table."""
        pa = require("pyarrow", "frames", "DiffReport.to_arrow")

        if kind == "values":
            names = ("path", "status", "old", "new")
            return pa.table(
                {n: pa.array([getattr(v, n) for v in self.values], pa.string()) for n in names}
            )
        if kind != "tensors":
            raise ConfigError(f"kind={kind!r}: expected 'tensors' or 'values'")
        ints, floats = pa.int64(), pa.float64()
        types = {
            "name": pa.string(), "status": pa.string(), "dtype": pa.string(),
            "shape": pa.list_(ints), "numel": ints, "old_dtype": pa.string(),
            "old_shape": pa.list_(ints), "changed_elements": ints, "l2": floats,
            "max_abs": floats, "relative": floats, "nonfinite": ints, "compared_by": pa.string(),
        }  # fmt: skip
        return pa.table(
            {n: pa.array([getattr(r, n) for r in self.tensors], t) for n, t in types.items()}
        )

    def to_pandas(self, kind: str = "tensors") -> Any:
        """``to_arrow(kind)`` as a pandas DataFrame (needs the ``frames`` extra)."""
        require("pandas", "frames", "DiffReport.to_pandas")  # before building the table
        return to_pandas(self.to_arrow(kind), "DiffReport.to_pandas")

    def to_polars(self, kind: str = "tensors") -> Any:
        """``to_arrow(kind)`` as a polars DataFrame (needs the ``frames`` extra)."""
        require("polars", "frames", "DiffReport.to_polars")  # before building the table
        return to_polars(self.to_arrow(kind), "DiffReport.to_polars")

    def _repr_html_(self) -> str:
        return render_diff(self)


def _num(x: float | None) -> float | str | None:
    """A float for JSON: non-finite values become the strings nan, inf and -inf."""
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def render_diff(report: DiffReport, *, max_rows: int = NOTEBOOK_ROWS) -> str:
    """The fragment for a :class:`DiffReport`: the counts,
    the most changed tensors first, and the non-tensor values that differ."""
    counts = report.counts()
    differ = len(report.tensors) - counts["unchanged"]
    verdict = "identical" if report.identical else f"{differ} tensor(s) differ"
    by_status = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    summary = (
        f"<b>Checkpoint diff</b> step {report.a} → step {report.b}: {verdict} "
        f"({by_status or 'no tensors'}); {len(report.values)} value(s) differ; "
        f"{report.tensors_read} tensor(s) read ({format_size(report.bytes_read)}), the rest "
        "settled by chunk hashes."
    )

    def key(r: object) -> tuple[bool, float, str]:
        rel = getattr(r, "relative", None)
        size = -1.0 if rel is None or math.isnan(rel) else rel
        return (getattr(r, "status", "") == "unchanged", -size, getattr(r, "name", ""))

    def color(status: str) -> str:
        return STATUS_COLOR.get(status, "#000")

    rows = sorted(report.tensors, key=key)[:max_rows]
    cells = [
        [
            f"<code>{escape_cell(r.name)}</code>",
            f"<span style='color:{color(r.status)}'>{escape_cell(r.status)}</span>",
            escape_cell(r.dtype if r.old_dtype is None else f"{r.old_dtype} → {r.dtype}"),
            escape_cell(
                list(r.shape) if r.old_shape is None else f"{list(r.old_shape)} → {list(r.shape)}"
            ),
            "—" if r.changed_elements is None else f"{r.changed_elements:,}",
            format_number(r.max_abs),
            format_number(r.relative),
        ]
        for r in rows
    ]
    head = ["tensor", "status", "dtype", "shape", "changed elements", "max |Δ|", "relative"]
    parts = [f"<div class='stalwart-diff'><p>{summary}</p>", html_table(head, cells)]
    parts.append(more_line(len(report.tensors), len(rows), "tensor(s)"))
    if report.values:
        vals = report.values[:max_rows]
        vcells = [
            [
                f"<code>{escape_cell(v.path)}</code>",
                escape_cell(v.status),
                f"<code>{escape_cell('—' if v.old is None else v.old)}</code>",
                f"<code>{escape_cell('—' if v.new is None else v.new)}</code>",
            ]
            for v in vals
        ]
        parts.append(
            html_table(["value", "status", f"step {report.a}", f"step {report.b}"], vcells)
        )
        parts.append(more_line(len(report.values), len(vals), "value(s)"))
    parts.append("</div>")
    return "".join(parts)
