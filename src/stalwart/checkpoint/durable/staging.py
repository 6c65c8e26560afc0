"""Bounded staging: an asynchronous save that never holds more than a cap of host memory.

    save_async(step, state)   with CheckpointOptions(max_staging_bytes=cap)
      ├─ blocking: plan ─► stage window 1 ─► write it ─► ... ─► stage the last window
      └─ background: write the last window ─► commit ─► retain

An unbounded asynchronous save copies the whole of this rank's state into one host buffer
before it returns: as much host memory again as the state (2 GiB a rank for an 8 GiB job on 4
ranks). With a cap, the boxes this rank writes are cut into *windows* of at most ``cap``
bytes (a box larger than the cap is split on chunk boundaries, so its chunks are the same as
in an unbounded save and deduplicate against it). Each window is copied into the one reused
buffer, then hashed and written as a pack of its own, before the next window is copied over
it; ``save_async`` returns once the last window is copied. From then on the save reads only
the buffer, never the state. The price: the call blocks for the writing of every window but
the last (close to a synchronous save when the cap is small against the state), and, since
one writer thread persists a root's saves in call order, for whatever earlier save is still
persisting ahead of it.

Only boxes this rank writes are staged (a replicated box is written by one rank of the job),
so the buffer never exceeds ``min(cap, bytes this rank writes)``. A box that is not contiguous
in memory (a transposed view, rare in a state dict) is made contiguous first, a temporary the
size of that box outside the cap.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from stalwart.checkpoint.capture import ALIGN_BYTES, HostBuffer
from stalwart.checkpoint.durable.manifest import ChunkRef, ShardEntry
from stalwart.checkpoint.durable.persist import (
    ChunkSink,
    PersistStats,
    Piece,
    persist_pieces,
    shard_entries,
)
from stalwart.checkpoint.durable.plan import BoxKey, LocalItem

__all__ = ["StagingWindows", "WindowPiece", "plan_windows"]


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True)
class WindowPiece:
    """Bytes ``[start, stop)`` of ``item``'s box, at ``offset`` in its window's buffer."""

    item: LocalItem
    start: int
    stop: int
    offset: int


def plan_windows(items: list[LocalItem], cap: int, chunk_bytes: int) -> list[list[WindowPiece]]:
    """Cut the boxes of ``items`` into windows of at most ``cap`` bytes (with alignment).

    Boxes keep their order; a box is split only where it does not fit, at a multiple of
    ``chunk_bytes`` from its start (``cap >= chunk_bytes``, so every window makes progress).
    """
    assert cap >= chunk_bytes
    windows: list[list[WindowPiece]] = [[]]
    used = 0
    for it in items:
        n, pos = it.nbytes, 0
        while True:
            at = _align(used)
            room = cap - at
            if n - pos <= room:
                windows[-1].append(WindowPiece(it, pos, n, at))
                used = at + (n - pos)
                break
            take = room // chunk_bytes * chunk_bytes
            if take > 0:
                windows[-1].append(WindowPiece(it, pos, pos + take, at))
                pos += take
            windows.append([])
            used = 0
    return [w for w in windows if w] or [[]]


def _box_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s row-major bytes as a flat ``uint8`` tensor on its device (a view if contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


class StagingWindows:
    """Stages one rank's boxes window by window through one reused buffer, and persists them.

    Args:
        buffer: the host buffer every window is copied into (grows to at most ``cap``).
        cap: largest window, in bytes.

    Attributes:
        staged: completes once the last window is copied (or the save failed before): the
            caller of ``save_async`` may change the state from then on.
        windows: how many windows the save used.
        largest_window: the largest window's bytes (alignment included).
    """

    def __init__(self, buffer: HostBuffer, cap: int) -> None:
        self.buffer = buffer
        self.cap = cap
        self.staged: Future[None] = Future()
        self.windows = 0
        self.largest_window = 0

    def finish(self) -> None:
        """Release the caller (idempotent): the save staged everything, or gave up."""
        if not self.staged.done():
            self.staged.set_result(None)

    def persist(
        self, sink: ChunkSink, items: list[LocalItem], pack_key: Callable[[int], str]
    ) -> tuple[dict[BoxKey, ShardEntry], PersistStats]:
        """Stage and write ``items`` window by window, as :func:`persist_boxes` would but for
        ``pack_key(i)``, the pack of window ``i`` (one pack per window)."""
        plan = plan_windows(items, self.cap, sink.options.chunk_bytes)
        self.windows = len(plan)
        # A later window may reference an earlier window's chunks: they join a copy of known.
        sink = replace(sink, known=dict(sink.known))
        chunks_of: dict[BoxKey, list[ChunkRef]] = {it.key: [] for it in items}
        total = PersistStats()
        sources: dict[BoxKey, torch.Tensor] = {}
        for i, window in enumerate(plan):
            size = max((p.offset + p.stop - p.start for p in window), default=0)
            self.largest_window = max(self.largest_window, size)
            data = self.buffer.acquire(size)
            pieces = []
            for p in window:
                src = sources.get(p.item.key)
                if src is None:
                    src = sources[p.item.key] = _box_bytes(p.item.tensor)
                dst = data[p.offset : p.offset + p.stop - p.start]
                if p.stop > p.start:
                    dst.copy_(src[p.start : p.stop])
                pieces.append(Piece(p.item.key, p.start, memoryview(dst.numpy().data).cast("B")))
                if p.stop == p.item.nbytes:
                    sources.pop(p.item.key)  # its last piece: no reference to the state kept
            if i == len(plan) - 1:
                sources.clear()
                self.finish()  # the state is never read again
            got, stats = persist_pieces(sink, pieces, pack_key(i))
            for key, refs in got.items():
                chunks_of[key] += refs
                sink.known.update((r.hash, r) for r in refs)
            _add(total, stats)
        return shard_entries(items, chunks_of), total


def _add(total: PersistStats, s: PersistStats) -> None:
    total.bytes_total += s.bytes_total
    total.bytes_written += s.bytes_written
    total.bytes_reused += s.bytes_reused
    total.chunks_written += s.chunks_written
    total.chunks_reused += s.chunks_reused
    total.packs += s.packs
    total.fast_index.update(s.fast_index)
