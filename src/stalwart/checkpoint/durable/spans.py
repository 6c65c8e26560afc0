"""Reading spans of pack files, each chunk verified before its bytes land.

Chunks adjacent in a pack are merged into spans of up to ``SPAN_BYTES``, read in pack order
by an I/O pool, which hands each span to a second pool for hashing and copying and reads on:
the disk never waits for the hash (``Pipeline``). From a store that reads fastest in order
(``ReadsInOrder``: files on this host), each pack's spans are read by one thread, in order,
through one open descriptor, so the kernel's read-ahead runs in front of them. A store with
``read_view`` (``LocalStorage``) reads each span into a reused buffer, no allocation per read.
Each chunk is checked where it was read (its XXH3-128 from format 3, else its BLAKE3 name:
``ChunkRef.matches``); only then are its bytes copied to their sinks, so a damaged chunk never
lands in a caller's tensor. What to read and where it goes is planned in ``reshard.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np

from stalwart.checkpoint.durable.manifest import ChunkRef
from stalwart.errors import CorruptCheckpointError, ObjectNotFoundError
from stalwart.storage.base import ReadsInOrder, ReadsLeaveHost, ReadsViews, Storage

__all__ = [
    "LOCAL_READ_AHEAD_SPANS",
    "READ_AHEAD_SPANS",
    "SPAN_BYTES",
    "Landing",
    "Need",
    "Pipeline",
    "Span",
    "chunk_what",
    "merge_spans",
    "read_span",
    "verify_chunk",
]

READ_AHEAD_SPANS = 8
"""Spans read but not yet verified, at most, from a store whose reads leave the host (each
holds a buffer of about ``SPAN_BYTES``): deep enough to hide a remote read's latency."""

LOCAL_READ_AHEAD_SPANS = 2
"""The same bound for stores on this host (``ReadsLeaveHost`` false or absent).

Reads from the page cache do not wait, and fewer buffers stay in the CPU's cache between
the read, the hash and the copy: 1 GB replicated on 4 ranks, cold cache, 2 cores, loaded in
1.12 s at 2 against 1.30-1.40 s at 8 (0.53 CPU-s a rank against 0.63); one process, warm,
interleaved: 0.307 s at 2, 0.311 at 4, 0.348 at 8, 0.498 at 1 (no overlap of read and hash).
"""

SPAN_BYTES = 4 << 20
"""Adjacent chunks of one pack are read together, up to this many bytes per read.

Measured on a virtio disk with 8 MiB kernel read-ahead (4 threads, buffered): 4 MiB reads
ran at 1.6x ``dd iflag=direct``, 8-16 MiB ones at 1.35x; a larger chunk is one read.
"""


Span = tuple[str, int, int, list["Need"]]
"""``(pack, start, end, needs)``: bytes ``[start, end)`` of a pack, holding ``needs``' chunks."""


@dataclass
class Need:
    """One chunk to read and verify, and the ``(dest, a, b)`` its raw bytes ``[a, b)`` fill."""

    ref: ChunkRef
    what: str
    sinks: list[tuple[memoryview, int, int]] = field(default_factory=list)
    boxes: set[int] = field(default_factory=set)  # the boxes it fills (read_boxes' order)
    landed: Callable[[Need], None] | None = None  # called once its bytes are in every sink
    audit: bool = False  # check the chunk's BLAKE3 name too, not only its XXH3-128


def chunk_what(prefix: str, c: ChunkRef) -> str:
    """How errors name chunk ``c`` of the shard ``prefix`` describes."""
    return f"{prefix}, chunk {c.hash[:16]}… in {c.pack} at byte {c.offset}"


def verify_chunk(storage: Storage, c: ChunkRef, what: str, out: memoryview | None = None) -> int:
    """Read chunk ``c``, check its length, XXH3-128 and BLAKE3 name; return the bytes read.

    With ``out`` (``c.nbytes`` long), the verified raw bytes are copied there. This is the
    audit (``ckpt verify``); loads check the XXH3-128 alone when the reference records one.

    Raises:
        CorruptCheckpointError: missing pack, truncated data, or a hash mismatch.
    """
    need = Need(c, what, audit=True)
    if out is not None:
        need.sinks.append((out, 0, c.nbytes))
    return read_span(storage, c.pack, c.offset, c.offset + c.length, [need])


def check_and_copy(stored_all: memoryview, start: int, needs: list[Need]) -> None:
    """Verify each chunk of a span read at pack offset ``start``, then copy it to its sinks."""
    for need in needs:
        c, what = need.ref, need.what
        stored = stored_all[c.offset - start : c.offset - start + c.length]
        if len(stored) != c.length:
            raise CorruptCheckpointError(
                f"{what}: truncated (read {len(stored)} of {c.length} bytes); load an earlier "
                "step or use fallback=True",
                damaged=[what],
            )
        raw = stored
        if c.codec == "zstd":
            import zstandard

            try:
                raw = memoryview(
                    zstandard.ZstdDecompressor().decompress(bytes(stored), max_output_size=c.nbytes)
                )
            except zstandard.ZstdError as e:
                raise CorruptCheckpointError(f"{what}: cannot decompress ({e})", [what]) from e
        if not c.matches(raw, audit=need.audit):
            raise CorruptCheckpointError(
                f"{what}: content does not match its hash (bit rot or tampering); "
                "load an earlier step or use fallback=True",
                damaged=[what],
            )
        src = np.frombuffer(raw, np.uint8)
        for dest, a, b in need.sinks:  # verified: now, and only now, it may land
            # numpy copies without the GIL (a memoryview slice copy holds it), so readers
            # keep issuing reads while a span is copied.
            np.copyto(np.frombuffer(dest, np.uint8), src[a:b])
        if need.landed is not None:
            need.landed(need)


