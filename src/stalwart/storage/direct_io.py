"""Large sequential writes and reads with O_DIRECT through reused, aligned host buffers.

Buffered writes copy every byte into the page cache and then make ``fsync`` push it all out
at once; on the virtual disks our users train on that was 1.5-2.5x slower than direct I/O
of the same bytes, and it evicts the page cache the training job uses. Here bytes are copied
into page-aligned buffers that are allocated once per store and reused (fresh pages cost
several times more than reused ones), and a writer thread issues ``pwrite`` with ``O_DIRECT``
while the caller fills the next buffer.

Reads: :func:`read_range` reads a byte range into a reused page-aligned buffer from a
:class:`ReadBufferPool` (widened to block boundaries when ``O_DIRECT``); the caller verifies
the bytes there and only then copies them where they belong, so a damaged chunk never lands
in a destination tensor. Unlike writes, reads are not direct by default: on our virtio disk
(8 MiB kernel read-ahead) buffered 4 MiB reads from 2-4 threads ran at 1.6x the bandwidth of
``dd iflag=direct bs=64M`` and of O_DIRECT reads of any size and depth we tried (1-64 MiB,
1-16 threads: 0.9-1.05x); see ``bench/ckpt_bench.py``.

Filesystems without O_DIRECT (tmpfs, some FUSE mounts) fall back to plain buffered I/O;
small objects (one buffer or less) are always written buffered.

A direct write allocates its file's blocks ahead of the data (``fallocate``, in steps of up to
``RESERVE_MAX`` bytes) and gives back what it did not use at the end. Blocks allocated write
by write, as O_DIRECT does, interleave between files written at once: the packs of 4 ranks
saving together came out in 28-33 extents per 256 MiB, against 3 for DCP's buffered files
(whose allocation the kernel delays), and reading them back cold took 4-9 % longer
(``bench/scale_ckpt_bench.py``, docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterable

import numpy as np

__all__ = [
    "AlignedBufferPool",
    "ReadBufferPool",
    "map_range",
    "open_read",
    "read_range",
    "write_stream",
]

ALIGN = 4096
RESERVE_MIN = 64 << 20
"""First block reservation of a direct write; each next one is the size written so far."""
RESERVE_MAX = 256 << 20
"""Largest reservation: what a full disk may see held beyond the data, per write in flight."""


class _IdleBuffers:
    """The idle buffers a pool keeps (at most ``keep``), under one lock; ``close`` frees them."""

    def __init__(self, keep: int) -> None:
        self._free: list[mmap.mmap] = []
        self._keep = keep
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for buf in free:
            _close_quietly(buf)


class AlignedBufferPool(_IdleBuffers):
    """Page-aligned buffers of ``buffer_bytes``, allocated when needed and kept for reuse.

    At most ``keep`` idle buffers are kept; ``get`` never blocks (concurrent writers each
    get their own), so the pool bounds what stays allocated, not what is in use.
    """

    def __init__(self, buffer_bytes: int = 8 << 20, keep: int = 4) -> None:
        if buffer_bytes % ALIGN:
            raise ValueError(f"buffer_bytes must be a multiple of {ALIGN}")
        super().__init__(keep)
        self.buffer_bytes = buffer_bytes

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


class ReadBufferPool(_IdleBuffers):
    """Page-aligned read buffers of at least the size asked for, kept for reuse.

    Sizes are rounded up to ``granule_bytes`` so that spans of similar size share buffers;
    ``get`` never blocks (each concurrent reader gets its own) and at most ``keep`` idle
    buffers stay allocated (the largest are kept): with the loader's 32 MiB spans that is
    ~60 MiB per store, kept because fresh pages cost more to fault in than to reuse.
    """

    def __init__(self, keep: int = 12, granule_bytes: int = 1 << 20) -> None:
        if granule_bytes % ALIGN:
            raise ValueError(f"granule_bytes must be a multiple of {ALIGN}")
        super().__init__(keep)
        self._granule = granule_bytes

    def get(self, nbytes: int) -> mmap.mmap:
        with self._lock:
            fits = [b for b in self._free if len(b) >= nbytes]
            if fits:
                buf = min(fits, key=len)
                self._free.remove(buf)
                return buf
        return mmap.mmap(-1, max(1, -(-nbytes // self._granule)) * self._granule)

    def put(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=len, reverse=True)
            extra, self._free = self._free[self._keep :], self._free[: self._keep]
        for b in extra:
            _close_quietly(b)


def open_read(path: str, *, direct: bool = True) -> tuple[int, bool]:
    """Open ``path`` read-only, with ``O_DIRECT`` if asked and the filesystem allows it.

    Returns:
        ``(fd, direct)``; the caller closes ``fd``.
    """
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT), True
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: this filesystem has no direct I/O
                raise
    return os.open(path, flags), False


def read_range(fd: int, direct: bool, offset: int, length: int, buf: mmap.mmap) -> memoryview:
    """Read bytes ``[offset, offset + length)`` of ``fd`` into ``buf``; return a view of them.

    With ``direct`` the read is widened to ``ALIGN`` boundaries (``buf`` must hold
    ``length + 2 * ALIGN`` bytes); a filesystem that refuses the direct read after all is
    read buffered. The view is shorter than ``length`` when the file ends first.
    """
    view = memoryview(buf)
    if direct:
        start = offset - offset % ALIGN
        end = -(-(offset + length) // ALIGN) * ALIGN
        try:
            got = _read_full(fd, view[: end - start], start)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            return read_range(fd, False, offset, length, buf)
        skip = offset - start
        return view[skip : skip + max(0, min(length, got - skip))]
    got = _read_full(fd, view[:length], offset)
    return view[:got]


def map_range(fd: int, offset: int, length: int) -> tuple[memoryview, Callable[[], None]]:
    """Bytes ``[offset, offset + length)`` of ``fd`` mapped read-only, and their release.

    The page cache's own pages, their page tables filled at once (``MAP_POPULATE``, which
    reads what the cache lacks): no copy into a buffer, and far fewer page faults than
    touching the map page by page. 4 gloo ranks each loading 1 GB on 2 cores spent 0.05
    CPU-s in the kernel instead of 0.2 reading into a buffer (the load 0.96 s against 1.2).
    The view is shorter than ``length`` when the file ends first.

    Raises:
        OSError: the file cannot be mapped (a filesystem without ``mmap``): read it instead.
    """
    end = min(offset + length, os.fstat(fd).st_size)
    if end <= offset:
        return memoryview(b""), lambda: None
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    try:
        pages = mmap.mmap(fd, end - start, flags, mmap.PROT_READ, offset=start)
    except ValueError as e:  # the file shrank since fstat
        raise OSError(errno.EINVAL, f"cannot map bytes {offset}-{end}: {e}") from e
    whole = memoryview(pages)
    view = whole[offset - start : end - start]

    def release() -> None:
        view.release()
        whole.release()
        with contextlib.suppress(BufferError):  # a slice still alive (a traceback's frame):
            pages.close()  # unmapped when the last one goes

    return view, release


def _read_full(fd: int, view: memoryview, offset: int) -> int:
    """``preadv`` until ``view`` is full or the file ends; return the bytes read."""
    total = 0
    while total < len(view):
        n = os.preadv(fd, [view[total:]], offset + total)
        if n == 0:
            break
        total += n
    return total


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


def _fallocate() -> Callable[[int, int, int, int], int] | None:
    """Linux's ``fallocate(2)`` (glibc's ``posix_fallocate`` would emulate it by writing)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.fallocate64
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_FALLOCATE = _fallocate()


