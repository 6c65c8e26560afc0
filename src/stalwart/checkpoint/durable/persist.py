"""Persist boxes as content-addressed chunks in one pack file per rank and save.

Each box's row-major bytes are cut at fixed offsets into chunks of at most ``chunk_bytes``
(so an unchanged tensor always yields the same chunks). Worker threads hash each chunk with
BLAKE3 (which releases the GIL) and compress it if asked; chunks the store already holds are
referenced, not written. New chunks stream, in order, into a single pack file written with
one atomic, durable ``Storage.write``: one large sequential stream per rank, no copies of
uncompressed tensor bytes on the way to the disk.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from stalwart.checkpoint.durable.chunk_ref import ChunkRef, chunk_check, chunk_hash
from stalwart.checkpoint.durable.manifest import ShardEntry
from stalwart.checkpoint.durable.plan import BoxKey, LocalItem
from stalwart.checkpoint.options import CheckpointOptions
from stalwart.storage.base import Buffer, Storage

__all__ = [
    "ChunkSink",
    "Piece",
    "PersistStats",
    "chunk_hash",
    "persist_boxes",
    "persist_pieces",
    "shard_entries",
    "tensor_bytes",
]

T = TypeVar("T")
R = TypeVar("R")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The row-major bytes of ``t`` on the CPU, without a copy when already contiguous."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy().data).cast("B")


@dataclass
class PersistStats:
    """What one rank's persist wrote and reused (logical bytes are raw tensor bytes)."""

    bytes_total: int = 0
    bytes_written: int = 0
    bytes_reused: int = 0
    chunks_written: int = 0
    chunks_reused: int = 0
    packs: list[str] = field(default_factory=list)
    fast_index: FastIndex = field(default_factory=dict, repr=False)


def ordered_map(
    pool: ThreadPoolExecutor,
    fn: Callable[[T], R],
    items: Iterable[T],
    window: int,
    *,
    first_alone: bool = True,
) -> Iterator[R]:
    """Like ``pool.map`` but with at most ``window`` tasks in flight (bounded memory).

    ``first_alone``: the first item runs by itself before the window fills, so its result
    (which a pack's write waits for before its first byte) does not share the cores with the
    next ``window - 1`` items: a DDP save of 1 GB on 4 ranks sharing 2 cores waited 20-90 ms
    for its first hashed chunk that way (docs/benchmarks.md, "eleventh round").
    """
    pending: deque[Future[R]] = deque()
    alone = first_alone
    for item in items:
        pending.append(pool.submit(fn, item))
        if alone:  # the next items are submitted once it is done, before it is yielded
            wait([pending[0]])
            alone = False
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


FastIndex = dict[tuple[BoxKey, int], tuple[str, str]]
"""(box, byte offset in the box) -> (XXH3-128 of the chunk, its BLAKE3 name) at the last save."""


