"""Verification of a committed step: read every chunk, check every hash, report all damage.

Loading stops at the first bad chunk; verification does not. For one step it parses the
manifest afresh with the very checks ``load`` runs (``Manifest.from_bytes``: bounds, the
skeleton, shards that tile every tensor exactly, chunks that hold exactly each shard's bytes,
the manifest's checksum), so the two agree on every manifest (a damaged manifest is damage,
not a traceback). It then checks every chunk lies inside its pack, reads each distinct chunk
once on the given I/O threads and compares it with its hash.
A chunk shared by several tensors (dedup) is read once and reported under each of them.

While it reads, verification holds a lease on the step and its packs (when the store is
writable), so retention and garbage collection running elsewhere cannot pull packs away
mid-check and make an intact step look damaged.

This is the engine's own check (``Checkpointer.verify``); ``tools/verify.py`` runs it over
a root's steps for the CLI and scripts.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field

from stalwart.checkpoint.durable.integrity import pack_problems
from stalwart.checkpoint.durable.lease import Lease, check_committed
from stalwart.checkpoint.durable.manifest import ChunkRef, Manifest, manifest_key
from stalwart.checkpoint.durable.reshard import verify_chunk
from stalwart.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    StorageError,
    UnsafePathError,
)
from stalwart.storage.base import Storage

__all__ = ["Progress", "VerifyReport", "reader_lease", "verify_stored_step"]

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
"""Called as ``progress(chunks_done, chunks_total)`` after each distinct chunk is checked."""


@dataclass
class VerifyReport:
    """The outcome of verifying one committed step.

    Attributes:
        step: the step verified.
        ok: True when nothing is damaged.
        chunks_checked: distinct chunks read and hashed.
        bytes_checked: stored bytes read.
        damaged: one line per damaged item: for a chunk, the tensor, shard, chunk hash, pack
            and byte offset plus the reason; a chunk shared by several tensors appears once
            per tensor. Also shards that do not tile their tensor and a damaged manifest.
    """

    step: int
    ok: bool = True
    chunks_checked: int = 0
    bytes_checked: int = 0
    damaged: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        """A JSON-serialisable dict of the report: its fields, by name."""
        return asdict(self)


@contextlib.contextmanager
def reader_lease(
    store: Storage, *, steps: Iterable[int], packs: Iterable[str], lease_s: float
) -> Iterator[None]:
    """Hold a :class:`Lease` on ``steps`` and ``packs`` when the store lets us write one.

    A read-only store (a mounted snapshot, a bucket without write access) cannot hold a
    lease; reading then proceeds unprotected, with a log message.
    """
    lease = Lease(store, steps=steps, packs=packs, lease_s=lease_s, reading=True)
    try:
        lease.__enter__()
    except UnsafePathError:
        raise  # a linked leases/ folder is a broken root, not a read-only one
    except StorageError as e:
        log.info("reading without a lease (the store refused one: %s)", e)
        yield
        return
    try:
        yield
    finally:
        lease.__exit__(None, None, None)


def _read_manifest(store: Storage, step: int, committed: Callable[[], list[int]]) -> Manifest:
    """Parse ``step``'s manifest from the store, bypassing any cache."""
    key = manifest_key(step)
    try:
        data = store.read(key)
    except ObjectNotFoundError:
        raise CheckpointNotFoundError(
            f"step {step} is not a committed checkpoint in {store.url}; committed steps: "
            f"{committed()} — run `stalwart ckpt ls` to list them"
        ) from None
    m = Manifest.from_bytes(data, where=f"{store.url}/{key}")
    if m.step != step:
        raise CorruptCheckpointError(f"{store.url}/{key} claims step {m.step}, not {step}")
    return m


def _reason(e: Exception) -> str:
    """The short reason of a chunk error (verify_chunk prefixes messages with ``what: ``)."""
    msg = str(e)
    if isinstance(e, CorruptCheckpointError) and msg.startswith("chunk: "):
        return msg.removeprefix("chunk: ").split(";")[0]
    return f"unreadable ({msg})"