def open_span(
    storage: Storage, pack: str, start: int, end: int, what: str
) -> tuple[memoryview, Callable[[], object]]:
    """Read pack bytes ``[start, end)``; return them and the function that frees them."""
    if end == start:
        return memoryview(b""), lambda: None
    try:
        if isinstance(storage, ReadsViews):
            stack = ExitStack()
            try:
                view = storage.read_view(pack, start, end - start)
                return stack.enter_context(view), stack.close
            except BaseException:
                stack.close()
                raise
        buf = memoryview(bytearray(end - start))
        return buf[: storage.read_into(pack, start, buf)], lambda: None
    except ObjectNotFoundError as e:
        raise _missing(what) from e


def _missing(what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{what}: pack file is missing; the checkpoint is incomplete — load an earlier "
        "step or use fallback=True",
        damaged=[what],
    )


def read_span(storage: Storage, pack: str, start: int, end: int, needs: list[Need]) -> int:
    """Read pack bytes ``[start, end)`` holding ``needs``' chunks; verify and place each."""
    view, release = open_span(storage, pack, start, end, needs[0].what)
    try:
        check_and_copy(view, start, needs)
    finally:
        release()
    return end - start


class Pipeline:
    """Reads spans on one pool and verifies them on another, so the disk never waits.

    When the same threads read and then hash, they fall into step: all read, then all
    hash while the disk idles. Here a reader hands its span to the verify pool and goes on
    to the next read at once; ``READ_AHEAD_SPANS`` (``LOCAL_READ_AHEAD_SPANS`` on this
    host) bounds the spans read but not yet verified (and so the buffers held).
    """

    def __init__(self, storage: Storage, verify_pool: ThreadPoolExecutor) -> None:
        self.storage = storage
        self.verify_pool = verify_pool
        remote = isinstance(storage, ReadsLeaveHost) and storage.reads_leave_host
        self.slots = threading.BoundedSemaphore(
            READ_AHEAD_SPANS if remote else LOCAL_READ_AHEAD_SPANS
        )
        self.verifies: list[Future[None]] = []
        self.failed = False  # a verify failed: the load will raise, skip the reads left

    def read(self, pack: str, start: int, end: int, needs: list[Need]) -> int:
        self.slots.acquire()
        if self.failed:
            self.slots.release()
            return 0
        try:
            view, release = open_span(self.storage, pack, start, end, needs[0].what)
        except BaseException:
            self.slots.release()
            raise

        def verify() -> None:
            try:
                check_and_copy(view, start, needs)
            except BaseException:
                self.failed = True
                raise
            finally:
                release()
                self.slots.release()

        self.verifies.append(self.verify_pool.submit(verify))
        return end - start

    def submit(self, pool: ThreadPoolExecutor, spans: list[Span]) -> list[Future[int]]:
        """Read ``spans`` on ``pool``: one task per pack, in order, from a store that reads
        fastest so (``ReadsInOrder``); else one per span."""
        if not isinstance(self.storage, ReadsInOrder):
            return [pool.submit(self.read, *span) for span in spans]
        packs: dict[str, list[Span]] = {}
        for span in spans:
            packs.setdefault(span[0], []).append(span)
        return [pool.submit(self.read_in_order, group) for group in packs.values()]

    def read_in_order(self, spans: list[Span]) -> int:
        """One pack's ``spans`` (in pack order) read in order through one open handle, so
        the store's read-ahead runs in front of them (``ReadsInOrder``)."""
        assert isinstance(self.storage, ReadsInOrder)
        with ExitStack() as stack:
            try:
                stack.enter_context(self.storage.hold_open(spans[0][0]))
            except ObjectNotFoundError as e:
                raise _missing(spans[0][3][0].what) from e
            try:
                return sum(self.read(*span) for span in spans)
            except BaseException:
                self.failed = True  # the load will raise: the other packs' readers stop
                raise


def merge_spans(needs: Iterable[Need]) -> list[Span]:
    """Merge chunks adjacent in a pack into spans of at most ``SPAN_BYTES`` (pack order)."""
    spans: list[Span] = []
    for need in sorted(needs, key=lambda n: (n.ref.pack, n.ref.offset)):
        c = need.ref
        if spans:
            pack, start, end, group = spans[-1]
            if pack == c.pack and end == c.offset and end + c.length - start <= SPAN_BYTES:
                spans[-1] = (pack, start, end + c.length, [*group, need])
                continue
        spans.append((c.pack, c.offset, c.offset + c.length, [need]))
    return spans


class Landing:
    """Counts each box's chunks down as they land; calls ``landed(i)`` when none is left."""

    def __init__(self, needs: Iterable[Need], late: set[int], landed: Callable[[int], None]):
        self.left: dict[int, int] = {}
        for need in needs:
            need.landed = self.land
            for i in need.boxes:
                self.left[i] = self.left.get(i, 0) + 1
        self.late = late
        self.landed = landed
        self.lock = threading.Lock()

    def land(self, need: Need) -> None:
        done = []
        with self.lock:
            for i in need.boxes:
                self.left[i] -= 1
                if not self.left[i] and i not in self.late:
                    done.append(i)
        for i in done:
            self.landed(i)
