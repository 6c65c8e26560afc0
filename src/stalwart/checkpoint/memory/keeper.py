"""Memory snapshots that outlive a crashed trainer: buffers mapped from files on a tmpfs.

A snapshot kept in the trainer's own heap dies with the trainer. Kept in a file on a tmpfs
(``/dev/shm``), it is still memory — no disk is touched — but it belongs to the node's
kernel, not to the process: a trainer killed by SIGKILL or an OOM kill and restarted on the
same node maps the file again and finds its snapshot. That needs no separate keeper process
and no extra copy: the snapshot buffer *is* the shared mapping.

Per rank and slot there are two files: ``rank00003-slot1.buf`` (the blob) and
``rank00003-slot1.json`` (the index: step, digest, tensor boxes). The index is removed
before a slot is overwritten and written atomically after, so a crash mid-capture leaves a
slot without an index, which is ignored; a blob that does not match its digest is ignored
too. Losing the node loses these files: peers' erasure-coded parity covers that case.

One writer per folder and rank: before its first change to the slots a keeper takes an
exclusive ``flock`` on ``rank00003.lock`` (which records its pid) and holds it until
:meth:`SnapshotKeeper.close`; the kernel releases it when the process dies, so a trainer
restarted after a kill takes it again. A second live writer (two checkpointers given the same
``keep_in``) is refused instead of overwriting the first one's snapshots. Reading the kept
snapshots needs no lock. A process forked after the claim (a data loader's worker) closes its
copy of the lock's fd at once, so it never holds the folder past the trainer.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import weakref
from pathlib import Path

import torch

from stalwart.checkpoint.capture import HostBuffer
from stalwart.checkpoint.memory.snapshot import Snapshot
from stalwart.errors import ConfigError, CorruptCheckpointError

__all__ = ["SharedHostBuffer", "SnapshotKeeper"]

log = logging.getLogger(__name__)

_HELD: set[int] = set()
"""The keep_in lock fds this process holds. A forked child (a DataLoader worker) inherits
them, and an ``flock`` lives while any fd of it is open: the child closes them at once, so
that a restarted trainer does not find its folder held by its dead predecessor's workers."""


_CLAIMING = threading.RLock()
"""Held from a lock's open to its entry in :data:`_HELD` (and from its removal to its close),
and across a fork: a fork in that gap (a data loader starting while a background snapshot
claims) would leave the child a copy of the fd it does not know to close. Reentrant: a
finalizer may close a lock while its thread claims another."""


def _release_in_child() -> None:
    for fd in _HELD:
        os.close(fd)
    _HELD.clear()
    _CLAIMING.release()


os.register_at_fork(
    before=_CLAIMING.acquire,
    after_in_parent=_CLAIMING.release,
    after_in_child=_release_in_child,
)


def _close_lock(fd: int) -> None:
    with _CLAIMING:
        if fd in _HELD:  # a forked child closed it already
            _HELD.discard(fd)
            os.close(fd)


_GRANULE = 1 << 20  # grow mappings in whole MiB to avoid remapping for small changes


class SharedHostBuffer(HostBuffer):
    """A snapshot buffer whose memory is a shared mapping of ``path`` (on a tmpfs)."""

    can_pin = False  # mapped from a tmpfs file; cannot be re-allocated pinned

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(0)
        if path.exists() and path.stat().st_size > 0:
            self._map(path.stat().st_size)

    def _map(self, nbytes: int) -> None:
        self._data = torch.from_file(str(self.path), shared=True, size=nbytes, dtype=torch.uint8)
        self.allocations += 1

    def _grow(self, nbytes: int) -> None:
        size = -(-nbytes // _GRANULE) * _GRANULE
        with open(self.path, "ab") as f:
            f.truncate(size)
        self._map(size)


class SnapshotKeeper:
    """The slot files of one rank under ``folder``.

    Args:
        folder: a tmpfs folder (``/dev/shm/<job>``); created if missing.
        rank: this process's rank (files of other ranks are left alone).
        slots: how many snapshots to keep.
    """

    def __init__(self, folder: str | os.PathLike[str], rank: int, slots: int) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.buffers = [SharedHostBuffer(self._blob(i)) for i in range(slots)]
        self._lock: weakref.finalize | None = None  # closes the lock's fd, at close or GC

    def claim(self) -> None:
        """Become the folder's only writer for this rank (once; later calls return at once).

        Raises:
            ConfigError: another live keeper, in this process or another, writes the folder
                for this rank.
        """
        if self._lock is not None:
            return
        path = self.folder / f"rank{self.rank:05d}.lock"
        with _CLAIMING:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                fd = -1
            else:
                _HELD.add(fd)
        if fd < 0:
            raise ConfigError(
                f"keep_in folder {self.folder} already has a live writer for rank {self.rank} "
                f"(process {holder} holds {path.name}): two checkpointers would overwrite each "
                "other's snapshots; give each its own keep_in folder (for example "
                "/dev/shm/<job>/<model>), or close the other one first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock = weakref.finalize(self, _close_lock, fd)

    def close(self) -> None:
        """Release the folder to another writer (the snapshots stay for a restart)."""
        if self._lock is not None:
            self._lock()
            self._lock = None

    def _blob(self, slot: int) -> Path:
        return self.folder / f"rank{self.rank:05d}-slot{slot}.buf"

    def _index(self, slot: int) -> Path:
        return self.folder / f"rank{self.rank:05d}-slot{slot}.json"

    def invalidate(self, slot: int) -> None:
        """Forget the slot's snapshot before its buffer is overwritten."""
        self.claim()
        self._index(slot).unlink(missing_ok=True)

    def commit(self, slot: int, snapshot: Snapshot) -> None:
        """Record ``snapshot`` (already captured into the slot's buffer) as the slot's."""
        self.claim()
        tmp = self._index(slot).with_suffix(".json.tmp")
        tmp.write_bytes(snapshot.to_bytes())
        os.replace(tmp, self._index(slot))

    def load(self) -> list[tuple[int, Snapshot]]:
        """Every slot's snapshot that survived and verifies, as ``(slot, snapshot)``."""
        found = []
        for slot, buf in enumerate(self.buffers):
            index = self._index(slot)
            if not index.exists():
                continue
            try:
                data = index.read_bytes()
                nbytes = _nbytes(data)
                if nbytes > buf.capacity:
                    raise CorruptCheckpointError(f"blob of {index.name} is shorter than its index")
                snap = Snapshot.from_bytes(data, buf.acquire(nbytes), buffer=buf, verify=True)
            except (OSError, CorruptCheckpointError) as e:
                log.warning("ignoring kept snapshot %s: %s", index, e)
                continue
            found.append((slot, snap))
        return sorted(found, key=lambda x: x[1].step)


def _nbytes(index: bytes) -> int:
    import json

    try:
        return int(json.loads(index)["nbytes"])
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"malformed snapshot index: {e}") from e
