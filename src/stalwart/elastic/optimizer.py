"""``ElasticOptimizer``: the user's optimizer, with ``step()`` as the job's commit point."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from stalwart.elastic.backup import too_late

if TYPE_CHECKING:
    from stalwart.elastic.job import Job

__all__ = ["ElasticOptimizer"]


class ElasticOptimizer:
    """Wraps a torch optimizer for :class:`~stalwart.elastic.Job` (see :meth:`Job.optimizer`).

    ``zero_grad()`` marks the step boundary (a due membership change and heal happen there);
    ``step()`` averages the gradients over the members and applies the update only if every
    member's contribution arrived, else discards the step and returns None. Everything else
    (``param_groups``, ``state``, ``state_dict`` ...) is the wrapped optimizer's.

    Args:
        optimizer: the optimizer to wrap (keep it in the job's state, not this wrapper).
        job: the job that commits.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, job: Job) -> None:
        self.optimizer = optimizer
        self.job = job

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Begin a step: reconfigure first if due, then clear gradients."""
        self.job.begin_step()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> Any:
        """Average gradients over the members and apply them, or discard the step after a fault."""
        return self.job.commit(lambda: self.optimizer.step(closure))

    def too_late(self) -> bool:
        """Whether this step already committed without this member (backup workers only).

        Poll it between micro-batches; when True, skip the rest and call :meth:`step` at once
        (see :func:`stalwart.elastic.backup.too_late`). Always False without backup workers.
        """
        return too_late(self.job)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)
