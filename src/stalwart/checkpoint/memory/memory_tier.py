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

Recovery asks the tier which step every rank can restore (:meth:`MemoryTier.recoverable`,
from what each rank :meth:`~MemoryTier.held`), checks it (:meth:`~MemoryTier.verify`) and
takes its snapshot, rebuilding lost ranks' from their peers' parity
(:meth:`~MemoryTier.snapshot`); a failed rebuild fails on every rank alike, and recovery
goes on to the durable tiers.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from stalwart.checkpoint.capture import Capture, HostBuffer
from stalwart.checkpoint.memory.erasure_records import ProtectedSnapshot
from stalwart.checkpoint.memory.keeper import SnapshotKeeper
from stalwart.checkpoint.memory.snapshot import Snapshot
from stalwart.errors import CorruptCheckpointError

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
        if for_memory and self.keeper is not None:
            self.keeper.claim()  # a second writer of the folder is refused before any change
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
        """Turn a finished capture into a kept snapshot (digest, parity, keeper index).

        Nothing is recorded until every part succeeded: a failed digest or erasure exchange
        leaves the step unkept, its keeper slot free (invalidated in :meth:`acquire`, so it
        has no index) and its buffer spare, and the next step is kept as usual.
        """
        try:
            snap = Snapshot.from_capture(cap, step, skeleton)
            kept = self.erasure.protect(snap) if self.erasure is not None else snap
        except BaseException:
            if self.keeper is None:
                self.release(cap.buffer)
            raise
        if self.keeper is not None:
            self.keeper.commit(slot, snap)
            self._slot_order.append(slot)
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

    def close(self) -> None:
        """Let another process (or checkpointer) write the keeper's folder."""
        if self.keeper is not None:
            self.keeper.close()

    # -- recovery ----------------------------------------------------------------------

    def held(self) -> tuple[list[int], list[int]]:
        """The steps kept, and those kept with erasure parity: what recovery gathers.

        Snapshots the keeper reloaded after a restart have no parity (it lived in the process
        that died): they restore this rank but can rebuild no lost peer.
        """
        protected = [s.step for s in self.snapshots if isinstance(s, ProtectedSnapshot)]
        return self.steps(), sorted(protected)

    def recoverable(
        self, everyone: list[tuple[list[int], list[int]]]
    ) -> tuple[tuple[int, list[int]] | None, list[str]]:
        """The newest step every rank holds or can rebuild, with the ranks that must rebuild.

        ``everyone`` is every rank's :meth:`held`, by rank. A step some ranks lack can be
        rebuilt when at most ``m`` lack it per erasure group and every other rank holds it
        protected. Also returns why each newer step cannot be recovered.
        """
        eg = self.erasure
        why: list[str] = []
        for step in sorted({s for steps, _ in everyone for s in steps}, reverse=True):
            lost = [r for r, (steps, _) in enumerate(everyone) if step not in steps]
            bare = [r for r, (s, prot) in enumerate(everyone) if step in s and step not in prot]
            if not lost:
                return (step, []), why
            if eg is None:
                why.append(f"step {step}: ranks {lost} lack it and there is no erasure coding")
            elif bare:
                why.append(
                    f"step {step}: ranks {lost} lack it and ranks {bare} hold it without "
                    "parity (reloaded from keep_in after a restart): it cannot be rebuilt"
                )
            elif max(sum(1 for r in lost if r in members) for members in eg.groups) > eg.m:
                why.append(f"step {step}: ranks {lost} lack it, over {eg.m} per erasure group")
            else:
                return (step, lost), why
        return None, why

    def verify(self, step: int) -> str | None:
        """Why this rank's snapshot of ``step`` fails its digest, or None when it checks.

        Hashes the whole snapshot. None too where this rank holds no such snapshot (a
        rebuilt one is checked as it is rebuilt).
        """
        kept = self.find(step)
        try:
            if kept is not None:
                _snapshot_of(kept).verify()
        except CorruptCheckpointError as e:
            return str(e)
        return None

    def snapshot(self, step: int, lost: list[int]) -> tuple[str, Snapshot]:
        """``(source, snapshot)``: this rank's snapshot of ``step``; collective when ``lost``.

        Every rank passes what :meth:`recoverable` chose; the ranks in ``lost`` (those that
        hold no snapshot of ``step``) get theirs rebuilt from their group's survivors.

        Raises:
            CorruptCheckpointError: the rebuild failed; raised on every rank alike (the
                codec's ranks agree on the outcome), so every rank may fall back together.
        """
        held = self.find(step)
        if not lost:
            return "memory", _snapshot_of(held)
        rebuilt = self.erasure.rebuild(lost, held)  # None on a survivor
        return "memory+erasure", rebuilt if held is None else _snapshot_of(held)


def _snapshot_of(kept: Any) -> Snapshot:
    return kept.snapshot if hasattr(kept, "snapshot") else kept
