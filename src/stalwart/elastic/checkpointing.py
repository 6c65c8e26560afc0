"""``JobCheckpoint``: the checkpoint tiers a :class:`~stalwart.elastic.Job` holds.

``Job(state, checkpoint=ck)`` (a :class:`~stalwart.checkpoint.Checkpointer` or a
:class:`~stalwart.checkpoint.TieredCheckpointer`) gives the job two duties:

* **Resume by itself.** When no live member holds the committed state (the job starts; every
  holder died at once; a whole ``stalwart run`` was started again), every member resumes
  *together* through the :class:`~stalwart.elastic.ladder.RecoveryLadder` (replicated: one
  verified copy per shard is enough; replica groups share along the replicate dimension), the
  job's step becomes the report's step, and a ``resumed`` event records the steps lost. When
  the job had committed steps and nothing verifies, the error is reported to the launcher as
  fatal (:meth:`~stalwart.elastic.membership.Membership.report_fatal`): it stops at once.
* **Save on the checkpointer's own schedule**, at the step boundary after each commit (the
  next ``zero_grad()``, or ``Job.close``: the loop's ``scheduler.step()`` has run by then): a
  :class:`~stalwart.checkpoint.TieredCheckpointer` decides per tier (its memory tier every step
  it says, durable tiers on their intervals); a plain :class:`~stalwart.checkpoint.Checkpointer`
  every ``save_every`` steps. Each shard is written once: under ``stalwart run`` only the
  replica group of replicate rank 0 saves (its ranks together, on the checkpointer's process
  group: under ``stalwart run`` the default one, ``job.shard_group``); the others hold the
  same bytes (parity is checked). In a fixed world (torchrun, one process) every rank calls
  the save and the checkpointer's process group decides who writes what. Saves are asynchronous
  (``save_async``): the step is not blocked by persisting. A step saved again (replayed after a
  parity rollback, or written by an earlier writer before a resume) passes ``overwrite=True``.

The durable roots must be the same for every member (a shared filesystem or object store):
whoever is replicate rank 0 of the current epoch writes there.
"""

from __future__ import annotations

import logging
from typing import Any

from stalwart.checkpoint import Checkpointer, TieredCheckpointer
from stalwart.elastic.events import EventLog, Resumed
from stalwart.elastic.ladder import LadderReport, RecoveryLadder
from stalwart.errors import (
    CheckpointError,
    ConfigError,
    StorageError,
)

__all__ = ["JobCheckpoint"]

log = logging.getLogger(__name__)


class JobCheckpoint:
    """Resume a job from its checkpoint tiers, and save it on their schedules.

    Args:
        checkpoint: a Checkpointer or a TieredCheckpointer (module docstring).
        state: the job's state (what is saved and loaded).
        save_every: a plain Checkpointer's interval in committed steps (0: never save; a
            TieredCheckpointer's tiers have their own policies and ignore it).
    """

    def __init__(
        self, checkpoint: Checkpointer | TieredCheckpointer, state: Any, *, save_every: int = 100
    ) -> None:
        if not isinstance(checkpoint, (Checkpointer, TieredCheckpointer)):
            raise ConfigError(
                f"Job(checkpoint=...) takes a Checkpointer or a TieredCheckpointer, got "
                f"{type(checkpoint).__name__}"
            )
        if save_every < 0:
            raise ConfigError(f"Job(save_every={save_every}): must be >= 0 (0: never save)")
        self.checkpoint, self.state, self.save_every = checkpoint, state, save_every
        self.ladder = RecoveryLadder(checkpoint, replicated=True)
        self.last_report: LadderReport | None = None
        self._high = 0  # the newest step saved or known here: saving it again overwrites
        self._due: tuple[int, bool] | None = None  # (step, overwrite) to save at the boundary
        self._warned_late = False

    def resume(
        self, group: Any, shard_group: Any, last_committed: int, events: EventLog
    ) -> int | None:
        """Collective: every member loads the same verified step; returns it (None: none).

        Raises:
            CheckpointNotFoundError: ``last_committed`` > 0 (or steps were listed) and nothing
                verifies on every member.
            StateMismatchError: the state does not fit the stored step.
        """
        report = self.ladder.resume(
            self.state, group, shard_group=shard_group, last_committed=last_committed or None
        )
        if report is None:
            return None
        self.last_report = report
        self._high = max(self._high, report.last_known)
        rejected = [[r.step, r.tier, list(r.ranks), r.reason] for r in report.rejected]
        events.record(Resumed(step=report.step, tier=report.tier, steps_lost=report.steps_lost,
                              last_known=report.last_known, source=report.source,
                              rejected=rejected))  # fmt: skip
        return report.step

    def after_commit(self, step: int, *, writer: bool) -> None:
        """Note ``step`` for a save where the schedule says so (``writer``: this member
        saves); :meth:`at_boundary` starts it."""
        if not writer:
            return
        overwrite = step <= self._high
        self._high = max(self._high, step)
        tiered = isinstance(self.checkpoint, TieredCheckpointer)  # its tiers decide
        if tiered or (self.save_every and step % self.save_every == 0):
            self._due = (step, overwrite)

    def at_boundary(self, *, late: bool = False) -> None:
        """Start the save noted at the last commit. The commit runs inside
        ``optimizer.step()``; the loop then finishes the step (``scheduler.step()``, the data
        iterator, a step counter) before the next ``zero_grad()`` ends it, so the save waits
        for that boundary, or for ``Job.close``, to hold the step as a resumed run needs it.
        ``late``: the next step's ``optimizer.step()`` came first (no ``zero_grad()`` of the
        job's optimizer in between): the save still runs, with a warning, once."""
        if self._due is None:
            return
        (step, overwrite), self._due = self._due, None
        if late and not self._warned_late:
            self._warned_late = True
            log.warning(
                "step %d is saved at the next optimizer.step(): the job's optimizer.zero_grad() "
                "was not called in between, so the save holds that step's RNG and data position "
                "one batch late; call the job optimizer's zero_grad() at each step's start",
                step,
            )
        try:
            self.checkpoint.save_async(step, self.state, overwrite=overwrite)
        except (CheckpointError, StorageError) as e:  # training goes on; older steps stay
            log.warning("saving step %d failed (the job trains on): %s", step, e)

    def wait(self) -> None:
        """Start a save still due, then wait for the saves in flight (``Job.close``)."""
        self.at_boundary()
        self.checkpoint.wait()
