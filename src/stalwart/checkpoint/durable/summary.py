"""What a committed step holds, as data: one row per tensor and the step's totals.

:func:`inspect_manifest` reads nothing but the manifest. ``Inspection`` converts to JSON, an
Arrow table, pandas / polars frames (``stalwart.frames``), and renders in notebooks
(``_repr_html_``); ``Manifest._repr_html_`` shows the same. It lives in the engine's room so
that the format record renders without importing the tools (which import the engine);
``stalwart.checkpoint.tools.inspection`` is its public path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from stalwart.errors import require
from stalwart.frames import ArrowFrames
from stalwart.notebook import (
    NOTEBOOK_ROWS,
    escape_cell,
    format_size,
    html_table,
    more_line,
)

__all__ = ["Inspection", "ManifestView", "TensorRow", "inspect_manifest", "render_inspection"]


class ManifestView(Protocol):
    """What :func:`inspect_manifest` reads of a manifest (``Manifest`` has it; this module
    names the shape instead of importing the record, which renders through it)."""

    step: int
    world_size: int
    created_unix: float
    metadata: dict[str, str]

    @property
    def tensors(self) -> Mapping[str, Any]: ...

    def chunks(self) -> list[Any]: ...

    def packs(self) -> set[str]: ...


@dataclass(frozen=True)
class TensorRow:
    """One tensor of a step.

    Attributes:
        name: the tensor's FQN.
        dtype: its dtype name (``float32``).
        shape: its global shape.
        shards: stored shards (boxes) it is split into.
        nbytes: logical bytes (elements x element size).
        chunks: chunk references of its shards.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    shards: int
    nbytes: int
    chunks: int


@dataclass
class Inspection(ArrowFrames):
    """A step's tensors and totals.

    Attributes:
        step: the step.
        world_size: ranks that saved it.
        created_unix: commit time, seconds since the epoch.
        metadata: the user's string metadata.
        tensors: one row per tensor, in manifest order.
        totals: ``tensors``, ``logical_bytes``, ``chunk_refs``, ``distinct_chunks``,
            ``stored_bytes``, ``dedup_ratio`` (logical / stored; None when nothing is stored)
            and ``packs``.
    """

    step: int
    world_size: int
    created_unix: float
    metadata: dict[str, str] = field(default_factory=dict)
    tensors: list[TensorRow] = field(default_factory=list)
    totals: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict (the shape ``stalwart ckpt inspect --json`` prints): the
        fields in order, the tensor rows last."""
        scalars = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tensors"}
        return {
            **scalars,
            "tensors": [
                {
                    "name": t.name,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "shards": t.shards,
                    "bytes": t.nbytes,
                    "chunks": t.chunks,
                }
                for t in self.tensors
            ],
        }

    def to_arrow(self) -> Any:
        """The tensor rows as a pyarrow Table: name, dtype, shape, shards, bytes, chunks."""
        pa = require("pyarrow", "frames", "Inspection.to_arrow")

        rows = self.to_json()["tensors"]
        schema = pa.schema(
            [
                ("name", pa.string()),
                ("dtype", pa.string()),
                ("shape", pa.list_(pa.int64())),
                ("shards", pa.int64()),
                ("bytes", pa.int64()),
                ("chunks", pa.int64()),
            ]
        )
        return pa.Table.from_pylist(rows, schema=schema)

    def _repr_html_(self) -> str:
        return render_inspection(self)


def inspect_manifest(manifest: ManifestView) -> Inspection:
    """Describe the step ``manifest`` commits, without reading any tensor data."""
    rows = [
        TensorRow(
            name,
            e.dtype,
            tuple(e.shape),
            len(e.shards),
            e.nbytes,
            sum(len(s.chunks) for s in e.shards),
        )
        for name, e in manifest.tensors.items()
    ]
    refs = manifest.chunks()
    distinct = {(c.pack, c.offset, c.length): c for c in refs}
    logical = sum(r.nbytes for r in rows)
    stored = sum(c.length for c in distinct.values())
    totals: dict[str, Any] = {
        "tensors": len(rows),
        "logical_bytes": logical,
        "chunk_refs": len(refs),
        "distinct_chunks": len({c.hash for c in refs}),
        "stored_bytes": stored,
        "dedup_ratio": logical / stored if stored else None,
        "packs": len(manifest.packs()),
    }
    return Inspection(
        manifest.step,
        manifest.world_size,
        manifest.created_unix,
        dict(manifest.metadata),
        rows,
        totals,
    )


def render_inspection(ins: Inspection, *, max_rows: int = NOTEBOOK_ROWS) -> str:
    """The fragment for an :class:`Inspection`: the
    totals, the largest tensors first, and the metadata."""
    t = ins.totals
    ratio = t.get("dedup_ratio")
    logical, stored = format_size(t.get("logical_bytes", 0)), format_size(t.get("stored_bytes", 0))
    summary = (
        f"<b>Checkpoint step {ins.step}</b>: {t.get('tensors', 0):,} tensor(s), "
        f"{logical} logical in {t.get('chunk_refs', 0):,} chunk refs; "
        f"{t.get('distinct_chunks', 0):,} distinct chunks, {stored} "
        f"stored in {t.get('packs', 0):,} pack(s); dedup ratio "
        f"{'—' if ratio is None else f'{ratio:.2f}x'}; world size {ins.world_size}."
    )
    rows = sorted(ins.tensors, key=lambda r: (-r.nbytes, r.name))[:max_rows]
    cells = [
        [
            f"<code>{escape_cell(r.name)}</code>",
            escape_cell(r.dtype),
            escape_cell(list(r.shape)),
            f"{r.shards:,}",
            format_size(r.nbytes),
            f"{r.chunks:,}",
        ]
        for r in rows
    ]
    head = ["tensor", "dtype", "shape", "shards", "bytes", "chunks"]
    parts = [f"<div class='stalwart-inspection'><p>{summary}</p>", html_table(head, cells)]
    parts.append(more_line(len(ins.tensors), len(rows), "tensor(s) (shown: largest first)"))
    if ins.metadata:
        items = list(ins.metadata.items())
        meta = [[f"<code>{escape_cell(k)}</code>", escape_cell(v)] for k, v in items[:max_rows]]
        parts.append(html_table(["metadata", "value"], meta))
        parts.append(more_line(len(items), len(meta), "metadata entries"))
    parts.append("</div>")
    return "".join(parts)
