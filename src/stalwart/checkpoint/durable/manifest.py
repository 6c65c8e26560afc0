"""The manifest: what a committed checkpoint holds and where its bytes live (format v3).

A manifest is one JSON object per checkpoint, written last (see ``commit.py``). Its presence
is the commit: a checkpoint without a manifest does not exist. ``docs/format.md`` is the
normative spec; this module is its reference reader and writer.

Parsing is strict and pickle-free: every field is type-checked, every number bounded, every
storage key passes ``validate_key``, and the structure is checked (``integrity.py``) before
anything is allocated or read, so that an untrusted manifest can neither run code, point
outside its store, ask for absurd amounts of memory, nor leave part of a tensor unread.
Version 2 adds a BLAKE3 checksum of the manifest itself (the last member, ``checksum``),
so that a flipped byte in a plain value is caught too; version 3 adds each chunk's XXH3-128,
which loads check (:mod:`~stalwart.checkpoint.durable.chunk_ref`). Versions 1 and 2 still load.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import blake3

from stalwart.checkpoint.durable.aliases import TensorAlias, parse_aliases
from stalwart.checkpoint.durable.chunk_ref import HASH_RE, ChunkRef
from stalwart.checkpoint.durable.integrity import (
    MAX_INT,
    brief,
    check_skeleton,
    tiling_problems,
    uint,
)
from stalwart.checkpoint.durable.summary import inspect_manifest, render_inspection
from stalwart.errors import CorruptCheckpointError
from stalwart.storage.base import ObjectInfo, Storage
from stalwart.tree import dtype_from_name

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_STEP",
    "ChunkRef",
    "Manifest",
    "ShardEntry",
    "TensorAlias",
    "TensorEntry",
    "committed_manifests",
    "manifest_key",
    "step_from_key",
]

FORMAT_NAME = "stalwart.checkpoint"
FORMAT_VERSION = 3
READ_VERSIONS = (1, 2, 3)
"""Versions this reader understands: v1 (no manifest checksum), v2, and v3 (chunk checks)."""
MANIFEST_PREFIX = "manifests/"
MAX_STEP = 10**20 - 1
"""Largest step: the manifest key holds the step in 20 digits."""
MAX_BYTES = MAX_INT
"""Bound on every byte count, offset and length (and a tensor's size) a manifest may state."""
MAX_NDIM = 64
MAX_WORLD_SIZE = (1 << 31) - 1
_MANIFEST_RE = re.compile(r"^manifests/step-(\d{20})\.json$")
_CHECKSUM_HEAD = b',"checksum":"'


def manifest_key(step: int) -> str:
    """Storage key of the manifest for ``step`` (zero-padded so keys sort by step)."""
    return f"{MANIFEST_PREFIX}step-{step:020d}.json"


def step_from_key(key: str) -> int | None:
    """The step a manifest key names, or None for keys that are not manifests."""
    m = _MANIFEST_RE.match(key)
    return int(m.group(1)) if m else None


def committed_manifests(store: Storage) -> dict[int, ObjectInfo]:
    """The manifests on ``store`` now, by step, ascending: the committed steps.

    Other objects under ``manifests/`` (a temporary, a stray file) are not manifests: skipped.
    """
    found = {step_from_key(i.key): i for i in store.list(MANIFEST_PREFIX)}
    return {s: found[s] for s in sorted(s for s in found if s is not None)}


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
        aliases: tensors saved as views of another tensor's memory, by name (optional).
    """

    step: int
    tensors: dict[str, TensorEntry]
    skeleton: dict[str, Any]
    world_size: int = 1
    created_unix: float = 0.0
    metadata: dict[str, str] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    aliases: dict[str, TensorAlias] = field(default_factory=dict)

    def chunks(self) -> list[ChunkRef]:
        """Every chunk reference, in tensor and shard order (may repeat a chunk)."""
        return [c for t in self.tensors.values() for s in t.shards for c in s.chunks]

    def packs(self) -> set[str]:
        """Keys of every pack file this checkpoint reads."""
        return {c.pack for c in self.chunks()}

    def _repr_html_(self) -> str:
        """Jupyter's rendering: the step's inspection (see ``durable/summary.py``)."""
        return render_inspection(inspect_manifest(self))

    def to_bytes(self) -> bytes:
        """The manifest as written: compact JSON whose last member is its checksum."""
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
        if self.aliases:  # optional: absent, the bytes are those of a manifest without it
            doc["aliases"] = {name: a.to_json() for name, a in self.aliases.items()}
        body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")
        digest = blake3.blake3(body).hexdigest().encode("ascii")
        return body[:-1] + _CHECKSUM_HEAD + digest + b'"}'

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        """Parse and validate a manifest; raise CorruptCheckpointError naming ``where``.

        Every field is type-checked and bounded, the skeleton and the tiling of every tensor
        are checked, and (version 2) the checksum is verified, all before any tensor memory
        is allocated or any chunk read.
        """
        try:
            doc = json.loads(bytes(data).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            # ValueError covers JSONDecodeError and integers of more than 4,300 digits;
            # RecursionError, nesting deeper than the parser's stack.
            raise CorruptCheckpointError(
                f"{where} is not valid JSON ({type(e).__name__}: {brief(str(e))}); the file is "
                "damaged or truncated — load an earlier step or use fallback=True"
            ) from e
        try:
            m, problems = cls._from_doc(doc)
            if problems:
                raise CorruptCheckpointError(
                    f"{len(problems)} problem(s): " + "; ".join(problems[:3]), problems
                )
            _check_checksum(doc, bytes(data))
            return m
        except CorruptCheckpointError as e:
            raise type(e)(
                f"{where}: {e} — load an earlier step or use fallback=True, and run "
                "`stalwart ckpt verify` for the full report",
                [f"{where}: {d}" for d in e.damaged],
            ) from e
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
            raise CorruptCheckpointError(
                f"{where}: malformed manifest ({type(e).__name__}: {brief(str(e))}) — load an "
                "earlier step or use fallback=True"
            ) from e

    @classmethod
    def _from_doc(cls, doc: Any) -> tuple[Manifest, list[str]]:
        """The manifest of a parsed document, and every tiling problem found in it."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError("not a stalwart manifest (missing 'format')")
        version = doc.get("version")
        if version not in READ_VERSIONS or isinstance(version, bool):
            raise CorruptCheckpointError(
                f"manifest format version {brief(version)} is not supported by this stalwart "
                f"(reads versions {list(READ_VERSIONS)}); upgrade stalwart to read it"
            )
        tensors = _dict(doc["tensors"], "tensors")
        entries = {name: _tensor_entry(name, t) for name, t in tensors.items()}
        problems = [p for name, e in entries.items() for p in tiling_problems(name, e)]
        check_skeleton(doc["skeleton"], entries)
        step = uint(doc["step"], "step", MAX_STEP)
        meta = _dict(doc.get("metadata", {}), "metadata")
        if not all(isinstance(v, str) for v in meta.values()):
            raise CorruptCheckpointError("metadata must map strings to strings")
        stats = {
            k: _finite(v, f"stats[{k!r}]") for k, v in _dict(doc.get("stats", {}), "stats").items()
        }
        m = cls(
            step=step,
            tensors=entries,
            skeleton=doc["skeleton"],
            world_size=uint(doc.get("world_size", 1), "world_size", MAX_WORLD_SIZE),
            created_unix=_finite(doc.get("created_unix", 0.0), "created_unix"),
            metadata=meta,
            stats=stats,
            aliases=parse_aliases(doc.get("aliases", {}), entries),
        )
        return m, problems


def _check_checksum(doc: dict[str, Any], data: bytes) -> None:
    """Verify the manifest's checksum: required from version 2, checked whenever present.

    The checksum is BLAKE3 of the manifest's bytes without its last member
    ``,"checksum":"<hex>"`` (the writer puts it last; see docs/format.md §3). A version 1
    manifest that carries one (a damaged version number) is checked too.
    """
    if "checksum" not in doc:
        if doc["version"] == 1:
            return
        raise CorruptCheckpointError(
            f"a version {doc['version']} manifest must end with its checksum, and this one has none"
        )
    want = doc["checksum"]
    ok = isinstance(want, str) and HASH_RE.fullmatch(want) is not None
    tail = _CHECKSUM_HEAD + (want.encode("ascii") if ok else b"") + b'"}'
    if not (ok and data.endswith(tail)):
        raise CorruptCheckpointError(
            "the manifest checksum is malformed or not the last member (damaged manifest)"
        )
    body = data[: len(data) - len(tail)] + b"}"
    if blake3.blake3(body).hexdigest() != want:
        raise CorruptCheckpointError(
            "the manifest does not match its checksum: it changed after it was written "
            "(bit rot, a partial overwrite or an edit)"
        )


def _tensor_entry(name: str, t: Any) -> TensorEntry:
    """A tensor entry, its numbers bounded and its shards inside its shape."""
    t = _dict(t, f"tensor {name!r}")
    dtype = t["dtype"]
    esize = dtype_from_name(dtype).itemsize
    shape = _int_tuple(t["shape"], f"tensor {name!r} shape")
    if _numel(shape) * esize > MAX_BYTES:
        raise CorruptCheckpointError(f"tensor {name!r}: shape {list(shape)} is impossibly large")
    shards = []
    for s in _list(t["shards"], f"tensor {name!r} shards"):
        s = _dict(s, f"tensor {name!r} shard")
        offsets = _int_tuple(s["offsets"], f"tensor {name!r} shard offsets")
        sizes = _int_tuple(s["sizes"], f"tensor {name!r} shard sizes")
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise CorruptCheckpointError(f"tensor {name!r}: shard rank != tensor rank")
        if any(o + z > d for o, z, d in zip(offsets, sizes, shape, strict=True)):
            raise CorruptCheckpointError(f"tensor {name!r}: shard outside the tensor")
        chunks = _list(s["chunks"], f"tensor {name!r} chunks")
        shards.append(ShardEntry(offsets, sizes, tuple(ChunkRef.from_json(c) for c in chunks)))
    return TensorEntry(dtype, shape, tuple(shards))


def _finite(value: Any, what: str) -> float:
    try:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        f = float(value) if ok else math.nan
    except OverflowError:
        f = math.nan
    if not math.isfinite(f):
        raise CorruptCheckpointError(f"{what} must be a finite number, not {brief(value)}")
    return f


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{what} must be a JSON object, not {brief(value)}")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise CorruptCheckpointError(f"{what} must be a JSON list, not {brief(value)}")
    return value


def _int_tuple(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        raise CorruptCheckpointError(f"{what} must be a list of at most {MAX_NDIM} ints")
    return tuple(uint(v, what) for v in value)


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
        if n > MAX_BYTES:
            return MAX_BYTES + 1  # stop early: a hostile shape may multiply to 10**5000
    return n
