"""Direct-I/O streaming writes: exact bytes for every size, on disks and on tmpfs."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from stalwart.storage.direct_io import AlignedBufferPool, map_range, write_stream

BS = 64 * 1024


@pytest.mark.parametrize("size", [0, 1, 4095, BS, BS + 1, 3 * BS + 777])
@pytest.mark.parametrize("piece", [1000, BS, 5 * BS])
def test_exact_bytes_for_every_size(tmp_path: Path, size: int, piece: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        pieces = [memoryview(data)[i : i + piece] for i in range(0, size, piece)]
        assert write_stream(fd, pieces, AlignedBufferPool(BS)) == size
    finally:
        os.close(fd)
    assert path.read_bytes() == data


def test_falls_back_where_o_direct_is_refused(tmpfs: Callable[[str], Path]) -> None:
    root = tmpfs("size=4m")
    data = os.urandom(3 * BS + 5)
    fd = os.open(root / "f", os.O_WRONLY | os.O_CREAT)
    try:
        write_stream(fd, [memoryview(data)], AlignedBufferPool(BS))
    finally:
        os.close(fd)
    assert (root / "f").read_bytes() == data


def test_buffers_are_reused() -> None:
    pool = AlignedBufferPool(BS, keep=2)
    a = pool.get()
    pool.put(a)
    assert pool.get() is a


@pytest.mark.parametrize(("offset", "length"), [(0, 10), (4095, 3), (5000, 9000), (12000, 999)])
def test_mapped_ranges_are_the_files_bytes_and_stop_at_its_end(
    tmp_path: Path, offset: int, length: int
) -> None:
    data = np.random.default_rng(0).integers(0, 256, 12345, dtype=np.uint8).tobytes()
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        view, release = map_range(fd, offset, length)
        assert view.readonly and bytes(view) == data[offset : offset + length]
        release()
        empty, release = map_range(fd, len(data), 10)  # at the end: nothing, nothing mapped
        assert len(empty) == 0
        release()
    finally:
        os.close(fd)


def test_what_cannot_be_mapped_is_an_oserror_so_the_store_reads_it_instead(
    tmp_path: Path,
) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory: the kernel refuses to map it
    try:
        if os.fstat(fd).st_size == 0:  # a filesystem whose folders have no size
            pytest.skip("this filesystem gives folders no size; nothing would be mapped")
        with pytest.raises(OSError):
            map_range(fd, 0, 10)
    finally:
        os.close(fd)


@pytest.mark.parametrize("mapped", [True, False])
def test_loads_are_exact_and_damage_is_caught_mapped_or_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mapped: bool
) -> None:
    """``LocalStorage.MAP_READS`` changes how the bytes are reached, never what lands."""
    import torch

    from stalwart.checkpoint import Checkpointer, CheckpointOptions
    from stalwart.errors import CorruptCheckpointError
    from stalwart.storage import local

    monkeypatch.setattr(local, "MAP_READS", mapped)
    state = {"w": torch.randn(300, 70), "b": torch.arange(9.0)}
    with Checkpointer(tmp_path, options=CheckpointOptions(chunk_bytes=8192)) as ck:
        ck.save(1, state)
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        ck.load(back)
        assert all(torch.equal(back[k], state[k]) for k in state)
        chunks = ck.manifest(1).tensors["w"].shards[0].chunks
    chunk, first = chunks[2], (chunks[0].nbytes + chunks[1].nbytes) // 4
    pack = tmp_path / chunk.pack
    data = bytearray(pack.read_bytes())
    data[chunk.offset + 3] ^= 0x01
    pack.write_bytes(bytes(data))
    with Checkpointer(tmp_path) as ck:
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        with pytest.raises(CorruptCheckpointError, match="does not match its hash"):
            ck.load(target)
    # the damaged chunk's elements never landed: they are still the zeros they were
    flat = target["w"].reshape(-1)
    assert not flat[first : first + chunk.nbytes // 4].any()


def test_reads_held_open_share_one_descriptor_and_outlive_the_objects_deletion(
    tmp_path: Path,
) -> None:
    """``hold_open`` (``ReadsInOrder``): one descriptor for every read inside it, counted
    when nested, closed after the last; a missing object is refused when the hold starts."""
    from stalwart.errors import ObjectNotFoundError
    from stalwart.storage.base import ReadsInOrder
    from stalwart.storage.local import LocalStorage

    data = np.random.default_rng(2).integers(0, 256, 3 * 4096 + 11, dtype=np.uint8).tobytes()
    store = LocalStorage(tmp_path)
    assert isinstance(store, ReadsInOrder)
    store.write("packs/p", [data])
    opened = len(os.listdir("/proc/self/fd"))
    with store.hold_open("packs/p"):
        with store.hold_open("packs/p"):  # nested: the same descriptor
            assert len(os.listdir("/proc/self/fd")) == opened + 1
        store.delete("packs/p")  # held: still read, whole (never rewritten in place)
        for offset, length in ((0, 100), (4000, 5000), (len(data) - 5, 50)):
            with store.read_view("packs/p", offset, length) as view:
                assert bytes(view) == data[offset : offset + length]
        assert len(os.listdir("/proc/self/fd")) == opened + 1  # no descriptor per read
    assert len(os.listdir("/proc/self/fd")) == opened  # closed with the last holder
    with pytest.raises(ObjectNotFoundError), store.hold_open("packs/p"):
        pass
    with pytest.raises(ObjectNotFoundError):  # and nothing held stays behind
        store.read("packs/p")


def test_a_direct_write_reserves_its_blocks_ahead_and_keeps_none_past_its_end(
    tmp_path: Path,
) -> None:
    """Blocks are allocated ahead of the data (so files written at once do not interleave
    their extents), and what was not used is given back: the file ends at its last byte."""
    from stalwart.storage.direct_io import RESERVE_MIN

    size = 5 * BS + 123
    data = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    seen: list[tuple[bool, int]] = []

    def pieces() -> Iterator[memoryview]:
        for i in range(0, size, BS):
            direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))
            seen.append((direct, os.fstat(fd).st_size))
            yield memoryview(data)[i : i + BS]

    try:
        assert write_stream(fd, pieces(), AlignedBufferPool(BS)) == size
        st = os.fstat(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == data
    assert st.st_size == size and st.st_blocks * 512 <= size + BS, "the reservation's rest"
    if seen[-1][0]:  # O_DIRECT on this filesystem: the reservation ran ahead of the data
        assert seen[-1][1] >= RESERVE_MIN, seen
