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

With replica groups (``G`` ranks per group, :mod:`stalwart.elastic.groups`) the ledger's
``group`` is the replicate dimension and ``shard_group`` the member's own group:
:meth:`StepLedger.agree` sums a step's outcome over the group before any rank applies it, so
that no group ever holds half a step, and parity checks take one decision per group.

How a step's contributions are combined is a :class:`~stalwart.elastic.commit.CommitStrategy`
that receives the ledger: the all-reduce (:mod:`stalwart.elastic.commit`), backup workers
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

from stalwart.elastic.checkpointing import JobCheckpoint
from stalwart.elastic.events import (
    EventKind,
    EventLog,
    FaultDetected,
    FirstCommitAfterChange,
    Reconfigured,
    StepCommitted,
    StepDiscarded,
)
from stalwart.elastic.groups import abort_group, agree, device_of, forget_frames
from stalwart.elastic.membership import Epoch, Membership
from stalwart.elastic.parity import Decision, ParityCheck, gather_table
from stalwart.elastic.state import BoundarySnapshot, digest
from stalwart.elastic.stats import StepStats
from stalwart.errors import CheckpointNotFoundError, DistributedError, StateMismatchError

__all__ = ["FollowHook", "Listener", "StepLedger"]

log = logging.getLogger(__name__)

Listener = Callable[[str, int], None]


