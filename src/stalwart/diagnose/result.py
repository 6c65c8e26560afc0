"""What an analysis returns: findings, their neighbours and examples, the cleaning applied, and
renderings as a plain dict (JSON for bots), an Arrow table (and pandas / polars frames of it),
a rich table for the terminal and a compact HTML table for notebooks (through the leaf
``notebook.py``). A fleet's analysis (``FleetDiagnosis``) holds one ``Diagnosis`` per kind of
fault and renders as their sections. The one-file HTML report is ``report.write_html``'s:
rendering sits on top of the result, which never imports it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from stalwart.diagnose.notebook import render_notebook
from stalwart.frames import ArrowFrames
from stalwart.notebook import escape

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["Diagnosis", "Finding", "FleetDiagnosis", "Neighbour"]


@dataclass(frozen=True)
class Neighbour:
    """An item-set pruned in favour of a finding, and why."""

    items: dict[str, str]
    failures: float
    rows: float
    lift: float
    reason: str


@dataclass(frozen=True)
class Finding:
    """One combination of attribute values that singles out failures (or a KPI's deviation).

    ``failures`` and ``rows`` are masses: counts of rows (or sums of the weight column) for
    labelled events; deviation and reference mass in KPI mode.
    """

    items: dict[str, str]
    failures: float
    rows: float
    support: float
    """Share of all failures (or of the deviation) inside the finding."""
    lift: float
    """Failure rate inside / overall failure rate."""
    lift_low: float
    lift_high: float
    explained: float
    """Share of all failures attributable to the finding beyond the rate of the rows left
    unexplained by earlier findings: (failures - rows * residual rate) / all failures."""
    subsumed: tuple[Neighbour, ...] = ()
    examples: tuple[dict[str, str], ...] = ()
    confidence: float = 0.0
    """How sure the analysis is of this finding, 0..1 (``score.finding_confidence``)."""

    def label(self) -> str:
        """``col=value & col=value``."""
        return " & ".join(f"{k}={v}" for k, v in self.items.items())


@dataclass
class Diagnosis(ArrowFrames):
    """Result of ``analyze`` or ``localize``."""

    findings: list[Finding]
    mode: str
    total_failures: float
    total_rows: float
    groups: int
    """Rows the reference counts ran over: the coded input rows when they fit in memory, else
    the distinct groups of DuckDB's GROUP BY."""
    columns: tuple[str, ...]
    cleaning: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    candidates: int = 0
    covered: float = 0.0
    timings_s: dict[str, float] = field(default_factory=dict)
    message: str = ""
    """Why nothing was found, when ``findings`` is empty."""
    confidence: float = 0.0
    """How sure the analysis is of its findings together, 0..1: their confidences weighted by
    what each explains, times the share they explain (``score.overall_confidence``)."""

    @property
    def base_rate(self) -> float:
        return self.total_failures / self.total_rows if self.total_rows > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain data: ``{"findings": [{"items": {...}, "support", "lift", "failures", "rows",
        ...}], ...}``."""
        findings = []
        for f in self.findings:
            d = asdict(f)
            d["subsumed"] = [asdict(n) for n in f.subsumed]
            d["examples"] = list(f.examples)
            findings.append(d)
        return {
            "findings": findings,
            "mode": self.mode,
            "total_failures": self.total_failures,
            "total_rows": self.total_rows,
            "base_rate": self.base_rate,
            "groups": self.groups,
            "columns": list(self.columns),
            "covered": self.covered,
            "candidates": self.candidates,
            "cleaning": self.cleaning,
            "notes": self.notes,
            "message": self.message,
            "confidence": self.confidence,
            "timings_s": self.timings_s,
        }

    def to_json(self, path: str | Path | None = None, *, indent: int | None = 2) -> str:
        """The dict as JSON text; also written to ``path`` when given."""
        return _json(self.to_dict(), path, indent)

    def table(self, *, title: str | None = None) -> Table:
        """A rich table of the findings."""
        what = "deviation" if self.mode != "events" else "failures"
        table = Table(title=title, title_justify="left")
        table.add_column("#", justify="right")
        table.add_column("finding")
        table.add_column(what, justify="right")
        table.add_column("rows" if self.mode == "events" else "reference", justify="right")
        table.add_column("support", justify="right")
        table.add_column("lift [interval]", justify="right")
        table.add_column("explains", justify="right")
        for i, f in enumerate(self.findings, 1):
            table.add_row(
                str(i),
                f.label(),
                _num(f.failures),
                _num(f.rows),
                f"{f.support:.1%}",
                f"{f.lift:.2f} [{f.lift_low:.2f}, {f.lift_high:.2f}]",
                f"{f.explained:.1%}",
            )
        return table

    def to_arrow(self) -> pa.Table:
        """The findings as a pyarrow Table, one row per finding, best first.

        Columns: ``rank``, ``finding`` (the label), one text column per attribute that any
        finding names (NULL where the finding does not constrain it; an attribute named like
        a metric column gets an ``item_`` prefix), then ``failures``, ``rows``, ``support``,
        ``lift``, ``lift_low``, ``lift_high``, ``explained``, ``subsumed`` (neighbours pruned
        into the finding). The same numbers as ``to_dict()["findings"]``.
        """
        import pyarrow as pa  # the rca extra, which stalwart.diagnose needs, installs it

        fixed = ("failures", "rows", "support", "lift", "lift_low", "lift_high", "explained")
        named = {k for f in self.findings for k in f.items}
        attrs = [c for c in self.columns if c in named] + sorted(named - set(self.columns))
        cols: dict[str, Any] = {
            "rank": pa.array(range(1, len(self.findings) + 1), pa.int64()),
            "finding": pa.array([f.label() for f in self.findings], pa.string()),
        }
        for a in attrs:
            key = f"item_{a}" if a in (*fixed, "rank", "finding", "subsumed") else a
            cols[key] = pa.array([f.items.get(a) for f in self.findings], pa.string())
        for name in fixed:
            cols[name] = pa.array([float(getattr(f, name)) for f in self.findings], pa.float64())
        cols["subsumed"] = pa.array([len(f.subsumed) for f in self.findings], pa.int64())
        return pa.table(cols)

    def _repr_html_(self) -> str:
        """Jupyter's rendering: a summary and the top findings (``notebook.render_notebook``)."""
        return render_notebook(
            self.to_arrow(),
            mode=self.mode,
            total_failures=self.total_failures,
            total_rows=self.total_rows,
            covered=self.covered,
            message=self.message,
        )


@dataclass
class FleetDiagnosis(ArrowFrames):
    """Result of ``analyze_fleet``: one ``Diagnosis`` per kind of fault, each over the fleet's
    worker incarnations (a row each) with the kind as the failure label."""

    kinds: dict[str, Diagnosis]
    """Fault kind -> its analysis, in ``FaultKind`` order."""
    runs: int
    members: int
    """Worker incarnations: the rows every analysis ran over."""
    faults: dict[str, int]
    """Fault rows per kind (an incarnation may hold several of one kind)."""
    columns: tuple[str, ...]
    """The attributes: the hosts' and the runs'."""
    notes: list[str] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)

    mode = "fleet"

    def to_dict(self) -> dict[str, Any]:
        """Plain data: the fleet's counts and ``{"kinds": {kind: Diagnosis.to_dict()}}``."""
        data: dict[str, Any] = {"mode": self.mode}
        data.update((f.name, getattr(self, f.name)) for f in fields(self))
        data["columns"] = list(self.columns)
        data["kinds"] = {k: d.to_dict() for k, d in self.kinds.items()}
        return data

    def to_json(self, path: str | Path | None = None, *, indent: int | None = 2) -> str:
        """The dict as JSON text; also written to ``path`` when given."""
        return _json(self.to_dict(), path, indent)

    def summary(self) -> str:
        """One line: runs, incarnations and faults per kind."""
        faults = ", ".join(f"{k} {n:,}" for k, n in self.faults.items())
        return f"{self.runs:,} runs, {self.members:,} worker incarnations; faults: {faults}"

    def to_arrow(self) -> pa.Table:
        """Every kind's findings (``Diagnosis.to_arrow``) in one table, a ``kind`` column first;
        attributes one kind's findings do not name are NULL."""
        import pyarrow as pa

        parts = []
        for kind, d in self.kinds.items():
            t = d.to_arrow()
            parts.append(t.add_column(0, "kind", pa.array([kind] * t.num_rows, pa.string())))
        return pa.concat_tables(parts, promote_options="default")

    def _repr_html_(self) -> str:
        """Jupyter's rendering: the fleet's summary, then each kind's top findings."""
        parts = [f"<p>{escape(self.summary())}</p>"]
        for kind, d in self.kinds.items():
            parts += [f"<h4>{escape(kind)}</h4>", d._repr_html_()]
        return "\n".join(parts)


def _json(data: dict[str, Any], path: str | Path | None, indent: int | None) -> str:
    text = json.dumps(data, indent=indent, ensure_ascii=False, default=str)
    if path is not None:
        Path(path).write_text(text + "\n", encoding="utf-8")
    return text


def _num(x: float) -> str:
    if x == int(x):
        return f"{int(x):,}"
    return f"{x:,.2f}"
