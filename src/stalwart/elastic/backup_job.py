"""The job's side of backup-worker steps: commit, catch up, and the abandon check.

Package-internal: :meth:`stalwart.elastic.Job.commit` delegates here when the job's optimizer
has backup workers; the protocol itself is :mod:`stalwart.elastic.backup`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from stalwart.elastic.backup import BackupRound
from stalwart.elastic.backup_wire import Result, set_rng_state
from stalwart.errors import ConfigError

if TYPE_CHECKING:
    from stalwart.elastic.job import Job

__all__ = ["check_reduce", "commit_with_backup", "too_late"]


def check_reduce(reduce: str, backup: bool) -> None:
    """Refuse backup workers with a reduction other than the mean: a backup step combines the
    contributions through the coordinator's store as a weighted mean of the rows computed, so
    ``data_parallel(reduce="adasum")`` would silently average instead."""
    if backup and reduce != "mean":
        raise ConfigError(
            f"backup workers average the first contributions through the coordinator and "
            f"cannot combine them by data_parallel(reduce={reduce!r}): use reduce='mean' with "
            "backup workers, or backup=0 to keep Adasum"
        )


def commit_with_backup(job: Job, backups: BackupRound, apply: Callable[[], Any]) -> Any:
    """Commit ``job``'s step with the first ``n - b`` contributions, then catch up if late.

    Returns ``apply()``'s result for this member's step, or None when the step was discarded
    (the store timed out: a member died mid-step; the job reconfigures at the next boundary).
    """
    membership = job._membership
    assert membership is not None

    def abandon() -> bool:
        try:
            return membership.latest_epoch() > job.epoch
        except RuntimeError:
            return False

    gens = _generators(job.state)
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach() for p in job._params]
    buffers = [b.detach() for b in job._buffers]
    try:
        found, ticket = backups.exchange(
            epoch=job.epoch, step=job.step, rank=job.rank, size=job.size, grads=grads,
            buffers=buffers, own_s=job._own_s, generators=gens, abandon=abandon,
        )  # fmt: skip
    except RuntimeError as e:
        job._discard(e)
        return None
    abandoned = backups.gave_up(job.epoch, job.step)
    result = _apply(job, found, ticket, apply, gens, abandoned=abandoned)
    if job.rank in found.used:
        return result  # in time: in phase with the others, nothing to catch up
    while not job._needs_reconfigure:  # late: catch up, then get back in phase
        try:
            later = backups.published(job.epoch, job.step, [*grads, *buffers])
            if later is None and (wait_s := backups.behind()) > 0:
                later = backups.published(job.epoch, job.step, [*grads, *buffers], wait_s)
        except RuntimeError:
            break
        if later is None:
            break
        _apply(job, later, None, apply, gens)
    return result


def too_late(job: Job) -> bool:
    """Whether ``job``'s current step already has its ``k`` contributions without this member.

    Poll it between micro-batches (one store read); True: skip the rest, call
    ``optimizer.step()`` (see "Abandoning a step" above). False without backup workers.
    """
    backups = job._backups
    if backups is None or job.size <= 1 or job._needs_reconfigure:
        return False
    try:
        return backups.too_late(job.epoch, job.step, job.size)
    except RuntimeError:  # the store is gone: step() reports it
        return False


def _generators(state: Any) -> list[torch.Generator]:
    named = getattr(state, "generators", None)
    return list(named.values()) if isinstance(named, Mapping) else []


def _apply(
    job: Job, found: Result, ticket: int | None, apply: Callable[[], Any],
    gens: Sequence[torch.Generator], abandoned: bool = False,
) -> Any:  # fmt: skip
    job._events.write("backup", step=job.step, epoch=job.epoch, ticket=ticket,
                      used=[job.members[r] for r in found.used], next_k=found.next_k,
                      shares=list(found.shares), abandoned=abandoned)  # fmt: skip
    for p, g in zip(job._params, found.grads, strict=True):
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
    with torch.no_grad():
        for b, v in zip(job._buffers, found.buffers, strict=True):
            b.copy_(v)
    set_rng_state(found.rng, gens)
    result = apply()
    job._step += 1
    job._needs_reconfigure = job._needs_reconfigure or found.change > 0
    job._after_commit()
    return result
