"""Tiers: host memory (protected by erasure coding across peers), local disk, remote storage.

Each tier has its own save policy and retention. A save writes to every tier that is due; a
recovery takes the newest step that is complete on every rank from the fastest tier that
has it — peers' memory first (rebuilding up to ``m`` lost ranks per erasure group from the
survivors), then the durable tiers, newest step first — and says what it used::

    tc = TieredCheckpointer(
        [Tier(name="memory", every=EveryNSteps(1), keep=KeepLast(2)),
         Tier(name="local", root="/nvme/run1", every=EveryNSteps(50), keep=KeepLast(3)),
         Tier(name="remote", root="s3://bucket/run1", every=EveryNSteps(500))],
        erasure=(4, 2),
    )
    tc.save(step, state)            # or tc.save_async(step, state, lazy=True) + tc.guard(opt)
    report = tc.recover(state)      # after a restart: report.source, report.step, report.seconds
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from stalwart.checkpoint.capture import Capture, optimizer_storages, stage
from stalwart.checkpoint.collective import BACKGROUND_GROUPS, Group, resolve_group
from stalwart.checkpoint.durable.async_save import Guards, PendingSave, StagedCapture
from stalwart.checkpoint.durable.checkpointer import Checkpointer, close_on_exit
from stalwart.checkpoint.durable.commit import SaveRequest
from stalwart.checkpoint.durable.plan import local_items
from stalwart.checkpoint.events import CheckpointEvent, emit
from stalwart.checkpoint.memory.keeper import SnapshotKeeper
from stalwart.checkpoint.memory.memory_tier import MemoryTier
from stalwart.checkpoint.memory.tier_records import RecoveryReport, Tier, TieredSaveResult
from stalwart.checkpoint.options import CheckpointOptions
from stalwart.errors import CheckpointError, CheckpointNotFoundError, ConfigError
from stalwart.tree import flatten

__all__ = ["RecoveryReport", "Tier", "TieredCheckpointer"]

log = logging.getLogger(__name__)


class TieredCheckpointer:
    """Saves to several tiers on their own schedules; recovers from the fastest that has it.

    Args:
        tiers: at most one memory tier (``root=None``) and any number of durable tiers,
            fastest first.
        options: engine options for the durable tiers (their ``keep`` is the tier's).
        process_group: the ranks that save together (default group when initialised).
        erasure: ``(k, m)`` to protect memory snapshots across groups of ``k + m`` ranks,
            tolerating the loss of ``m`` ranks per group; None keeps no redundancy.
        codec: erasure codec (``auto``: XOR for m = 1, Reed-Solomon otherwise).
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        options: CheckpointOptions | None = None,
        process_group: Any = None,
        erasure: tuple[int, int] | None = None,
        codec: str = "auto",
    ) -> None:
        if not tiers:
            raise ConfigError("TieredCheckpointer needs at least one Tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}")
        memory = [t for t in tiers if t.is_memory]
        if len(memory) > 1:
            raise ConfigError("at most one memory tier (root=None)")
        self.tiers = list(tiers)
        self.memory_tier = memory[0] if memory else None
        options = options or CheckpointOptions()
        self._on_event = options.on_event
        self.durable: dict[str, Checkpointer] = {
            t.name: Checkpointer(
                t.root,
                dataclasses.replace(options, keep=t.keep),
                process_group=process_group,
                storage_options=t.storage_options,
            )
            for t in tiers
            if t.root is not None  # a durable tier (narrows the type, unlike is_memory)
        }
        self._process_group = process_group
        self._erasure_cfg = erasure
        self._codec = codec
        self._eg: Any = None
        self._ec_group: Group | None = None
        keeper = None
        keep = self.memory_tier.keep.n if self.memory_tier is not None else 0  # type: ignore[attr-defined]
        if self.memory_tier is not None and self.memory_tier.keep_in is not None:
            rank = resolve_group(process_group).rank
            keeper = SnapshotKeeper(self.memory_tier.keep_in, rank, keep)
        self.memory = MemoryTier(keep, keeper)
        self._guards = Guards()  # taken off at close: their hooks hold this object alive
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="stalwart-stage")
        self._snapshotter = ThreadPoolExecutor(1, thread_name_prefix="stalwart-snapshot")
        self._staged: Future[None] | None = None
        self._staged_capture: Capture | None = None
        self._pending_snapshot: Future[Any] | None = None
        self._last: dict[str, tuple[int, float]] = {}
        self.last_capture: Capture | None = None
        """The host copy of the newest save (``copied_bytes``, ``buffer``): one per step."""

    @property
    def snapshots(self) -> Any:
        """The kept memory snapshots, oldest first."""
        return self.memory.snapshots

    # -- saving ------------------------------------------------------------------------

    def _due(self, step: int) -> list[Tier]:
        now = time.monotonic()
        due = []
        for t in self.tiers:
            last_step, last_s = self._last.get(t.name, (None, None))
            if t.every.due(step, now, last_step, last_s):
                due.append(t)
        g = resolve_group(self._process_group)
        names = g.broadcast([t.name for t in due])  # time-based policies: rank 0 decides
        return [t for t in self.tiers if t.name in names]

    def save(self, step: int, state: Any, *, overwrite: bool = False) -> TieredSaveResult:
        """Save ``step`` to every tier that is due; durable when it returns.

        Returns what each tier did: the kept snapshot for the memory tier, the
        ``SaveResult`` for a durable tier.

        Raises:
            StepExistsError: a due durable tier holds ``step`` and ``overwrite`` is False
                (see :meth:`save_async`).
        """
        out = self.save_async(step, state, overwrite=overwrite)
        done = {n: (v.wait() if isinstance(v, PendingSave) else v) for n, v in out.items()}
        return TieredSaveResult(step, done)

    def save_async(
        self, step: int, state: Any, *, lazy: bool = False, overwrite: bool = False
    ) -> TieredSaveResult:
        """Copy the state to host once, then feed every due tier from that one copy.

        Eager: every tensor is copied before this returns. Lazy: the parameters and state of
        optimizers given to :meth:`guard` are copied in the background (``optimizer.step()``
        waits for them); everything else is copied now and values are read now, so the
        saved step is exactly the state of the call. Durable tiers persist in the
        background; the memory snapshot is digested and erasure-protected in the background.
        A step a due durable tier holds is refused first (see :meth:`check_new_step`).

        Returns:
            Per due tier: a ``PendingSave`` (durable tiers); for the memory tier the kept
            snapshot (eager) or a Future of it (lazy).
        """
        due = self._due(step)
        if not due:
            return TieredSaveResult(step)
        self._settle()
        self.check_new_step(step, due, overwrite=overwrite)
        flat = flatten(state)
        items, skeleton = local_items(flat), flat.skeleton
        mem_due = any(t.is_memory for t in due)
        if mem_due:
            self._erasure()  # made by every rank together, before any background work
        buffer, slot = self.memory.acquire(for_memory=mem_due, step=step)
        defer = optimizer_storages(self._optimizers()) if lazy else frozenset()
        cap, finish = stage(items, buffer, defer=defer)
        staged: Future[None] = Future() if finish is None else self._stager.submit(finish)
        if finish is None:
            staged.set_result(None)
        self._staged, self._staged_capture = staged, cap
        self.last_capture = cap
        captured = StagedCapture(cap, items, skeleton, staged)
        out: dict[str, Any] = {}
        for t in due:
            if not t.is_memory:
                request = SaveRequest(step, overwrite=overwrite)
                pending = self.durable[t.name].save_captured(request, captured)
                self.memory.hold(buffer, pending)
                out[t.name] = pending
            self._last[t.name] = (step, time.monotonic())
        if not mem_due:
            self.memory.release(buffer)
            return TieredSaveResult(step, out)
        name = next(t.name for t in due if t.is_memory)

        def keep() -> Any:
            staged.result()
            return self.memory.keep_capture(cap, step, skeleton, slot)

        if lazy:
            self._pending_snapshot = self._snapshotter.submit(keep)
            out[name] = self._pending_snapshot
        else:
            out[name] = keep()
        return TieredSaveResult(step, out)

    def check_new_step(self, step: int, due: list[Tier], *, overwrite: bool = False) -> None:
        """Refuse ``step`` where a due durable tier committed it (or is saving it).

        Collective: each durable tier decides on rank 0's listing, so every rank raises
        alike. With ``overwrite`` each durable tier replaces the step atomically. The memory
        tier never refuses: its snapshots are this run's recent past, and after a rollback
        the replayed steps are the real ones.

        Raises:
            StepExistsError: a due durable tier holds ``step`` and ``overwrite`` is False.
        """
        for t in due:
            if not t.is_memory:
                self.durable[t.name].check_new_step(step, overwrite=overwrite)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self._guards.optimizers)

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step()`` wait for lazy copies still in flight (install once).

        Its parameters and state may then be copied lazily; they must change only in
        ``optimizer.step()``. :meth:`close` takes the guard off again.
        """
        return self._guards.add(optimizer, self._wait_copy)

    def _wait_copy(self) -> None:
        """What a guarded ``optimizer.step()`` waits for: the lazy copies in flight."""
        staged, cap = self._staged, self._staged_capture
        if staged is not None:
            staged.result()
        if cap is not None:
            cap.order_after_copies()

    def _settle(self) -> None:
        """Wait for a lazy memory snapshot in flight (raising its error, if any)."""
        pending, self._pending_snapshot = self._pending_snapshot, None
        if pending is not None:
            pending.result()

    def wait(self) -> None:
        """Wait for every tier's saves in flight."""
        self._settle()
        for c in self.durable.values():
            c.wait()

    def _erasure(self) -> Any:
        if self._erasure_cfg is None:
            return None
        if self._eg is None:
            from stalwart.checkpoint.memory.erasure import ErasureGroup

            g = resolve_group(self._process_group)
            if g.world > 1:  # taken from the process's pool; given back at close
                self._ec_group = BACKGROUND_GROUPS.take(g)
            pg = self._ec_group.pg if self._ec_group is not None else g.pg
            k, m = self._erasure_cfg
            self._eg = ErasureGroup(k, m, process_group=pg, codec=self._codec)
            self.memory.erasure = self._eg
        return self._eg

    def drop_memory(self) -> None:
        """Forget every memory snapshot: what a rank restarted on another node starts with."""
        self._settle()
        self.memory.drop()

    # -- recovery ----------------------------------------------------------------------

    def recover(self, state: Any) -> RecoveryReport:
        """Restore ``state`` from the newest step recoverable on every rank.

        Peers' memory first: the newest snapshot step that every rank holds, or that enough
        survivors hold with erasure parity to rebuild the missing ranks by decoding; each
        rank checks its snapshot against its digest first (hashing it all: a cost paid on
        recovery, which is rare, never on save), and a failure on any rank sends every rank
        on. Then the newest durable step, from the fastest tier that has it (older ones
        where it is damaged). The report's ``attempts`` say why each one passed over failed.

        Raises:
            CheckpointNotFoundError: no tier holds a step for every rank.
        """
        t0 = time.perf_counter()
        self._settle()
        g = resolve_group(self._process_group)
        attempts: list[tuple[str, str]] = []
        everyone = g.all_gather(self.memory.held())
        durable_latest = {n: c.latest_step() for n, c in self.durable.items()}
        best_durable = max((s for s in durable_latest.values() if s is not None), default=None)
        if self.memory_tier is not None:
            found = self._recover_memory(state, everyone, best_durable, attempts)
            if found is not None:
                step, source, lost, tree = found
                seconds = time.perf_counter() - t0
                return self._recovered(RecoveryReport(step, source, seconds, lost, attempts, tree))
        attempts += [(n, "no committed step") for n, s in durable_latest.items() if s is None]
        found = self._load_newest_durable(state, attempts)
        if found is not None:
            name, step, tree = found
            seconds = time.perf_counter() - t0
            return self._recovered(RecoveryReport(step, name, seconds, [], attempts, tree))
        raise CheckpointNotFoundError(
            "no tier holds a recoverable step: " + "; ".join(f"{n}: {why}" for n, why in attempts)
        )

    def _recover_memory(
        self, state: Any, everyone: Any, best_durable: int | None, attempts: list[tuple[str, str]]
    ) -> tuple[int, str, list[int], Any] | None:
        """``(step, source, rebuilt ranks, tree)`` from peers' memory, or None (and why, in
        ``attempts``) when no step is recoverable, newer than ``best_durable`` and intact on
        every rank. Collective: every rank reaches the same verdict."""
        self._erasure()  # the group a rebuild runs on, made by every rank together
        chosen, why = self.memory.recoverable(everyone)
        if chosen is None:
            attempts.append(
                ("memory", "; ".join(["no step held (or rebuildable) on every rank", *why]))
            )
            return None
        step, lost = chosen
        attempts += [("memory", w) for w in why]
        if best_durable is not None and step < best_durable:
            attempts.append(("memory", f"step {step} is older than durable step {best_durable}"))
            return None
        g = resolve_group(self._process_group)
        failed = [(r, e) for r, e in enumerate(g.all_gather(self.memory.verify(step))) if e]
        if failed:
            attempts += [("memory", f"step {step} on rank {r}: {e}") for r, e in failed]
            return None
        try:
            source, snap = self.memory.snapshot(step, lost)
        except CheckpointError as e:  # a failed rebuild, raised on every rank alike: all fall back
            attempts.append(("memory", f"step {step}: {e}"))
            return None
        return step, source, lost, snap.restore_into(state)

    def _load_newest_durable(self, state: Any, attempts: list[tuple[str, str]]) -> Any:
        """``(tier, step, tree)`` of the newest step any durable tier holds, loaded from the
        fastest tier that has it; a step that fails (damaged, retired, or not fitting the
        state) falls back to the next newest, in any tier, each failure in ``attempts``."""
        tiers = enumerate(self.durable.items())
        for neg_step, _, name in sorted((-s, i, n) for i, (n, c) in tiers for s in c.steps()):
            try:
                return name, -neg_step, self.durable[name].load(state, -neg_step)
            except CheckpointError as e:
                attempts.append((name, f"step {-neg_step} failed: {e}"))
        return None

    def _recovered(self, report: RecoveryReport) -> RecoveryReport:
        """Tell ``options.on_event`` where the state came from (kind ``recover``)."""
        g = resolve_group(self._process_group)
        where = (
            report.source
            if report.source.startswith("memory")
            else str(self.durable[report.source].url)
        )
        event = CheckpointEvent(
            "recover",
            report.step,
            where,
            rank=g.rank,
            seconds=report.seconds,
            metadata={"source": report.source},
        )
        emit(self._on_event, event)
        return report

    def close(self) -> None:
        """Flush and close every tier, and take the guards off the optimizers.

        A guard's hook refers to this object: left on the optimizer it would keep a closed
        checkpointer, and its memory snapshots, alive as long as the optimizer lives.
        """
        try:
            self._settle()  # a failed snapshot raises here, after everything below ran
        finally:
            self._guards.remove()
            self._stager.shutdown(wait=True)
            self._snapshotter.shutdown(wait=True)
            if self._ec_group is not None:  # nothing runs on it once the snapshotter stopped
                BACKGROUND_GROUPS.give(self._ec_group)
                self._ec_group = None
            self.memory.close()  # the keep_in folder's lock: another writer may take it
            with contextlib.ExitStack() as closing:  # each closes, whatever another raises
                for c in self.durable.values():
                    closing.callback(c.close)

    def __enter__(self) -> TieredCheckpointer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        close_on_exit(self.close, exc_type)
