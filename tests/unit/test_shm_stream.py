"""Pieces passed through /dev/shm segments: copied as they turn ready, never waited on forever.

Each segment is made by a real other process (``python -c``), as a reading rank makes it,
which then marks pieces ready, aborts, or exits without a word; this process copies out.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from stalwart.checkpoint.durable import shm_stream
from stalwart.checkpoint.durable.shm_stream import Segment, copy_out

SIZES = [4 * 100, 4 * 7, 4 * 4096]  # three float32 pieces, one of them past a page

_READER = """
import os, sys, torch
from stalwart.checkpoint.durable.shm_stream import Segment
path, how = sys.argv[1], sys.argv[2]
seg = Segment.create(path, [400, 28, 16384])
for i, n in enumerate((100, 7, 4096)):
    if how == "ready" or (how in ("abort", "die") and i == 0):
        seg.put(i, torch.arange(n, dtype=torch.float32) + 1000 * i)
if how == "abort":
    seg.abort()
os._exit(0)  # as a rank that dies: the file stays, nothing more is marked
"""


@pytest.fixture
def path() -> Iterator[str]:
    p = Path("/dev/shm") / f"stalwart-test-{uuid.uuid4().hex}"
    yield str(p)
    p.unlink(missing_ok=True)


def _reader(path: str, how: str) -> None:
    subprocess.run([sys.executable, "-c", _READER, path, how], check=True, timeout=60)


def _wanted() -> list[tuple[int, int, torch.Tensor]]:
    return [(0, i, torch.zeros(n // 4)) for i, n in enumerate(SIZES)]


def test_ready_pieces_are_copied_exactly(path: str) -> None:
    _reader(path, "ready")
    seg = Segment.open(path, SIZES)
    wanted = _wanted()
    assert copy_out({0: seg}, wanted, threading.Event()) is None
    for _, i, dest in wanted:
        assert torch.equal(dest, torch.arange(dest.numel(), dtype=torch.float32) + 1000 * i)
    seg.close()


def test_an_aborted_reader_stops_the_wait_and_keeps_what_was_ready(path: str) -> None:
    _reader(path, "abort")
    seg = Segment.open(path, SIZES)
    wanted = _wanted()
    assert copy_out({0: seg}, wanted, threading.Event()) == (
        False,
        "rank 0 failed while reading its pieces",
    )
    assert torch.equal(wanted[0][2], torch.arange(100, dtype=torch.float32))  # ready: copied
    assert not wanted[1][2].any()  # never marked ready: never copied
    seg.close()


def test_a_reader_that_died_is_found_by_its_pid(path: str) -> None:
    _reader(path, "die")
    seg = Segment.open(path, SIZES)
    outcome = copy_out({0: seg}, _wanted(), threading.Event())
    assert outcome is not None and not outcome[0] and "died while reading" in outcome[1]
    seg.close()


def test_a_reader_that_stalls_is_given_up_on(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader is this (live) process, which never marks a piece: the stall bound ends it."""
    monkeypatch.setattr(shm_stream, "STALL_S", 0.2)
    seg = Segment.create(path, SIZES)
    outcome = copy_out({0: seg}, _wanted(), threading.Event())
    assert outcome is not None and not outcome[0] and "marked no piece ready" in outcome[1]
    seg.close(unlink=True)
    assert not Path(path).exists()


def test_own_failure_stops_the_copies(path: str) -> None:
    seg = Segment.create(path, SIZES)
    stop = threading.Event()
    stop.set()
    assert copy_out({0: seg}, _wanted(), stop) == (True, "this rank's own read failed")
    seg.close(unlink=True)


def test_a_full_shm_is_an_error_when_made_not_a_crash_later(path: str) -> None:
    """The pages are reserved when the segment is made: asking for more than /dev/shm holds
    fails there (ENOSPC, before any page is taken), and no file is left."""
    fs = os.statvfs("/dev/shm")
    too_big = fs.f_blocks * fs.f_frsize + (1 << 30)
    with pytest.raises(OSError):
        Segment.create(path, [too_big])
    assert not Path(path).exists()


def test_segments_of_dead_readers_are_swept_and_live_ones_kept(path: str) -> None:
    """A reader killed mid-load leaves its file in /dev/shm (memory): the next load removes it."""
    _reader(path, "die")  # made by a process that has exited
    live = path + "-live"
    seg = Segment.create(live, SIZES)  # made by this (live) process
    try:
        gone = shm_stream.sweep("/dev/shm", Path(path).name)
        assert gone == [path]
        assert not Path(path).exists() and Path(live).exists()
    finally:
        seg.close(unlink=True)