class FollowHook(Protocol):
    """A replacement healing while the survivors commit (:mod:`.follow_job`): ``push`` after
    the all-reduce, before the update; ``before_change`` before joining a new epoch."""

    def push(self, ledger: StepLedger, change: bool) -> None: ...

    def before_change(self, ledger: StepLedger) -> None: ...


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
        shard_group: this member's replica group, when groups have more than one rank.
    """

    def __init__(
        self, state: Any, events: EventLog, membership: Membership | None, epoch: Epoch, *,
        verify_every: int, join_timeout_s: float, stats_window: int, shard_group: Any = None,
    ) -> None:  # fmt: skip
        self.state, self.events, self.membership, self.epoch = state, events, membership, epoch
        self.verify_every, self.join_timeout_s = verify_every, join_timeout_s
        self.shard_group = shard_group
        self.params: list[torch.Tensor] = []  # the optimizer's parameters: their grads are reduced
        self.buffers: list[torch.Tensor] = []  # the model's float buffers: averaged at a commit
        self.model_buffers: list[torch.Tensor] = []  # all of them: put back on a discard
        self.own_s = 0.0  # this member's own time in the step (see stats.py)
        self.started = time.time()  # the step's start (wall clock)
        self._step = 0
        self._stats = StepStats(stats_window)
        self._parity = ParityCheck(state, events, shard_group)
        self._listeners: list[Listener] = []
        self._due = self._changed = self._begun = False  # _begun: the step is under way
        self._boundary: BoundarySnapshot | None = None
        self.checkpoint: JobCheckpoint | None = None  # the tiers (Job(checkpoint=...))
        self.follow: FollowHook | None = None  # Job(follow=True)

    # -- what strategies read ---------------------------------------------------------------

    @property
    def step(self) -> int:
        """Committed steps; equal on every member at every step boundary."""
        return self._step

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The current epoch's replicate group (None: one member, or dropped after a fault)."""
        return self.epoch.group

    @property
    def group_size(self) -> int:
        """Ranks per replica group (1: plain data parallelism)."""
        return 1 if self.shard_group is None else int(self.shard_group.size())

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
        """Tell the listeners that the step reached ``event`` (it is under way)."""
        self._begun = True
        for fn in self._listeners:
            fn(event, self._step)

    def digest(self) -> str:
        """Hex digest of the replicated state and the committed step."""
        return digest(self.state, self._step)

    def change_flag(self) -> float:
        """1.0 when this member sees a newer epoch published (checked by rank 0 only)."""
        if self.membership is None or self.epoch.rank != 0 or self.epoch.shard_rank != 0:
            return 0.0  # a lost coordinator: followed, or DistributedError (membership.py)
        return 1.0 if self.membership.latest_epoch() > self.epoch.number else 0.0

    def agree(self, ok: bool, change: float) -> tuple[bool, bool]:
        """Whether every rank of this replica group succeeded, and whether any saw the flag.

        Collective on the shard group (nothing without groups), so that a step is applied by
        all of a group's ranks or by none; a failed agreement (a rank died) fails the step.
        """
        if self.shard_group is None:
            return ok, change > 0
        try:
            votes, flags = agree(self.shard_group, [float(ok), change])
        except RuntimeError:
            return False, False
        return votes >= self.group_size, flags > 0

    def poll_epoch(self) -> None:
        """Collective: learn with every member whether a newer epoch is published (refresh)."""
        flag = torch.tensor([self.change_flag()])
        err: RuntimeError | None = None
        try:
            if self.group is not None:
                flag = flag.to(self.device)
                self.group.allreduce([flag]).wait()
        except RuntimeError as e:
            err = e
        ok, change = self.agree(err is None, float(flag[0]))
        if not ok:
            self.fault(err or DistributedError("a rank of this replica group failed a collective"))
        elif change:
            self._due = True

    @property
    def device(self) -> torch.device:
        """The device of the replicate group's collectives (CPU for gloo)."""
        return device_of(self.group)

    def table(self) -> list[tuple[int, str]]:
        """(step, digest) per replica, the same on every rank (:func:`.parity.gather_table`)."""
        return gather_table(self._step, self.digest(), self.group, self.shard_group)

    def newer_epoch_published(self) -> bool:
        """Whether the coordinator published an epoch after this one (False: unknown)."""
        m = self.membership
        try:
            return m is not None and m.latest_epoch() > self.epoch.number
        except RuntimeError:
            return False

    # -- a step's outcome -------------------------------------------------------------------

    def mark_boundary(self) -> None:
        """A step starts: snapshot the RNGs and buffers a discard puts back, start the clock."""
        self._boundary = BoundarySnapshot(self.state, self.model_buffers, self._boundary)
        self.started, self._begun = time.time(), False

    def use_buffers(self, buffers: list[torch.Tensor]) -> None:
        """``Job.data_parallel``'s model buffers: floats averaged at a commit, all put back on
        a discard, from the start of the current step if it has not begun (the first step)."""
        self.model_buffers, self.buffers = buffers, [b for b in buffers if b.is_floating_point()]
        if not self._begun:
            self.mark_boundary()

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
        if self.checkpoint is not None:  # elastic: replicate rank 0's group writes; fixed: all
            writer = self.membership is None or self.epoch.rank == 0
            self.checkpoint.after_commit(self._step, writer=writer)
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
        if self.membership is not None and self.epoch.rank == 0 == self.epoch.shard_rank:
            self.membership.record_progress(self._step)

    def discard(self, err: BaseException, *, fault: bool = True) -> None:
        """The step failed: put back its start, report the fault (if ``fault``), start again."""
        if self._boundary is not None:
            self._boundary.restore()
        self.events.record(StepDiscarded(
            step=self._step, epoch=self.epoch.number, members=list(self.epoch.members),
            dt=time.time() - self.started,
        ))  # fmt: skip
        if fault:
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
        forget_frames(err)  # its traceback's frames hold the group alive
        self.drop_group()  # closes our sockets: the peers fail fast
        self._due = True

    def drop_group(self) -> None:
        """Give up the current epoch's group: NCCL's is aborted, gloo's freed here (its
        connections close then: :func:`~stalwart.elastic.groups.forget_frames`)."""
        abort_group(self.epoch.group)
        self.epoch = self.epoch.without_group()

    def flag_newer_epoch(self) -> None:
        """Join the next epoch at the next boundary (every member saw the same flag)."""
        self._due = True

    # -- membership and parity --------------------------------------------------------------

    def reconfigure(self) -> None:
        """Join the next published epoch and reconcile with its members."""
        assert self.membership is not None
        if self.follow is not None:
            self.follow.before_change(self)
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
                self._step = self._parity.run(self._step, self.epoch, "heal")  # no digest after
                if self._parity.last_decision is not Decision.ROLLBACK:  # rolled back on purpose
                    self.resume_if_lost()
            except RuntimeError as e:
                if isinstance(e, DistributedError):
                    raise
                self.fault(e)
                self.epoch = self.membership.join(self.epoch.number, self.join_timeout_s)
                continue
            self._due, self._changed = False, True
            return

    def resume_if_lost(self) -> None:
        """At step 0 no live member holds committed state: resume from the checkpoint tiers.

        Collective over the epoch (every member is at step 0 alike after a parity check).
        Without a checkpoint, refuses to start over when the job had committed steps.

        Raises:
            DistributedError: no checkpoint attached and the job had committed steps.
            CheckpointNotFoundError, StateMismatchError: nothing to resume from, or the state
                does not fit; reported to the launcher as fatal (replacements would fail alike).
        """
        if self._step > 0:
            return
        membership = self.membership
        if self.checkpoint is None:
            if membership is not None:
                membership.check_progress(self._step, self.epoch.number)
            return
        reached = membership.progress() if membership is not None else 0
        try:
            step = self.checkpoint.resume(self.group, self.shard_group, reached, self.events)
        except (CheckpointNotFoundError, StateMismatchError) as e:
            if membership is not None:
                membership.report_fatal(f"worker {membership.wid}: {e}")
            raise
        if step is not None:
            self._step = step
            self.check_parity("resumed")  # every member holds the same bytes, or is repaired

    def agree_final(self) -> bool:
        """One round of agreeing on the final step (``Job.close``); True once all agree.

        Raises:
            DistributedError: the members split with no majority at the final step (they
                rolled back: the loop must train on), or a check failed for good.
        """
        if self._due:
            self.reconfigure()
        try:
            if len(set(self.table())) == 1:
                return True
            self.check_parity("final")
            if self.last_decision is Decision.ROLLBACK:
                raise DistributedError(
                    f"no majority at the final step: rolled back to step {self._step}, the "
                    "last agreed; train on to the total and call close() again (or make "
                    "verify_every divide the total steps, so that the check runs inside the "
                    "training loop)"
                )
        except RuntimeError as e:
            if isinstance(e, DistributedError):
                raise
            self.fault(e)
        return False

    def check_parity(self, why: str) -> str:
        """Reconcile members (see :mod:`stalwart.elastic.parity`); returns the common digest."""
        self._step = self._parity.run(self._step, self.epoch, why)
        return self.digest()

    def followed_to(self, step: int) -> None:
        """A follow rebuilt the state to the survivors' ``step``, digests checked: take it."""
        self._step = step

    def rewind(self, target: int, why: str) -> None:
        """Every member restored its state of step ``target``: go back to it and verify."""
        self._step = target
        self.check_parity(why)
        self.mark_boundary()
