"""``StepLedger``: a member's committed step, and what happens when a step commits or fails.

The ledger is the one owner of the step counter, the current membership epoch, the step's
start (its RNG and buffer snapshot, its clock) and the bookkeeping of each outcome:

* :meth:`StepLedger.commit` after a step's update was applied: count it, check parity every
  ``verify_every`` steps, write the ``step`` and ``step-stats`` events, tell the listeners;
* :meth:`StepLedger.discard` after a failed step: put the RNGs and buffers back, report the
  fault, mark the job for reconfiguration;
* :meth:`StepLedger.reconfigure` at a step boundary: join the next published epoch and
  reconcile with its members (:mod:`stalwart.elastic.parity`);
* :meth:`StepLedger.rewind`: go back to a step every member restored (sharded state).

How a step's contributions are combined is a :class:`CommitStrategy` that receives the
ledger: the all-reduce (:mod:`stalwart.elastic.commit`), backup workers
(:mod:`stalwart.elastic.backup_job`). DiLoCo's buffered mode and sharded state use the same
public interface; none of them touches the ledger's or the job's private fields.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from stalwart.elastic.events import (
    EventKind,
    EventLog,
    FaultDetected,
    FirstCommitAfterChange,
    Reconfigured,
    StepCommitted,
    StepDiscarded,
)
from stalwart.elastic.membership import Epoch, Membership
from stalwart.elastic.parity import Decision, ParityCheck
from stalwart.elastic.state import BoundarySnapshot, digest
from stalwart.elastic.stats import StepStats
from stalwart.errors import DistributedError

__all__ = ["CommitStrategy", "Listener", "StepLedger"]

log = logging.getLogger(__name__)

Listener = Callable[[str, int], None]


class CommitStrategy(Protocol):
    """How a step's contributions are combined before its update is applied."""

    def commit(self, ledger: StepLedger, apply: Callable[[], Any]) -> Any:
        """Combine the contributions, ``apply()`` and ``ledger.commit(...)``; or
        ``ledger.discard(err)`` and return None."""
        ...