class _Reservation:
    """The blocks of a file written with O_DIRECT, allocated ahead of its data.

    Each reservation grows the file to its end (``write_stream`` truncates it to the data).
    Where the file is not direct or the filesystem cannot allocate (or the disk is full), it
    stops: the writes then allocate as they land, and a full disk fails them with its own
    error.
    """

    def __init__(self, fd: int) -> None:
        self.fd, self.end = fd, 0
        self.fallocate = _FALLOCATE if hasattr(os, "O_DIRECT") else None  # None: stopped

    def cover(self, end: int) -> None:
        """Make sure the blocks up to byte ``end`` are allocated."""
        first = self.fallocate is not None and self.end == 0
        if first and not fcntl.fcntl(self.fd, fcntl.F_GETFL) & os.O_DIRECT:
            self.fallocate = None  # only direct writes reserve
        while self.fallocate is not None and end > self.end:
            step = min(max(self.end, RESERVE_MIN), RESERVE_MAX)
            if self.fallocate(self.fd, 0, self.end, step) == 0:
                self.end += step
            else:
                self.fallocate = None


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _copy(dest: memoryview, src: memoryview) -> None:
    """``dest[:] = src`` without holding the GIL (a memoryview slice copy holds it).

    The pack stream copies every byte of a save here, on a background thread during an async
    save: holding the GIL for each 8 MiB, it took the training thread's Python away. One
    process, 1 GiB saved in the background while a small model trained, 10 saves each way
    alternated: training ran at 0.52 of its speed alone against 0.39, the save committing in
    the same 0.63 s (docs/benchmarks.md, "eleventh round").
    """
    np.copyto(np.frombuffer(dest, np.uint8), np.frombuffer(src, np.uint8))


def write_stream(fd: int, data: Iterable[memoryview], pool: AlignedBufferPool) -> int:
    """Write consecutive byte views to ``fd`` (opened for writing, empty); return the size.

    The caller still has to ``fsync``: this only decides how the bytes reach the file.
    """
    bs, buf = pool.buffer_bytes, pool.get()
    view = memoryview(buf)
    fill = total = 0
    direct: bool | None = None  # decided when the first buffer is full
    reserve = _Reservation(fd)
    jobs: queue.Queue[tuple[mmap.mmap, int, int] | None] = queue.Queue(maxsize=1)
    failure: list[BaseException] = []
    writer: threading.Thread | None = None

    def drain() -> None:
        while (job := jobs.get()) is not None:
            b, length, offset = job
            try:
                if not failure:
                    reserve.cover(offset + length)
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
                _copy(view[fill : fill + n], src[:n])
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
        os.ftruncate(fd, total)  # drop the last block's padding and the unused reservation
    return total