@dataclass
class _Chunk:
    key: BoxKey
    start: int
    raw: memoryview
    fast: str = ""  # XXH3-128 hex of raw
    hash: str = ""
    payload: Buffer | None = None  # stored bytes for a new chunk; None when reused
    codec: str = "none"
    ref: ChunkRef | None = None


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, start + len(view))`` of the box ``key`` (``start`` on a chunk boundary).

    A whole box is one piece at 0; a staging window (``staging.py``) may hold a box in several.
    """

    key: BoxKey
    start: int
    view: memoryview


@dataclass(frozen=True)
class ChunkSink:
    """Where a save's new chunks go, and what it may reference instead of writing.

    Every pack of one save shares it: the boxes of :func:`persist_boxes`, the pieces of
    :func:`persist_pieces` and each staging window of ``StagingWindows.persist``.

    Attributes:
        storage: the store.
        known: chunks already committed in the store, by hash (read-only here).
        options: chunk size and compression.
        pool: worker threads for hashing and compression.
        previous: the fast index of this rank's last committed save (None: hash every chunk);
            ``stats.fast_index`` returns the one of this save.
    """

    storage: Storage
    known: dict[str, ChunkRef]
    options: CheckpointOptions
    pool: ThreadPoolExecutor
    previous: FastIndex | None = None


def persist_boxes(
    sink: ChunkSink, items: list[LocalItem], pack_key: str
) -> tuple[dict[BoxKey, ShardEntry], PersistStats]:
    """Write the boxes of ``items`` (the boxes this rank writes) and return their shard entries.

    New chunks go to one pack ``pack_key``, created only when some chunk is new.
    """
    pieces = [Piece(it.key, 0, tensor_bytes(it.tensor)) for it in items]
    chunks_of, stats = persist_pieces(sink, pieces, pack_key)
    return shard_entries(items, chunks_of), stats


def shard_entries(
    items: list[LocalItem], chunks_of: dict[BoxKey, list[ChunkRef]]
) -> dict[BoxKey, ShardEntry]:
    """Each box of ``items`` as a shard entry: where it lies in its tensor, and its chunks."""
    by_key = {it.key: it for it in items}
    return {
        key: ShardEntry(by_key[key].offsets, by_key[key].sizes, tuple(refs))
        for key, refs in chunks_of.items()
    }


def persist_pieces(
    sink: ChunkSink, pieces: list[Piece], pack_key: str
) -> tuple[dict[BoxKey, list[ChunkRef]], PersistStats]:
    """Write ``pieces`` as chunks into one new pack ``pack_key``; return each box's chunks, in
    order (a box's chunks follow the order of its pieces, which must come in byte order)."""
    options = sink.options
    stats = PersistStats()
    stats.bytes_total = sum(len(p.view) for p in pieces)

    prepare = _Preparer(sink)
    chunks_of: dict[BoxKey, list[ChunkRef]] = {p.key: [] for p in pieces}
    new_in_pack: dict[str, ChunkRef] = {}
    state = {"offset": 0}

    def stream() -> Iterator[Buffer]:
        for c in ordered_map(
            sink.pool,
            prepare.run,
            _cut(pieces, options.chunk_bytes),
            window=2 * options.io_threads + 2,
        ):
            if c.ref is None and c.hash in new_in_pack:
                c.ref = new_in_pack[c.hash]
            if c.ref is not None:
                stats.chunks_reused += 1
                stats.bytes_reused += len(c.raw)
            else:
                assert c.payload is not None
                c.ref = ChunkRef(
                    c.hash, len(c.raw), pack_key, state["offset"], len(c.payload), c.codec, c.fast
                )
                new_in_pack[c.hash] = c.ref
                state["offset"] += len(c.payload)
                stats.chunks_written += 1
                stats.bytes_written += len(c.payload)
                yield c.payload
            chunks_of[c.key].append(c.ref)
            stats.fast_index[(c.key, c.start)] = (c.fast, c.hash)

    # Peek: only create a pack when at least one chunk is new, so a fully deduplicated
    # save writes nothing but its manifest.
    gen = stream()
    first = next(gen, None)
    if first is not None:

        def whole() -> Iterator[Buffer]:
            yield first
            yield from gen

        sink.storage.write(pack_key, whole())
        stats.packs.append(pack_key)
    return chunks_of, stats


def _cut(pieces: list[Piece], step: int) -> Iterator[_Chunk]:
    """The chunks of ``pieces``, in order: each piece cut at every ``step`` bytes."""
    for p in pieces:
        assert p.start % step == 0, "a piece starts on a chunk boundary"
        for start in range(0, max(len(p.view), 1), step):
            yield _Chunk(key=p.key, start=p.start + start, raw=p.view[start : start + step])


class _Preparer:
    """Names one chunk (hashes it), finds it among ``known`` or readies its payload."""

    def __init__(self, sink: ChunkSink) -> None:
        self.known, self.options, self.previous = sink.known, sink.options, sink.previous
        self.zstd = threading.local()

    def run(self, c: _Chunk) -> _Chunk:
        # Change detection first: XXH3-128 runs ~10x faster than BLAKE3 here, so a chunk
        # whose bytes match what the same position held at the last save (and whose chunk
        # is still committed) reuses that save's BLAKE3 name without hashing it again.
        known = self.known
        c.fast = chunk_check(c.raw)  # also the check the new reference records (format 3)
        prev = self.previous.get((c.key, c.start)) if self.previous else None
        if prev is not None and prev[0] == c.fast and prev[1] in known:
            c.hash = prev[1]
            c.ref = _checked(known[c.hash], c.fast)
            return c
        c.hash = chunk_hash(c.raw)
        if c.hash in known:
            c.ref = _checked(known[c.hash], c.fast)
            return c
        c.payload = c.raw
        if self.options.compression == "zstd" and len(c.raw) > 0:
            import zstandard

            comp = getattr(self.zstd, "c", None)
            if comp is None:
                comp = zstandard.ZstdCompressor(level=self.options.compression_level)
                self.zstd.c = comp
            packed = comp.compress(c.raw)
            if len(packed) < len(c.raw):
                c.payload, c.codec = packed, "zstd"
        return c


def _checked(ref: ChunkRef, check: str) -> ChunkRef:
    """A known chunk's reference with the check this save computed from the same bytes (a
    reference from a format 2 manifest has none)."""
    return ref if ref.check == check else dataclasses.replace(ref, check=check)