class StepLedger:
    """The committed step of one member, its epoch, and the outcome of each step.

    Args:
        state: the replicated state (digested, reconciled by parity checks).
        events: this worker's event log.
        membership: the coordinator's membership (None: a fixed world).
        epoch: the epoch joined first.
        verify_every: compare digests every this many committed steps (0: only after heals).
        join_timeout_s: how long to wait for a membership epoch.
        stats_window: committed steps per ``step-stats`` window (0: off).
    """

    def __init__(
        self, state: Any, events: EventLog, membership: Membership | None, epoch: Epoch, *,
        verify_every: int, join_timeout_s: float, stats_window: int,
    ) -> None:  # fmt: skip
        self.state, self.events, self.membership, self.epoch = state, events, membership, epoch
        self.verify_every, self.join_timeout_s = verify_every, join_timeout_s
        self.params: list[torch.Tensor] = []  # the optimizer's parameters: their grads are reduced
        self.buffers: list[torch.Tensor] = []  # the model's float buffers: averaged at a commit
        self.model_buffers: list[torch.Tensor] = []  # all of them: put back on a discard
        self.own_s = 0.0  # this member's own time in the step (see stats.py)
        self.started = time.time()  # the step's start (wall clock)
        self._step = 0
        self._stats = StepStats(stats_window)
        self._parity = ParityCheck(state, events)
        self._listeners: list[Listener] = []
        self._due = self._changed = False
        self._boundary: BoundarySnapshot | None = None

    # -- what strategies read ---------------------------------------------------------------

    @property
    def step(self) -> int:
        """Committed steps; equal on every member at every step boundary."""
        return self._step

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The current epoch's gloo group (None: a world of one, or dropped after a fault)."""
        return self.epoch.group

    @property
    def reconfigure_due(self) -> bool:
        """Whether the next boundary joins a new epoch (a fault, or a newcomer announced)."""
        return self._due

    @property
    def last_decision(self) -> Decision | None:
        """The rule that decided the last parity check."""
        return self._parity.last_decision

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(event, step)`` at ``step-begin``, ``collective-enter`` and ``commit``."""
        self._listeners.append(fn)

    def notify(self, event: str) -> None:
        """Tell the listeners that the step reached ``event``."""
        for fn in self._listeners:
            fn(event, self._step)

    def digest(self) -> str:
        """Hex digest of the replicated state and the committed step."""
        return digest(self.state, self._step)

    def change_flag(self) -> float:
        """1.0 when this member sees a newer epoch published (checked by rank 0 only)."""
        if self.membership is None or self.epoch.rank != 0:
            return 0.0  # a lost coordinator: followed, or DistributedError (membership.py)
        return 1.0 if self.membership.latest_epoch() > self.epoch.number else 0.0

    def newer_epoch_published(self) -> bool:
        """Whether the coordinator published an epoch after this one (False: unknown)."""
        try:
            return self.membership is not None and (
                self.membership.latest_epoch() > self.epoch.number
            )
        except RuntimeError:
            return False

    # -- a step's outcome -------------------------------------------------------------------

    def mark_boundary(self) -> None:
        """A step starts: snapshot the RNGs and buffers a discard puts back, start the clock."""
        self._boundary = BoundarySnapshot(self.state, self.model_buffers, self._boundary)
        self.started = time.time()

    def enter_collective(self) -> None:
        """The step's contribution is ready: join a due epoch first, then record own time."""
        if self._due:  # a step() without zero_grad() after a fault
            self.reconfigure()
        self.notify("collective-enter")
        self.own_s = time.time() - self.started

    def commit(self, *, change: bool = False) -> None:
        """The step's update was applied: count it and record it.

        Args:
            change: the step's reduction carried the flag of a newer epoch.
        """
        self._step += 1
        self._due = self._due or change
        digest_hex = None
        if self.verify_every and self._step % self.verify_every == 0:
            try:
                digest_hex = self.check_parity("periodic")
            except RuntimeError as e:  # a peer died after the commit: next boundary heals
                if isinstance(e, DistributedError):
                    raise
                self.fault(e)
        self._record(digest_hex)
        self.notify("commit")
        self.mark_boundary()

    def _record(self, digest_hex: str | None) -> None:
        dt = time.time() - self.started
        number, members = self.epoch.number, list(self.epoch.members)
        self.events.record(StepCommitted(step=self._step, epoch=number, members=members, dt=dt,
                                         digest=digest_hex))  # fmt: skip
        window = self._stats.add(self.own_s, dt, self._step)
        if window is not None:
            self.events.write(EventKind.STEP_STATS, **window)
            if self.membership is not None:
                self.membership.publish_stats(window)
        if self._changed:
            self.events.record(FirstCommitAfterChange(step=self._step, epoch=number))
            self._changed = False
        if self.membership is not None and self.epoch.rank == 0:
            self.membership.record_progress(self._step)

    def discard(self, err: BaseException) -> None:
        """The step failed: put back its start, report the fault, start the step again."""
        if self._boundary is not None:
            self._boundary.restore()
        self.events.record(StepDiscarded(
            step=self._step, epoch=self.epoch.number, members=list(self.epoch.members),
            dt=time.time() - self.started,
        ))  # fmt: skip
        self.fault(err)
        self.mark_boundary()

    def fault(self, err: BaseException) -> None:
        """A collective failed: tell the coordinator, drop the group, reconfigure when due.

        Raises:
            DistributedError: in a fixed world (torchrun or one process), which cannot heal.
        """
        if self.membership is None:
            raise DistributedError(
                f"a collective failed in a fixed world (torchrun or one process): {err}; "
                "run the script with `stalwart run` to survive member failures"
            ) from err
        number, members = self.epoch.number, self.epoch.members
        log.warning("epoch %d: collective failed at step %d: %s", number, self._step, err)
        self.events.record(FaultDetected(step=self._step, epoch=number, members=list(members),
                                         error=str(err)[:200]))  # fmt: skip
        self.membership.report_fault(number)
        self.drop_group()  # closes our sockets: the peers fail fast
        self._due = True

    def drop_group(self) -> None:
        """Forget the current epoch's group (its sockets close)."""
        self.epoch = Epoch(self.epoch.number, self.epoch.members, self.epoch.rank, None)

    def flag_newer_epoch(self) -> None:
        """Join the next epoch at the next boundary (every member saw the same flag)."""
        self._due = True

    # -- membership and parity --------------------------------------------------------------

    def reconfigure(self) -> None:
        """Join the next published epoch and reconcile with its members."""
        assert self.membership is not None
        old = self.epoch.number
        self.drop_group()  # drop the old group first
        self.epoch = self.membership.join(old, self.join_timeout_s)
        self.settle_after_join()
        self.mark_boundary()

    def settle_after_join(self) -> None:
        """Reconcile in a freshly joined epoch; a failure moves on to the next epoch."""
        assert self.membership is not None
        while True:
            self.events.record(Reconfigured(step=self._step, epoch=self.epoch.number,
                                            members=list(self.epoch.members)))  # fmt: skip
            try:
                self.check_parity("heal")
            except RuntimeError as e:
                if isinstance(e, DistributedError):
                    raise
                self.fault(e)
                self.epoch = self.membership.join(self.epoch.number, self.join_timeout_s)
                continue
            if self._parity.last_decision is not Decision.ROLLBACK:  # rolled back on purpose
                self.membership.check_progress(self._step, self.epoch.number)
            self._due, self._changed = False, True
            return

    def check_parity(self, why: str) -> str:
        """Reconcile members (see :mod:`stalwart.elastic.parity`); returns the common digest."""
        self._step = self._parity.run(self._step, self.epoch, why)
        return self.digest()

    def rewind(self, target: int, why: str) -> None:
        """Every member restored its state of step ``target``: go back to it and verify."""
        self._step = target
        self.check_parity(why)
        self.mark_boundary()
