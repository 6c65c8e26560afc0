"""The on-disk format's records, as the loader reads them (``docs/format.md`` is the spec).

A committed step is one :class:`Manifest`: per tensor a :class:`TensorEntry` (dtype, global
shape) whose :class:`ShardEntry` boxes tile it, each made of :class:`ChunkRef` byte ranges in
pack files; views of another tensor's memory are :class:`TensorAlias` records.
``FORMAT_VERSION`` is the version this release writes. Tools that read manifests (inspect,
diff, export, DCP import) import them from here; the checkpointer returns them from
``Checkpointer.manifest(step)``.
"""

from __future__ import annotations

from stalwart.checkpoint.durable.aliases import TensorAlias
from stalwart.checkpoint.durable.manifest import (
    FORMAT_VERSION,
    ChunkRef,
    Manifest,
    ShardEntry,
    TensorEntry,
)

__all__ = ["FORMAT_VERSION", "ChunkRef", "Manifest", "ShardEntry", "TensorAlias", "TensorEntry"]
