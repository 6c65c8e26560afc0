"""Planned, read-ahead loads: O_DIRECT span reads, verify-then-copy, only overlapping chunks."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

import stalwart
from stalwart.checkpoint.durable.reshard import SPAN_BYTES, Box, read_box, read_boxes
from stalwart.errors import CorruptCheckpointError
from stalwart.storage.direct_io import ALIGN, ReadBufferPool, open_read, read_range
from stalwart.storage.local import LocalStorage

CHUNK = 4 * ALIGN  # 16 KiB chunks: many chunks per span
SENTINEL = -7.25


class CountingStorage(LocalStorage):
    """A local store that records each span it reads (real O_DIRECT reads underneath)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(root)
        self.spans: list[tuple[str, int, int]] = []

    @contextmanager
    def read_view(self, key: str, offset: int, length: int) -> Iterator[memoryview]:
        self.spans.append((key, offset, length))
        with super().read_view(key, offset, length) as view:
            yield view


def _save(tmp_path: Path, state: dict[str, torch.Tensor]) -> stalwart.Checkpointer:
    opts = stalwart.CheckpointOptions(chunk_bytes=CHUNK, io_threads=3)
    ckpt = stalwart.Checkpointer(tmp_path / "ck", options=opts)
    ckpt.save(1, state)
    return ckpt


