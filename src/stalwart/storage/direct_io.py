"""Large sequential writes with O_DIRECT through reused, aligned host buffers.

Buffered writes copy every byte into the page cache and then make ``fsync`` push it all out
at once; on the virtual disks our users train on that was 1.5-2.5x slower than direct I/O
of the same bytes, and it evicts the page cache the training job uses. Here bytes are copied
into page-aligned buffers that are allocated once per store and reused (fresh pages cost
several times more than reused ones), and a writer thread issues ``pwrite`` with ``O_DIRECT``
while the caller fills the next buffer.

Filesystems without O_DIRECT (tmpfs, some FUSE mounts) fall back to plain buffered writes;
small objects (one buffer or less) are always written buffered.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import queue
import threading
from collections.abc import Iterable

__all__ = ["AlignedBufferPool", "write_stream"]

ALIGN = 4096


class AlignedBufferPool:
    """Page-aligned buffers of ``buffer_bytes``, allocated when needed and kept for reuse.

    At most ``keep`` idle buffers are kept; ``get`` never blocks (concurrent writers each
    get their own), so the pool bounds what stays allocated, not what is in use.
    """

    def __init__(self, buffer_bytes: int = 8 << 20, keep: int = 4) -> None:
        if buffer_bytes % ALIGN:
            raise ValueError(f"buffer_bytes must be a multiple of {ALIGN}")
        self.buffer_bytes = buffer_bytes
        self._free: list[mmap.mmap] = []
        self._keep = keep
        self._lock = threading.Lock()

    def get(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        return mmap.mmap(-1, self.buffer_bytes)

    def put(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)
                return
        _close_quietly(buf)

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for buf in free:
            _close_quietly(buf)


def _close_quietly(buf: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view is still alive; the GC frees it later
        buf.close()


def _enable_direct(fd: int) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError:
        return False
    return True


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_stream(fd: int, data: Iterable[memoryview], pool: AlignedBufferPool) -> int:
    """Write consecutive byte views to ``fd`` (opened for writing, empty); return the size.

    The caller still has to ``fsync``: this only decides how the bytes reach the file.
    """
    bs = pool.buffer_bytes
    buf = pool.get()
    view = memoryview(buf)
    fill = 0
    total = 0
    direct: bool | None = None  # decided when the first buffer is full
    jobs: queue.Queue[tuple[mmap.mmap, int, int] | None] = queue.Queue(maxsize=1)
    failure: list[BaseException] = []
    writer: threading.Thread | None = None

    def drain() -> None:
        while (job := jobs.get()) is not None:
            b, length, offset = job
            try:
                if not failure:
                    _write_all(fd, memoryview(b)[:length], offset)
            except BaseException as e:  # handed to the caller below
                failure.append(e)
            finally:
                pool.put(b)

    try:
        for piece in data:
            src = piece if piece.format == "B" and piece.ndim == 1 else piece.cast("B")
            while src:
                n = min(len(src), bs - fill)
                view[fill : fill + n] = src[:n]
                fill += n
                src = src[n:]
                if fill < bs:
                    continue
                if direct is None:
                    direct = _enable_direct(fd)
                    writer = threading.Thread(target=drain, name="stalwart-write", daemon=True)
                    writer.start()
                jobs.put((buf, bs, total))
                if failure:
                    raise failure[0]
                total += bs
                buf = pool.get()
                view = memoryview(buf)
                fill = 0
        if writer is not None:
            tail = -(-fill // ALIGN) * ALIGN if direct else fill
            view[fill:tail] = bytes(tail - fill)
            jobs.put((buf, tail, total))
            buf = None  # type: ignore[assignment]
        else:
            _write_all(fd, view[:fill], 0)
    finally:
        if writer is not None:
            jobs.put(None)
            writer.join()
        if buf is not None:
            view.release()
            pool.put(buf)
    if failure:
        raise failure[0]
    total += fill
    if direct:
        os.ftruncate(fd, total)  # drop the alignment padding of the last block
    return total
