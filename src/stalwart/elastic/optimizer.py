"""``ElasticOptimizer``: the user's optimizer, with ``step()`` as the job's commit point."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, TypeVar

import torch

from stalwart.elastic.backup import BackupRound
from stalwart.elastic.backup_job import too_late
from stalwart.elastic.ledger import StepLedger

__all__ = ["ElasticOptimizer", "StepOwner"]

T = TypeVar("T")


class StepOwner(Protocol):
    """What the optimizer drives: :class:`~stalwart.elastic.Job` (its boundary and commit)."""

    ledger: StepLedger

    def begin_step(self) -> None:
        """The step boundary."""
        ...

    def commit(self, apply: Any) -> Any:
        """Combine the members' contributions and ``apply()``, or discard the step."""
        ...


class ElasticOptimizer:
    """Wraps a torch optimizer for :class:`~stalwart.elastic.Job` (see :meth:`Job.optimizer`).

    ``zero_grad()`` marks the step boundary (a due membership change and heal happen there);
    ``step()`` averages the gradients over the members and applies the update only if every
    member's contribution arrived, else discards the step and returns None. Everything else
    (``param_groups``, ``state``, ``state_dict`` ...) is the wrapped optimizer's.

    Args:
        optimizer: the optimizer to wrap (keep it in the job's state, not this wrapper).
        job: the job that commits.
        backups: the backup round, when the job commits with backup workers.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, job: StepOwner, backups: BackupRound | None = None
    ) -> None:
        self.optimizer = optimizer
        self.job = job
        self.backups = backups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Begin a step: start the save the last commit made due (the loop has finished that
        step: its ``scheduler.step()`` ran), reconfigure if due, then clear gradients."""
        self._start_due_save(late=False)
        self.job.begin_step()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> Any:
        """Average gradients over the members and apply them, or discard the step after a fault."""
        self._start_due_save(late=True)  # no zero_grad() since the last commit
        return self.job.commit(lambda: self.optimizer.step(closure))

    def _start_due_save(self, *, late: bool) -> None:
        checkpoint = self.job.ledger.checkpoint
        if checkpoint is not None:
            checkpoint.at_boundary(late=late)

    def too_late(self) -> bool:
        """Whether this step already committed without this member (backup workers only).

        Poll it between micro-batches; when True, skip the rest and call :meth:`step` at once
        (see :func:`stalwart.elastic.backup_job.too_late`). Always False without backup workers.
        """
        return too_late(self.job.ledger, self.backups)

    def accumulate(self, micro_batches: Sequence[T]) -> Iterator[T]:
        """This step's micro-batches, stopping early once the step committed without the rest.

        Scale each micro-batch's loss by ``1 / len(micro_batches)``. With backup workers it
        polls :meth:`too_late` between micro-batches and records the share computed, so that
        ``partial=True`` policies send that share instead of dropping it (see
        :mod:`stalwart.elastic.backup`); without, it yields every micro-batch. With a
        ``partial`` policy it also stops before a micro-batch that would end more than 10%
        after the step's ``k``-th contribution is expected (recent steps' compute times): a
        slow member sends its share when the others do instead of one micro-batch later.
        """
        backups, ledger, done, t0 = self.backups, self.job.ledger, 0, time.time()
        expected = 1.1 * backups.expected_s() if backups is not None else 0.0
        for i, item in enumerate(micro_batches):
            now = time.time()  # compute times count from the step's start (ledger.started)
            late = i > 0 and expected > 0 and now - ledger.started + (now - t0) / i > expected
            if i > 0 and (late or self.too_late()):
                break
            yield item
            done += 1
        if backups is not None and micro_batches:
            backups.share = (ledger.epoch.number, ledger.step, done / len(micro_batches))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)
