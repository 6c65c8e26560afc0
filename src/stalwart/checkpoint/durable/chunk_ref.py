"""A chunk reference: where a chunk's bytes are stored, its name, and how a read checks them.

A chunk is named by the BLAKE3-256 of its raw bytes (:func:`chunk_hash`): saves find an
already-stored chunk by that name, and ``ckpt verify`` checks it. From format version 3 a
reference also records the chunk's XXH3-128 (:func:`chunk_check`), which loads check instead:
it catches the same damage (a flipped bit, a torn or misplaced write) at about a ninth of the
CPU time here (0.011 against 0.100 CPU-s per GiB, one core), which is what a load on more
ranks than cores waits for. Neither is a defence against someone who can write the store:
the manifest's own checksum is not keyed, so whoever can rewrite a chunk can rewrite the
manifest that names it (``docs/format.md`` §3).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import blake3
import xxhash

from stalwart.checkpoint.durable.integrity import MAX_INT, brief, uint
from stalwart.errors import CorruptCheckpointError
from stalwart.storage.base import Buffer, validate_key

__all__ = ["CODECS", "ZSTD_MAX_RATIO", "ChunkRef", "chunk_check", "chunk_hash"]

CODECS = ("none", "zstd")
ZSTD_MAX_RATIO = 1 << 16
"""A zstd frame cannot expand more than this (an RLE block: 4 bytes for 128 KiB)."""
HASH_RE = re.compile(r"[0-9a-f]{64}")  # used with fullmatch
_CHECK_RE = re.compile(r"[0-9a-f]{32}")


def chunk_hash(data: Buffer) -> str:
    """BLAKE3-256 of ``data`` as lowercase hex: a chunk's name (and an audit's checksum)."""
    return blake3.blake3(data).hexdigest()


def chunk_check(data: Buffer) -> str:
    """XXH3-128 of ``data`` as lowercase hex: what a load checks a chunk's bytes against."""
    return xxhash.xxh3_128_hexdigest(data)


@dataclass(frozen=True)
class ChunkRef:
    """One content-addressed chunk of a shard's bytes.

    Attributes:
        hash: BLAKE3-256 of the chunk's raw (uncompressed) bytes, lowercase hex. It names the
            chunk (saves deduplicate by it).
        nbytes: raw length in bytes.
        pack: storage key of the pack file holding the stored bytes.
        offset: byte offset of the stored bytes in the pack.
        length: stored length in bytes (differs from ``nbytes`` when compressed).
        codec: ``none`` or ``zstd``.
        check: XXH3-128 of the raw bytes, lowercase hex (format 3); empty in older manifests,
            whose loads check ``hash`` instead.
    """

    hash: str
    nbytes: int
    pack: str
    offset: int
    length: int
    codec: str = "none"
    check: str = ""

    def matches(self, raw: Buffer, *, audit: bool = False) -> bool:
        """Whether ``raw`` is this chunk's content: its length, and its ``check`` when the
        reference has one, else its BLAKE3 name. ``audit``: the name is checked as well."""
        if len(memoryview(raw)) != self.nbytes:
            return False
        if self.check and chunk_check(raw) != self.check:
            return False
        if self.check and not audit:
            return True
        return chunk_hash(raw) == self.hash

    def to_json(self) -> list[Any]:
        head = [self.hash, self.nbytes, self.pack, self.offset, self.length, self.codec]
        return [*head, self.check] if self.check else head

    @classmethod
    def from_json(cls, obj: Any) -> ChunkRef:
        if not (isinstance(obj, list) and len(obj) in (6, 7)):
            raise CorruptCheckpointError(f"malformed chunk reference {brief(obj)}")
        h, nbytes, pack, offset, length, codec, *rest = obj
        if not (isinstance(h, str) and HASH_RE.fullmatch(h)):
            raise CorruptCheckpointError(f"malformed chunk hash {brief(h)}")
        check = rest[0] if rest else ""
        if rest and not (isinstance(check, str) and _CHECK_RE.fullmatch(check)):
            raise CorruptCheckpointError(f"chunk {h}: malformed XXH3-128 check {brief(check)}")
        for name, v in (("nbytes", nbytes), ("offset", offset), ("length", length)):
            uint(v, f"chunk {h}: {name}")
        if offset + length > MAX_INT:
            raise CorruptCheckpointError(f"chunk {h}: offset + length exceeds {MAX_INT}")
        if codec not in CODECS:
            raise CorruptCheckpointError(f"chunk {h}: unknown codec {brief(codec)}")
        if codec == "none" and nbytes != length:
            raise CorruptCheckpointError(
                f"chunk {h}: uncompressed, yet {nbytes} raw bytes are stored in {length}"
            )
        if codec == "zstd" and nbytes > ZSTD_MAX_RATIO * length:
            raise CorruptCheckpointError(
                f"chunk {h}: {length} zstd bytes cannot hold {nbytes} raw bytes"
            )
        return cls(h, nbytes, validate_key(pack), offset, length, codec, check)
