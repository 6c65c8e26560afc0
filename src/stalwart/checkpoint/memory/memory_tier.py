"""The memory tier's bookkeeping: which host buffer a capture goes to, which snapshots are kept.

One capture per step feeds every due tier (see ``checkpoint/capture.py``). The buffer it goes
to is chosen here:

- when the memory tier is due, the buffer of the snapshot that retention evicts (or a keeper
  slot on tmpfs, or a fresh buffer while fewer than ``keep`` snapshots exist);
- otherwise a spare buffer that no snapshot keeps.

Durable tiers read the capture's buffer in the background. A buffer is never reused while a
durable save still reads it (:meth:`MemoryTier.hold`): acquiring it waits for those saves.
In steady state no memory is allocated: ``keep`` snapshot buffers plus the spares that
durable saves in flight need.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from stalwart.checkpoint.capture import Capture, HostBuffer
from stalwart.checkpoint.memory.keeper import SnapshotKeeper
from stalwart.checkpoint.memory.snapshot import Snapshot

__all__ = ["MemoryTier"]

log = logging.getLogger(__name__)


class MemoryTier:
    """Snapshots kept in host memory (optionally on tmpfs) and the buffers behind them.

    Args:
        keep: how many snapshots to keep (``KeepLast(n)``'s n).
        keeper: tmpfs keeper whose slots hold the snapshots, or None for process memory.
        erasure: an ``ErasureGroup`` protecting each kept snapshot, or None.
    """

    def __init__(self, keep: int, keeper: SnapshotKeeper | None, erasure: Any = None) -> None:
        self.keep = keep
        self.keeper = keeper
        self.erasure = erasure
        self.snapshots: deque[Any] = deque()  # ProtectedSnapshot or Snapshot, oldest first
        self._slot_order: deque[int] = deque()  # keeper slot of each kept snapshot
        self._spares: list[HostBuffer] = []  # buffers no snapshot keeps
        self._holds: dict[int, list[Any]] = {}  # id(buffer) -> PendingSave reading it
        if keeper is not None:
            for slot, snap in keeper.load()[-keep:]:
                self.snapshots.append(snap)  # left by a crashed process on this node
                self._slot_order.append(slot)

    def acquire(self, for_memory: bool, step: int | None = None) -> tuple[HostBuffer, int]:
        """A buffer for the capture of ``step``, and its keeper slot (-1 for none).

        A memory capture of a step the tier holds first forgets that step and every later one
        (:meth:`_forget_from`), so that retention counts only the timeline the run is on.

        A buffer that a durable save is still reading is not waited for when another will
        do: it goes back to the spares and a free spare (or, once, a new buffer) is used, so
        a slow disk write never stalls the training step that evicts its snapshot.
        """
        slot = -1
        if for_memory and step is not None:
            self._forget_from(step)
        if not for_memory:
            buffer = self._spare()
        elif len(self.snapshots) >= self.keep:
            oldest = self.snapshots.popleft()  # retention: its buffer takes the new one
            if self.keeper is not None:
                slot = self._slot_order.popleft()
                buffer = self.keeper.buffers[slot]  # tmpfs slots are fixed: may wait below
            else:
                buffer = _snapshot_of(oldest).buffer or HostBuffer()
                if self._busy(buffer):
                    self._spares.append(buffer)
                    buffer = self._spare()
        elif self.keeper is not None:
            slot = min(set(range(self.keep)) - set(self._slot_order))
            buffer = self.keeper.buffers[slot]
        else:
            buffer = self._spare()
        self._wait_readers(buffer)
        if self.keeper is not None and slot >= 0:
            self.keeper.invalidate(slot)  # a crash from here on leaves no index: ignored
        return buffer, slot

    def _busy(self, buffer: HostBuffer) -> bool:
        return any(not p.done() for p in self._holds.get(id(buffer), []))

    def _spare(self) -> HostBuffer:
        """A spare no durable save is reading (a new one when every spare is busy)."""
        for i, b in enumerate(self._spares):
            if not self._busy(b):
                return self._spares.pop(i)
        return HostBuffer()

    def release(self, buffer: HostBuffer) -> None:
        """Return a buffer that no snapshot keeps (durable saves may still be reading it)."""
        self._spares.append(buffer)

    def hold(self, buffer: HostBuffer, pending: Any) -> None:
        """Record that ``pending`` (a PendingSave) reads ``buffer`` until it completes."""
        self._holds.setdefault(id(buffer), []).append(pending)

    def _wait_readers(self, buffer: HostBuffer) -> None:
        for p in self._holds.pop(id(buffer), []):
            p.future.exception()  # completion; its error surfaces through its own handle

    def keep_capture(self, cap: Capture, step: int, skeleton: dict[str, Any], slot: int) -> Any:
        """Turn a finished capture into a kept snapshot (digest, keeper index, parity)."""
        snap = Snapshot.from_capture(cap, step, skeleton)
        if self.keeper is not None:
            self.keeper.commit(slot, snap)
            self._slot_order.append(slot)
        kept = self.erasure.protect(snap) if self.erasure is not None else snap
        self.snapshots.append(kept)
        return kept

    def _forget_from(self, step: int) -> None:
        """Forget the snapshots of ``step`` and later ones before ``step`` is kept again.

        Saving a step the tier holds means the run went back (a resume, an elastic rollback):
        those snapshots belong to the abandoned timeline, and recovery must never pick them.
        """
        keep = [i for i, s in enumerate(self.snapshots) if s.step < step]
        if len(keep) == len(self.snapshots):
            return
        slots = list(self._slot_order)
        for i, kept in enumerate(self.snapshots):
            if i in keep:
                continue
            if self.keeper is not None:
                self.keeper.invalidate(slots[i])
            elif (buffer := _snapshot_of(kept).buffer) is not None:
                self._spares.append(buffer)
        self.snapshots = deque(self.snapshots[i] for i in keep)
        if self.keeper is not None:
            self._slot_order = deque(slots[i] for i in keep)

    def drop(self) -> None:
        """Forget every snapshot: what a rank restarted on another node starts with."""
        for kept in self.snapshots:
            buffer = _snapshot_of(kept).buffer
            if self.keeper is None and buffer is not None:
                self._spares.append(buffer)
        self.snapshots.clear()
        if self.keeper is not None:
            for slot in self._slot_order:
                self.keeper.invalidate(slot)
        self._slot_order.clear()

    def steps(self) -> list[int]:
        return sorted(int(s.step) for s in self.snapshots)

    def find(self, step: int) -> Any:
        return next((s for s in self.snapshots if s.step == step), None)


def _snapshot_of(kept: Any) -> Snapshot:
    return kept.snapshot if hasattr(kept, "snapshot") else kept
