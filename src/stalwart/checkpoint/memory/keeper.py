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
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from stalwart.checkpoint.capture import HostBuffer
from stalwart.checkpoint.memory.snapshot import Snapshot
from stalwart.errors import CorruptCheckpointError

__all__ = ["SharedHostBuffer", "SnapshotKeeper"]

log = logging.getLogger(__name__)

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

    def _blob(self, slot: int) -> Path:
        return self.folder / f"rank{self.rank:05d}-slot{slot}.buf"

    def _index(self, slot: int) -> Path:
        return self.folder / f"rank{self.rank:05d}-slot{slot}.json"

    def invalidate(self, slot: int) -> None:
        """Forget the slot's snapshot before its buffer is overwritten."""
        self._index(slot).unlink(missing_ok=True)

    def commit(self, slot: int, snapshot: Snapshot) -> None:
        """Record ``snapshot`` (already captured into the slot's buffer) as the slot's."""
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
