"""Load tensors' boxes from whatever shards a checkpoint holds, verifying every chunk.

The loading rank wants a box of each global tensor (the whole tensor for a plain tensor, the
local shard for a DTensor). For each saved shard that overlaps it, only the chunks holding
leading-dimension rows that overlap are read. A load is planned first, then read:

1. **Plan.** Each chunk needed becomes one read, with the places its bytes go (a slice of
   the destination tensor when the overlap spans whole rows of both the saved shard and the
   box, else a slice of a temporary the overlapping sub-box is copied out of afterwards).
   A chunk shared by several tensors (same content) is read once.
2. **Read, verify, then copy** (``spans.py``): chunks adjacent in a pack are read together,
   one pool reading ahead while another hashes; each chunk's bytes land only once its hash
   matched. A failed load waits for every read in flight before it raises, so nothing is
   written into the tensors after it returns.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from stalwart.checkpoint.durable.manifest import ChunkRef, TensorEntry
from stalwart.checkpoint.durable.persist import tensor_bytes
from stalwart.checkpoint.durable.spans import (
    SPAN_BYTES,
    Landing,
    Need,
    Pipeline,
    chunk_what,
    merge_spans,
    read_span,
    verify_chunk,
)
from stalwart.errors import CorruptCheckpointError
from stalwart.storage.base import Storage
from stalwart.tree import dtype_from_name

__all__ = ["SPAN_BYTES", "Box", "ReadStats", "read_box", "read_boxes", "verify_chunk"]


Copies = list[Callable[[], None]]
"""Copies to run once every read landed (a box assembled from part-rows of saved shards)."""


@dataclass
class ReadStats:
    """Bytes read from storage (stored bytes) and chunks verified."""

    bytes_read: int = 0
    chunks_verified: int = 0


@dataclass(frozen=True)
class Box:
    """A box of tensor ``fqn`` at ``offsets`` to fill into ``dest`` (contiguous, CPU)."""

    entry: TensorEntry
    fqn: str
    offsets: tuple[int, ...]
    dest: torch.Tensor


def _describe(where: str, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> str:
    return f"{where}: tensor {fqn!r}, shard at offsets {list(offsets)} sizes {list(sizes)}"


def _plan_box(box: Box, where: str, needs: dict[ChunkRef, Need], after: Copies, tag: int) -> None:
    """Add the chunk reads that fill ``box`` (``tag``: its index) to ``needs``; copies to run
    after to ``after``.

    Raises:
        CorruptCheckpointError: the shards do not cover the box.
    """
    entry, fqn, offsets, dest = box.entry, box.fqn, box.offsets, box.dest
    sizes = tuple(dest.shape)
    dtype = dtype_from_name(entry.dtype)
    if dest.dtype != dtype or not dest.is_contiguous() or dest.device.type != "cpu":
        raise AssertionError("read_box needs a contiguous CPU tensor of the entry's dtype")
    esize = dest.element_size()
    dest_bytes = tensor_bytes(dest)

    def add(shard_i: int, lo: int, hi: int, out: memoryview) -> None:
        """Chunks of shard ``shard_i`` covering its raw bytes ``[lo, hi)`` fill ``out``."""
        shard = entry.shards[shard_i]
        prefix = _describe(where, fqn, shard.offsets, shard.sizes)
        cs = 0
        for c in shard.chunks:
            ce = cs + c.nbytes
            if ce > lo and cs < hi:
                # Keyed by the whole reference: two references to one pack offset with
                # different hashes (a damaged manifest) must each be verified.
                need = needs.setdefault(c, Need(c, chunk_what(prefix, c)))
                need.boxes.add(tag)
                a, b = max(lo, cs), min(hi, ce)
                need.sinks.append((out[a - lo : b - lo], a - cs, b - cs))
            cs = ce

    if not sizes:  # 0-dim tensor: one shard, one element
        if not entry.shards:
            raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has no shard", [fqn])
        add(0, 0, esize, dest_bytes)
        return
    covered = 0
    for i, shard in enumerate(entry.shards):
        lo_g = [max(o, so) for o, so in zip(offsets, shard.offsets, strict=True)]
        hi_g = [
            min(o + s, so + ss)
            for o, s, so, ss in zip(offsets, sizes, shard.offsets, shard.sizes, strict=True)
        ]
        if any(a >= b for a, b in zip(lo_g, hi_g, strict=True)):
            continue
        ov_sizes = [b - a for a, b in zip(lo_g, hi_g, strict=True)]
        covered += _numel(ov_sizes)
        row_bytes = _numel(shard.sizes[1:]) * esize
        r0, r1 = lo_g[0] - shard.offsets[0], hi_g[0] - shard.offsets[0]
        if list(shard.sizes[1:]) == ov_sizes[1:] == list(sizes[1:]):
            # Whole rows on both sides: a straight byte range of the destination.
            d0 = (lo_g[0] - offsets[0]) * row_bytes
            add(i, r0 * row_bytes, r1 * row_bytes, dest_bytes[d0 : d0 + (r1 - r0) * row_bytes])
            continue
        rows = torch.empty((r1 - r0, *shard.sizes[1:]), dtype=dtype)
        add(i, r0 * row_bytes, r1 * row_bytes, tensor_bytes(rows))
        src, dst = rows, dest
        for d in range(1, len(sizes)):
            src = src.narrow(d, lo_g[d] - shard.offsets[d], ov_sizes[d])
        for d in range(len(sizes)):
            dst = dst.narrow(d, lo_g[d] - offsets[d], ov_sizes[d])
        after.append(functools.partial(_copy_into, dst, src))
    if covered < dest.numel():
        raise CorruptCheckpointError(
            f"{where}: tensor {fqn!r}: the saved shards cover {covered} of the {dest.numel()} "
            f"elements of the box at {list(offsets)} {list(sizes)}; the checkpoint is "
            "incomplete",
            [fqn],
        )


def read_boxes(
    storage: Storage,
    boxes: Iterable[Box],
    *,
    pool: ThreadPoolExecutor,
    where: str,
    verify_pool: ThreadPoolExecutor | None = None,
    landed: Callable[[int], None] | None = None,
) -> ReadStats:
    """Fill every box's ``dest`` with its data, each chunk verified before it lands.

    Reads run on ``pool`` and, given ``verify_pool`` (another pool), hashing and copying
    there while the next spans are read; without it each read is verified by its reader.
    Call from outside both pools. On failure, work in flight finishes (queued reads are
    dropped) before the first error is raised. ``landed(i)`` is called (from whichever
    thread finished it) as soon as box ``i`` (in ``boxes``' order) holds all its bytes.

    Raises:
        CorruptCheckpointError: the shards do not cover a box, or a chunk is damaged.
    """
    needs: dict[ChunkRef, Need] = {}
    after: Copies = []
    late: set[int] = set()  # boxes assembled by a copy after the reads: landed at the end
    for i, box in enumerate(boxes):
        copies = len(after)
        _plan_box(box, where, needs, after, i)
        if len(after) > copies:
            late.add(i)
    if landed is not None:
        Landing(needs.values(), late, landed)
    stats = ReadStats()
    pipe = Pipeline(storage, verify_pool) if verify_pool is not None else None
    spans = merge_spans(needs.values())
    if pipe is not None:
        futures = pipe.submit(pool, spans)
    else:
        futures = [pool.submit(read_span, storage, *span) for span in spans]
    try:
        for f in futures:
            stats.bytes_read += f.result()
    except BaseException:
        for f in futures:
            f.cancel()
        raise
    finally:
        wait(futures)
        if pipe is not None:
            wait(pipe.verifies)
    if pipe is not None:
        for v in pipe.verifies:
            v.result()
    stats.chunks_verified = len(needs)
    with torch.no_grad():
        for copy in after:
            copy()
    if landed is not None:
        for i in sorted(late):
            landed(i)
    return stats


def read_box(
    storage: Storage,
    entry: TensorEntry,
    fqn: str,
    offsets: tuple[int, ...],
    dest: torch.Tensor,
    *,
    pool: ThreadPoolExecutor,
    where: str,
) -> ReadStats:
    """Fill ``dest`` (a contiguous CPU tensor) with the box at ``offsets`` of tensor ``fqn``.

    Raises:
        CorruptCheckpointError: the shards do not cover the box, or a chunk is damaged.
    """
    return read_boxes(storage, [Box(entry, fqn, offsets, dest)], pool=pool, where=where)


def _numel(sizes: tuple[int, ...] | list[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)
