"""Verified pieces passed between the ranks of one host through ``/dev/shm``, as each lands.

A rank that reads pieces for its host (``shared_read.py``) creates one file there, its
*segment*: a header (the reader's pid, a state byte, one byte per piece) and then the pieces'
bytes at aligned offsets. Its pages are reserved when it is made (``posix_fallocate``), so a
full ``/dev/shm`` is an ``OSError`` at creation, never a failure in the middle of a load.
The reader lands each piece's verified chunks in its own tensor, as for a load alone; when a
piece's last chunk has landed, it writes the piece into its segment and then turns its header
byte ready (``put``). Every other rank copies each piece into its tensor as soon as the byte
says so (``copy_out``): each byte of the host is read and hashed once, and copied out while
the disk is still reading, with no barrier between the reads and the copies.

The reader writes with ``pwrite`` (no page faults in its own process) and turns a byte
ready only after the piece's bytes; the others read the header with ``pread`` (a syscall
orders it before the copy that follows) and the pieces from a read-only map whose page
tables are filled when it is opened (``MAP_POPULATE``). Moving a piece between processes
still costs the kernel about as much as the hashing it saves on a local disk (measured in
docs/benchmarks.md, "fourth round"), which is why ranks on a local disk read alone.

A reader whose read fails marks its segment aborted, and the others stop waiting for it; a
reader that died is found by its pid, one that makes no progress for ``STALL_S`` by the
clock. The caller's outcome exchange then says who failed and why.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import time

import numpy as np
import torch

from stalwart.checkpoint.durable.persist import tensor_bytes

__all__ = ["POLL_S", "STALL_S", "Segment", "copy_out", "sweep"]

POLL_S = 0.0005
"""Seconds a rank sleeps when no piece it waits for has turned ready."""

STALL_S = 1800.0
"""A reader that marks no piece ready for this long is given up on (gloo's own default)."""

ALIGN = 64  # each piece starts on a cache line (and on any dtype's alignment)
PAGE = 4096
_STATE = 8  # header byte: 0 reading, 2 aborted
_FLAGS = 16  # header bytes from here: one per piece, 1 when it is ready
_READY, _ABORTED = 1, 2
_CHECK_PID_S = 0.5


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    """Each piece's offset in a segment holding ``sizes``, and the segment's length."""
    pos = -(-(_FLAGS + len(sizes)) // PAGE) * PAGE
    offsets = []
    for n in sizes:
        offsets.append(pos)
        pos += -(-n // ALIGN) * ALIGN
    return offsets, max(pos, PAGE)


class Segment:
    """One reader's pieces in a file of ``/dev/shm``, opened by every rank of the host."""

    def __init__(self, path: str, sizes: list[int], fd: int, view: mmap.mmap | None = None):
        self.path = path
        self.sizes = sizes
        self.offsets, self.length = _layout(sizes)
        self._fd = fd
        self._map = view

    @classmethod
    def create(cls, path: str, sizes: list[int]) -> Segment:
        """Make the segment for this rank's ``sizes`` (bytes per piece), pages reserved.

        Raises:
            OSError: ``/dev/shm`` has no room (``ENOSPC``) or the file exists.
        """
        _, length = _layout(sizes)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, length)
            os.pwrite(fd, os.getpid().to_bytes(8, "little"), 0)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        return cls(path, sizes, fd)

    @classmethod
    def open(cls, path: str, sizes: list[int]) -> Segment:
        """Open another rank's segment, to read: mapped read-only with its page tables filled
        at once (``MAP_POPULATE``: the pages exist since ``create``), so copies take no faults."""
        fd = os.open(path, os.O_RDONLY)
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            length = _layout(sizes)[1]
            return cls(path, sizes, fd, mmap.mmap(fd, length, flags, mmap.PROT_READ))
        except BaseException:
            os.close(fd)
            raise

    def put(self, i: int, src: torch.Tensor) -> None:
        """Write piece ``i`` (its verified bytes, in ``src``), then mark it ready."""
        view, pos = tensor_bytes(src), self.offsets[i]
        while view:
            n = os.pwrite(self._fd, view, pos)
            view, pos = view[n:], pos + n
        os.pwrite(self._fd, bytes([_READY]), _FLAGS + i)

    def abort(self) -> None:
        """This reader failed: the pieces not yet ready never will be."""
        os.pwrite(self._fd, bytes([_ABORTED]), _STATE)

    def header(self) -> tuple[int, int, bytes]:
        """The reader's pid, the state byte and the pieces' bytes."""
        raw = os.pread(self._fd, _FLAGS + len(self.sizes), 0)
        return int.from_bytes(raw[:8], "little"), raw[_STATE], raw[_FLAGS:]

    def copy_to(self, i: int, dest: torch.Tensor) -> None:
        """Copy ready piece ``i`` into ``dest`` (numpy copies without the GIL)."""
        if self._map is None:
            raise OSError(f"{self.path} was made here, not opened to read")
        src = np.frombuffer(self._map, np.uint8, count=self.sizes[i], offset=self.offsets[i])
        np.copyto(np.frombuffer(tensor_bytes(dest), np.uint8), src)

    def close(self, unlink: bool = False) -> None:
        """Close; ``unlink``: remove the file too (its reader does, once every rank is done
        with it)."""
        if unlink:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still alive (a traceback's frame)
                self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True


def sweep(folder: str, prefix: str) -> list[str]:
    """Remove segments in ``folder`` named ``prefix*`` whose reader is dead; return them.

    A load killed before it removed its files leaves them in ``/dev/shm``, which is memory;
    the next load on the host clears them. A segment whose reader lives (or whose header is
    not written yet: pid 0) is kept.
    """
    gone = []
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            if not name.startswith(prefix):
                continue
            path = os.path.join(folder, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    pid = int.from_bytes(os.pread(fd, 8, 0), "little")
                finally:
                    os.close(fd)
                if pid and not _alive(pid):
                    os.unlink(path)
                    gone.append(path)
            except OSError:
                continue  # removed meanwhile, or not ours to read
    return gone


def copy_out(
    segments: dict[int, Segment],
    wanted: list[tuple[int, int, torch.Tensor]],
    stop: threading.Event,
) -> tuple[bool, str] | None:
    """Copy each ``(rank, piece, dest)`` out of ``segments[rank]`` as soon as it is ready.

    Returns None when every piece is in place; else ``(own, why)``: ``own`` when this rank's
    side failed (``stop`` set by its reader, or a copy that raised), False when a reader
    aborted, died or stalled.
    """
    left: dict[int, dict[int, torch.Tensor]] = {}
    for r, i, dest in wanted:
        left.setdefault(r, {})[i] = dest
    moved = checked = time.monotonic()
    while left:
        progressed = False
        for r in list(left):
            seg, todo = segments[r], left[r]
            try:
                pid, state, flags = seg.header()
                for i in [i for i in todo if flags[i] == _READY]:
                    seg.copy_to(i, todo.pop(i))
                    progressed = True
            except (OSError, ValueError, BufferError) as e:
                return True, f"copying rank {r}'s pieces from {seg.path} failed: {e}"
            if not todo:
                del left[r]
            elif state == _ABORTED:
                return False, f"rank {r} failed while reading its pieces"
            elif time.monotonic() - checked > _CHECK_PID_S and not _alive(pid):
                return False, f"rank {r} (pid {pid}) died while reading its pieces"
        now = time.monotonic()
        if now - checked > _CHECK_PID_S:
            checked = now
        if stop.is_set():
            return True, "this rank's own read failed"
        if progressed:
            moved = now
        elif left:
            if now - moved > STALL_S:
                return False, f"rank(s) {sorted(left)} marked no piece ready in {STALL_S:g} s"
            time.sleep(POLL_S)
    return None