def _flip_byte(ckpt: stalwart.Checkpointer, name: str, chunk_index: int) -> None:
    c = ckpt.manifest(1).tensors[name].shards[0].chunks[chunk_index]
    path = Path(ckpt.storage.root, *c.pack.split("/"))  # type: ignore[attr-defined]
    with open(path, "r+b") as f:
        f.seek(c.offset + c.length // 2)
        b = f.read(1)
        f.seek(c.offset + c.length // 2)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("bad_chunk", [0, 5, 11])
def test_corrupt_chunk_in_a_span_is_caught_and_never_lands(tmp_path: Path, bad_chunk: int) -> None:
    gen = torch.Generator().manual_seed(bad_chunk)
    state = {
        "a": torch.randn(12 * CHUNK // 4, generator=gen),  # 12 chunks, one span
        "b": torch.randn(3 * CHUNK // 4 + 5, generator=gen),
    }
    ckpt = _save(tmp_path, state)
    _flip_byte(ckpt, "a", bad_chunk)
    dest = {k: torch.full_like(v, SENTINEL) for k, v in state.items()}
    with pytest.raises(CorruptCheckpointError, match="does not match its hash") as err:
        ckpt.load(dest, step=1)
    assert "'a'" in str(err.value)
    # Bytes, not timings: every chunk-sized region of the target holds either the sentinel
    # (not read) or exactly the saved bytes; the damaged chunk's region holds the sentinel.
    got = dest["a"].view(-1, CHUNK // 4)
    want = state["a"].view(-1, CHUNK // 4)
    for i in range(got.shape[0]):
        untouched = bool((got[i] == SENTINEL).all())
        assert untouched or torch.equal(got[i], want[i]), f"chunk {i} holds other bytes"
    assert bool((got[bad_chunk] == SENTINEL).all())
    assert bool((dest["b"] == SENTINEL).all()) or torch.equal(dest["b"], state["b"])
    ckpt.close()


@pytest.mark.parametrize("pipelined", [False, True])
def test_corrupt_chunk_of_a_partial_box_leaves_the_target_untouched(
    tmp_path: Path, pipelined: bool
) -> None:
    # Columns 3..9 of every row: rows go through a temporary, copied out only when all verify.
    t = torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024)
    ckpt = _save(tmp_path, {"t": t})
    _flip_byte(ckpt, "t", 9)
    dest = torch.full((64, 7), SENTINEL)
    whole = torch.full((64, 1024), SENTINEL)  # whole rows: read in place, chunk by chunk
    entry = ckpt.manifest(1).tensors["t"]
    boxes = [Box(entry, "t", (0, 3), dest), Box(entry, "t", (0, 0), whole)]
    with ThreadPoolExecutor(3) as pool, ThreadPoolExecutor(2) as verify:
        with pytest.raises(CorruptCheckpointError, match="does not match its hash"):
            read_boxes(
                ckpt.storage, boxes, pool=pool, where="t", verify_pool=verify if pipelined else None
            )
        after = whole.clone()
    assert bool((dest == SENTINEL).all())
    rows = whole.view(-1, CHUNK // 4)
    assert bool((rows[9] == SENTINEL).all())  # the damaged chunk never landed
    for i in range(rows.shape[0]):
        assert bool((rows[i] == SENTINEL).all()) or torch.equal(rows[i], t.view(-1, CHUNK // 4)[i])
    assert torch.equal(whole, after)  # nothing was written after the error was raised
    ckpt.close()


def test_only_overlapping_chunks_are_read_in_merged_spans(tmp_path: Path) -> None:
    rows, cols = 256, 1024  # 4 KiB rows, 4 rows per chunk, 64 chunks
    t = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1))
    ckpt = _save(tmp_path, {"t": t})
    store = CountingStorage(ckpt.storage.root)  # type: ignore[attr-defined]
    entry = ckpt.manifest(1).tensors["t"]
    dest = torch.empty(50, cols)
    with ThreadPoolExecutor(3) as pool:
        stats = read_box(store, entry, "t", (101, 0), dest, pool=pool, where="test")
    assert torch.equal(dest, t[101:151])
    chunks = entry.shards[0].chunks
    wanted = chunks[101 // 4 : 150 // 4 + 1]  # chunks 25..37 hold rows 101..150
    assert stats.bytes_read == sum(c.length for c in wanted)
    assert stats.chunks_verified == len(wanted)
    assert store.spans == [(wanted[0].pack, wanted[0].offset, stats.bytes_read)]
    assert stats.bytes_read <= SPAN_BYTES
    store.close()
    ckpt.close()


def test_a_chunk_shared_by_tensors_is_read_once(tmp_path: Path) -> None:
    same = torch.randn(3 * CHUNK // 4, generator=torch.Generator().manual_seed(2))
    state = {"x": same.clone(), "y": same.clone(), "z": torch.zeros(10)}
    ckpt = _save(tmp_path, state)
    dest = {k: torch.full_like(v, SENTINEL) for k, v in state.items()}
    ckpt.load(dest, step=1)
    for k, v in state.items():
        assert torch.equal(dest[k], v), k
    assert ckpt.last_load is not None
    assert ckpt.last_load.bytes_read == 3 * CHUNK + 10 * 4
    ckpt.close()


def test_loads_through_a_store_without_read_view(tmp_path: Path) -> None:
    # MemoryStorage-like path: read_into a temporary, verify, copy.
    from stalwart.storage.memory import MemoryStorage

    store = MemoryStorage()
    t = torch.randn(10 * CHUNK // 4 + 3, generator=torch.Generator().manual_seed(3))
    ckpt = _save(tmp_path, {"t": t})
    for info in ckpt.storage.list():
        store.write(info.key, [ckpt.storage.read(info.key)])
    dest = torch.empty_like(t)
    with ThreadPoolExecutor(2) as pool:
        read_box(store, ckpt.manifest(1).tensors["t"], "t", (0,), dest, pool=pool, where="m")
    assert torch.equal(dest, t)
    ckpt.close()


@pytest.mark.parametrize(
    ("offset", "length"), [(0, 0), (0, 1), (1, ALIGN), (ALIGN - 1, 3 * ALIGN + 2), (5000, 9000)]
)
def test_read_range_exact_bytes_and_short_at_end(tmp_path: Path, offset: int, length: int) -> None:
    data = np.random.default_rng(offset + length).integers(0, 256, 20000, np.uint8).tobytes()
    path = tmp_path / "f"
    path.write_bytes(data)
    pool = ReadBufferPool(granule_bytes=ALIGN)
    buf = pool.get(length + 2 * ALIGN)
    fd, _direct = open_read(str(path))
    try:
        assert bytes(read_range(fd, _direct, offset, length, buf)) == data[offset : offset + length]
        end = read_range(fd, _direct, 19990, 100, buf)  # past the end: short
        assert bytes(end) == data[19990:]
    finally:
        os.close(fd)
        pool.put(buf)
        pool.close()


def test_read_range_where_o_direct_is_refused(tmpfs: Callable[[str], Path]) -> None:
    root = tmpfs("size=4m")
    data = os.urandom(3 * ALIGN + 5)
    (root / "f").write_bytes(data)
    store = LocalStorage(root)
    with store.read_view("f", 7, 2 * ALIGN) as view:
        assert bytes(view) == data[7 : 7 + 2 * ALIGN]
        assert view.readonly
    store.close()


def test_read_buffers_are_reused_and_bounded() -> None:
    pool = ReadBufferPool(keep=2, granule_bytes=ALIGN)
    a = pool.get(100)
    assert len(a) == ALIGN
    pool.put(a)
    assert pool.get(ALIGN) is a  # fits: reused
    b, c, d = pool.get(ALIGN), pool.get(2 * ALIGN), pool.get(3 * ALIGN)
    for x in (a, b, c, d):
        pool.put(x)
    assert sorted(len(x) for x in pool._free) == [2 * ALIGN, 3 * ALIGN]
    pool.close()
