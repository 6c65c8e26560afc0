"""Direct-I/O streaming writes: exact bytes for every size, on disks and on tmpfs."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from stalwart.storage.direct_io import AlignedBufferPool, write_stream

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