def verify_stored_step(
    store: Storage,
    step: int,
    *,
    io_threads: int,
    lease_s: float,
    committed: Callable[[], list[int]],
    pool: ThreadPoolExecutor | None = None,
    progress: Progress | None = None,
) -> VerifyReport:
    """Read and hash every chunk of ``step`` in ``store`` and report every damaged item.

    Args:
        store: the store under the checkpoint root.
        step: a committed step.
        io_threads: threads of a pool made for this call when ``pool`` is None.
        lease_s: how long the reader's lease on the step and its packs lasts.
        committed: the committed steps, for the message when ``step`` is not one.
        pool: threads that read and hash chunks.
        progress: called as ``progress(done, total)`` after each distinct chunk.

    Returns:
        The report; ``ok`` is False when anything is damaged (including the manifest).

    Raises:
        CheckpointNotFoundError: the root or the step does not exist.
        StepRetiredError: the step was deleted or replaced while it was being verified.
    """
    report = VerifyReport(step=step)
    try:
        # The parse that load uses: bounds, skeleton, exact tiling, checksum (they agree).
        m = _read_manifest(store, step, committed)
    except CorruptCheckpointError as e:
        report.ok = False
        report.damaged.append(f"manifest of step {step}: {e}")
        report.damaged.extend(f"manifest of step {step}: {d}" for d in e.damaged[3:])
        return report

    places = _chunk_places(m)
    # A chunk past its pack's end is damage, and is not read: its stored length could ask
    # for any amount of memory.
    bad: dict[ChunkRef, str] = pack_problems(m, store)
    distinct = [c for c in dict.fromkeys(c for _, c in places) if c not in bad]
    report.chunks_checked = len(bad)  # checked against the pack's length
    run = pool if pool is not None else ThreadPoolExecutor(io_threads)
    with (
        reader_lease(store, steps=[step], packs=m.packs(), lease_s=lease_s),
        run if pool is None else contextlib.nullcontext(),  # a pool of our own: shut down
    ):
        # Deleted between the manifest's read and the lease, or replaced while the packs were
        # read (then missing packs are the other save's doing): retired, not damaged.
        check_committed(store, m, f"verify of {store.url}")
        _hash_chunks(store, run, distinct, report, bad, progress)
        if bad:
            check_committed(store, m, f"verify of {store.url}", deep=True)
    report.damaged.extend(f"{where}: {bad[c]}" for where, c in places if c in bad)
    report.ok = not report.damaged
    return report


def _chunk_places(m: Manifest) -> list[tuple[str, ChunkRef]]:
    """Every use of a chunk, described, in manifest order (tensor by tensor, chunk by chunk).

    Each distinct chunk reference is read once; the report names every place that uses it.
    """
    places: list[tuple[str, ChunkRef]] = []
    for fqn, entry in m.tensors.items():
        for s in entry.shards:
            for i, c in enumerate(s.chunks):
                where = (
                    f"tensor {fqn!r} shard at offsets {list(s.offsets)} sizes {list(s.sizes)}: "
                    f"chunk {i + 1}/{len(s.chunks)} {c.hash[:16]}… in {c.pack} at byte {c.offset}"
                )
                places.append((where, c))
    return places


def _hash_chunks(
    store: Storage,
    run: ThreadPoolExecutor,
    distinct: list[ChunkRef],
    report: VerifyReport,
    bad: dict[ChunkRef, str],
    progress: Progress | None,
) -> None:
    """Read and hash ``distinct`` on ``run``; count into ``report``, damage into ``bad``."""
    futures = {run.submit(verify_chunk, store, c, "chunk"): c for c in distinct}
    for done, fut in enumerate(as_completed(futures), 1):
        try:
            report.bytes_checked += fut.result()
        except (CorruptCheckpointError, StorageError) as e:
            bad[futures[fut]] = _reason(e)
        report.chunks_checked += 1
        if progress is not None:
            progress(done, len(distinct))
