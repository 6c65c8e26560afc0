"""Load a tensor's box from whatever shards a checkpoint holds, verifying every chunk.

The loading rank wants a box of the global tensor (the whole tensor for a plain tensor, the
local shard for a DTensor). For each saved shard that overlaps it, only the leading-dimension
rows that overlap are read, chunk by chunk; every chunk read is hashed and compared with its
name before its bytes are used. When the overlap spans whole rows of both the saved shard and
the wanted box (same sharding, or ``Shard(0)`` to ``Shard(0)`` at another world size),
chunks are read straight into the destination tensor's memory; otherwise rows go through a
temporary buffer and the overlapping sub-box is copied out.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from stalwart.checkpoint.durable.manifest import ChunkRef, ShardEntry, TensorEntry
from stalwart.checkpoint.durable.persist import chunk_hash
from stalwart.errors import CorruptCheckpointError, ObjectNotFoundError
from stalwart.storage.base import Storage
from stalwart.tree import dtype_from_name

__all__ = ["ReadStats", "read_box", "verify_chunk"]


@dataclass
class ReadStats:
    """Bytes read from storage (stored bytes) and chunks verified."""

    bytes_read: int = 0
    chunks_verified: int = 0


def _describe(where: str, fqn: str, shard: ShardEntry, c: ChunkRef) -> str:
    return (
        f"{where}: tensor {fqn!r}, shard at offsets {list(shard.offsets)} sizes "
        f"{list(shard.sizes)}, chunk {c.hash[:16]}… in {c.pack} at byte {c.offset}"
    )


def _fetch(storage: Storage, c: ChunkRef, out: memoryview | None, what: str) -> memoryview:
    """Read chunk ``c``'s stored bytes (into ``out`` when given and uncompressed)."""
    direct = out is not None and c.codec == "none"
    buf = out if direct else memoryview(bytearray(c.length))
    assert buf is not None
    try:
        n = storage.read_into(c.pack, c.offset, buf[: c.length]) if c.length else 0
    except ObjectNotFoundError as e:
        raise CorruptCheckpointError(
            f"{what}: pack file is missing; the checkpoint is incomplete — load an earlier "
            "step or use fallback=True",
            damaged=[what],
        ) from e
    if n != c.length:
        raise CorruptCheckpointError(
            f"{what}: truncated (read {n} of {c.length} bytes); load an earlier step or use "
            "fallback=True",
            damaged=[what],
        )
    if c.codec == "zstd":
        import zstandard

        try:
            raw = zstandard.ZstdDecompressor().decompress(bytes(buf), max_output_size=c.nbytes)
        except zstandard.ZstdError as e:
            raise CorruptCheckpointError(f"{what}: cannot decompress ({e})", [what]) from e
        if out is not None and len(raw) == len(out):
            out[:] = raw
            return out
        buf = memoryview(raw)
    return buf


def verify_chunk(storage: Storage, c: ChunkRef, what: str, out: memoryview | None = None) -> int:
    """Read chunk ``c``, check its hash and length; return the stored bytes read.

    Raises:
        CorruptCheckpointError: missing pack, truncated data, or a hash mismatch.
    """
    raw = _fetch(storage, c, out, what)
    if len(raw) != c.nbytes or chunk_hash(raw) != c.hash:
        raise CorruptCheckpointError(
            f"{what}: content does not match its hash (bit rot or tampering); "
            "load an earlier step or use fallback=True",
            damaged=[what],
        )
    return c.length


def _copy_range(
    storage: Storage,
    shard: ShardEntry,
    lo: int,
    hi: int,
    dest: memoryview,
    pool: ThreadPoolExecutor,
    what: tuple[str, str],
    stats: ReadStats,
) -> None:
    """Fill ``dest`` with bytes ``[lo, hi)`` of ``shard``'s raw byte stream, verified."""
    tasks = []
    start = 0
    for c in shard.chunks:
        cs, ce = start, start + c.nbytes
        start = ce
        if ce <= lo or cs >= hi:
            continue
        desc = _describe(what[0], what[1], shard, c)
        if cs >= lo and ce <= hi:
            tasks.append(pool.submit(verify_chunk, storage, c, desc, dest[cs - lo : ce - lo]))
        else:

            def partial(c: ChunkRef = c, cs: int = cs, desc: str = desc) -> int:
                tmp = memoryview(bytearray(c.nbytes))
                n = verify_chunk(storage, c, desc, tmp)
                a, b = max(lo, cs), min(hi, cs + c.nbytes)
                dest[a - lo : b - lo] = tmp[a - cs : b - cs]
                return n

            tasks.append(pool.submit(partial))
    for t in tasks:
        stats.bytes_read += t.result()
        stats.chunks_verified += 1


def _as_bytes(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview(t.reshape(-1).view(torch.uint8).numpy().data).cast("B")


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
    stats = ReadStats()
    sizes = tuple(dest.shape)
    dtype = dtype_from_name(entry.dtype)
    if dest.dtype != dtype or not dest.is_contiguous() or dest.device.type != "cpu":
        raise AssertionError("read_box needs a contiguous CPU tensor of the entry's dtype")
    esize = dest.element_size()
    dest_bytes = _as_bytes(dest)
    covered = 0
    if not sizes:  # 0-dim tensor: one shard, one element
        for shard in entry.shards:
            _copy_range(storage, shard, 0, esize, dest_bytes, pool, (where, fqn), stats)
            return stats
        raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has no shard", [fqn])
    for shard in entry.shards:
        lo_g = [max(o, so) for o, so in zip(offsets, shard.offsets, strict=True)]
        hi_g = [
            min(o + s, so + ss)
            for o, s, so, ss in zip(offsets, sizes, shard.offsets, shard.sizes, strict=True)
        ]
        if any(a >= b for a, b in zip(lo_g, hi_g, strict=True)):
            continue
        ov_sizes = [b - a for a, b in zip(lo_g, hi_g, strict=True)]
        covered += _numel(ov_sizes)
        row_elems = _numel(shard.sizes[1:])
        r0, r1 = lo_g[0] - shard.offsets[0], hi_g[0] - shard.offsets[0]
        lo, hi = r0 * row_elems * esize, r1 * row_elems * esize
        if list(shard.sizes[1:]) == ov_sizes[1:] == list(sizes[1:]):
            # Whole rows on both sides: a straight byte range of the destination.
            d0 = (lo_g[0] - offsets[0]) * row_elems * esize
            _copy_range(
                storage, shard, lo, hi, dest_bytes[d0 : d0 + hi - lo], pool, (where, fqn), stats
            )
            continue
        rows = torch.empty((r1 - r0, *shard.sizes[1:]), dtype=dtype)
        _copy_range(storage, shard, lo, hi, _as_bytes(rows), pool, (where, fqn), stats)
        src = rows
        dst = dest
        for d in range(1, len(sizes)):
            src = src.narrow(d, lo_g[d] - shard.offsets[d], ov_sizes[d])
        for d in range(len(sizes)):
            dst = dst.narrow(d, lo_g[d] - offsets[d], ov_sizes[d])
        dst.copy_(src)
    if covered < dest.numel():
        raise CorruptCheckpointError(
            f"{where}: tensor {fqn!r}: the saved shards cover {covered} of the {dest.numel()} "
            f"elements of the box at {list(offsets)} {list(sizes)}; the checkpoint is "
            "incomplete",
            [fqn],
        )
    return stats


def _numel(sizes: tuple[int, ...] | list[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n
