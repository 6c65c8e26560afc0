"""The manifest: what a committed checkpoint holds and where its bytes live (format v1).

A manifest is one JSON object per checkpoint, written last (see ``commit.py``). Its presence
is the commit: a checkpoint without a manifest does not exist. ``docs/format.md`` is the
normative spec; this module is its reference reader and writer.

Parsing is strict and pickle-free: every field is type-checked and every storage key passes
``validate_key`` so that an untrusted manifest can neither run code nor point outside its
store.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from stalwart.errors import CorruptCheckpointError
from stalwart.storage.base import validate_key
from stalwart.tree import dtype_from_name

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ChunkRef",
    "Manifest",
    "ShardEntry",
    "TensorEntry",
    "manifest_key",
    "step_from_key",
]

FORMAT_NAME = "stalwart.checkpoint"
FORMAT_VERSION = 1
MANIFEST_PREFIX = "manifests/"
_MANIFEST_RE = re.compile(r"^manifests/step-(\d{20})\.json$")
_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
CODECS = ("none", "zstd")


def manifest_key(step: int) -> str:
    """Storage key of the manifest for ``step`` (zero-padded so keys sort by step)."""
    return f"{MANIFEST_PREFIX}step-{step:020d}.json"


def step_from_key(key: str) -> int | None:
    """The step a manifest key names, or None for keys that are not manifests."""
    m = _MANIFEST_RE.match(key)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ChunkRef:
    """One content-addressed chunk of a shard's bytes.

    Attributes:
        hash: BLAKE3-256 of the chunk's raw (uncompressed) bytes, lowercase hex. It names the
            chunk and is its checksum.
        nbytes: raw length in bytes.
        pack: storage key of the pack file holding the stored bytes.
        offset: byte offset of the stored bytes in the pack.
        length: stored length in bytes (differs from ``nbytes`` when compressed).
        codec: ``none`` or ``zstd``.
    """

    hash: str
    nbytes: int
    pack: str
    offset: int
    length: int
    codec: str = "none"

    def to_json(self) -> list[Any]:
        return [self.hash, self.nbytes, self.pack, self.offset, self.length, self.codec]

    @classmethod
    def from_json(cls, obj: Any) -> ChunkRef:
        if not (isinstance(obj, list) and len(obj) == 6):
            raise CorruptCheckpointError(f"malformed chunk reference {obj!r}")
        h, nbytes, pack, offset, length, codec = obj
        if not (isinstance(h, str) and _HASH_RE.match(h)):
            raise CorruptCheckpointError(f"malformed chunk hash {h!r}")
        for name, v in (("nbytes", nbytes), ("offset", offset), ("length", length)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise CorruptCheckpointError(f"chunk {h}: {name} must be a non-negative int")
        if codec not in CODECS:
            raise CorruptCheckpointError(f"chunk {h}: unknown codec {codec!r}")
        return cls(h, nbytes, validate_key(pack), offset, length, codec)


@dataclass(frozen=True)
class ShardEntry:
    """A box of a tensor, stored as the row-major bytes of that box, cut into chunks.

    Attributes:
        offsets: the box's start in the global tensor, one int per dimension.
        sizes: the box's extent, one int per dimension.
        chunks: the chunks whose raw bytes, concatenated, are the box's bytes.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    chunks: tuple[ChunkRef, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def to_json(self) -> dict[str, Any]:
        return {
            "offsets": list(self.offsets),
            "sizes": list(self.sizes),
            "chunks": [c.to_json() for c in self.chunks],
        }


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the checkpoint: dtype, global shape and the shards that cover it."""

    dtype: str
    shape: tuple[int, ...]
    shards: tuple[ShardEntry, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "shards": [s.to_json() for s in self.shards],
        }


@dataclass
class Manifest:
    """Everything a committed checkpoint holds.

    Attributes:
        step: the training step the checkpoint was taken at.
        tensors: tensor entries by fully qualified name.
        skeleton: the JSON tree structure (see ``stalwart.tree``).
        world_size: number of ranks that saved it.
        created_unix: commit time, seconds since the epoch.
        metadata: free-form string metadata supplied by the user.
        stats: save statistics (bytes written, reused, seconds), informational.
    """

    step: int
    tensors: dict[str, TensorEntry]
    skeleton: dict[str, Any]
    world_size: int = 1
    created_unix: float = 0.0
    metadata: dict[str, str] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)

    def chunks(self) -> list[ChunkRef]:
        """Every chunk reference, in tensor and shard order (may repeat a chunk)."""
        return [c for t in self.tensors.values() for s in t.shards for c in s.chunks]

    def packs(self) -> set[str]:
        """Keys of every pack file this checkpoint reads."""
        return {c.pack for c in self.chunks()}

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "created_unix": self.created_unix,
            "metadata": self.metadata,
            "stats": self.stats,
            "tensors": {name: t.to_json() for name, t in self.tensors.items()},
            "skeleton": self.skeleton,
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        """Parse and validate a manifest; raise CorruptCheckpointError naming ``where``."""
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(
                f"{where} is not valid JSON ({e}); the file is damaged or truncated — "
                "load an earlier step or use fallback=True"
            ) from e
        try:
            return cls._from_doc(doc)
        except CorruptCheckpointError as e:
            raise type(e)(f"{where}: {e}") from e
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptCheckpointError(f"{where}: malformed manifest ({e!r})") from e

    @classmethod
    def _from_doc(cls, doc: Any) -> Manifest:
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError("not a stalwart manifest (missing 'format')")
        version = doc.get("version")
        if version != FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"manifest format version {version!r} is not supported by this stalwart "
                f"(reads version {FORMAT_VERSION}); upgrade stalwart to read it"
            )
        tensors: dict[str, TensorEntry] = {}
        for name, t in doc["tensors"].items():
            dtype_from_name(t["dtype"])
            shape = _int_tuple(t["shape"], f"tensor {name!r} shape")
            shards = []
            for s in t["shards"]:
                offsets = _int_tuple(s["offsets"], f"tensor {name!r} shard offsets")
                sizes = _int_tuple(s["sizes"], f"tensor {name!r} shard sizes")
                if len(offsets) != len(shape) or len(sizes) != len(shape):
                    raise CorruptCheckpointError(f"tensor {name!r}: shard rank != tensor rank")
                if any(o + z > d for o, z, d in zip(offsets, sizes, shape, strict=True)):
                    raise CorruptCheckpointError(f"tensor {name!r}: shard outside the tensor")
                chunks = tuple(ChunkRef.from_json(c) for c in s["chunks"])
                shards.append(ShardEntry(offsets, sizes, chunks))
            tensors[name] = TensorEntry(t["dtype"], shape, tuple(shards))
        step = doc["step"]
        if not isinstance(step, int) or step < 0:
            raise CorruptCheckpointError(f"step {step!r} is not a non-negative int")
        meta = doc.get("metadata", {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise CorruptCheckpointError("metadata must map strings to strings")
        stats = {str(k): float(v) for k, v in doc.get("stats", {}).items()}
        created = float(doc.get("created_unix", 0.0))
        if not math.isfinite(created):
            created = 0.0
        return cls(
            step=step,
            tensors=tensors,
            skeleton=doc["skeleton"],
            world_size=int(doc.get("world_size", 1)),
            created_unix=created,
            metadata=meta,
            stats=stats,
        )


def _int_tuple(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise CorruptCheckpointError(f"{what} must be a list of non-negative ints")
    return tuple(value)
