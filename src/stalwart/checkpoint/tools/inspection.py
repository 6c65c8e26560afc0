"""What a committed step holds, as data: one row per tensor and the step's totals.

:func:`inspect_manifest` reads nothing but the manifest. ``Inspection`` converts to JSON, an
Arrow table, pandas / polars frames, and renders in notebooks (``_repr_html_``, drawn by
:mod:`stalwart.checkpoint.tools.notebook`); ``Manifest._repr_html_`` shows the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stalwart.checkpoint.durable.manifest import Manifest
from stalwart.errors import require

__all__ = ["Inspection", "TensorRow", "inspect_manifest"]


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
class Inspection:
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
        """A JSON-serialisable dict (the shape ``stalwart ckpt inspect --json`` prints)."""
        return {
            "step": self.step,
            "world_size": self.world_size,
            "created_unix": self.created_unix,
            "metadata": self.metadata,
            "totals": self.totals,
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

    def to_pandas(self) -> Any:
        """``to_arrow()`` as a pandas DataFrame (needs the ``frames`` extra)."""
        require("pandas", "frames", "Inspection.to_pandas")
        return self.to_arrow().to_pandas()

    def to_polars(self) -> Any:
        """``to_arrow()`` as a polars DataFrame (needs the ``frames`` extra)."""
        pl = require("polars", "frames", "Inspection.to_polars")
        return pl.from_arrow(self.to_arrow())

    def _repr_html_(self) -> str:
        from stalwart.checkpoint.tools.notebook import render_inspection

        return render_inspection(self)


def inspect_manifest(manifest: Manifest) -> Inspection:
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
