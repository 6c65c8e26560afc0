"""``BackupCommit``: the commit strategy of backup-worker steps (commit, catch up, abandon).

:meth:`stalwart.elastic.Job.commit` hands a step to it when the job's optimizer has backup
workers; it works through the :class:`~stalwart.elastic.ledger.StepLedger` it receives. The
protocol on the coordinator's store is :mod:`stalwart.elastic.backup`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from stalwart.elastic.backup import BackupRound
from stalwart.elastic.backup_wire import Result, set_rng_state
from stalwart.elastic.commit import AllReduceCommit
from stalwart.elastic.events import EventKind
from stalwart.elastic.ledger import StepLedger
from stalwart.elastic.protocol import decode, keys
from stalwart.errors import ConfigError

__all__ = ["BackupCommit", "check_reduce", "too_late"]


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


class BackupCommit:
    """Commit each step with the first ``n - b`` contributions, then catch up if late.

    Args:
        backups: the backup round on the coordinator's store.
    """

    def __init__(self, backups: BackupRound) -> None:
        self.backups = backups
        self.alone = AllReduceCommit()  # a member alone has nobody to wait for

    def close(self) -> None:
        """Stop the backup round's store cleaner (its thread and connection)."""
        self.backups.close()

    def commit(self, ledger: StepLedger, apply: Callable[[], Any]) -> Any:
        """Returns ``apply()``'s result for this member's step, or None when the step was
        discarded (the store timed out: a member died mid-step; the job reconfigures at the
        next boundary)."""
        if ledger.epoch.size <= 1:
            return self.alone.commit(ledger, apply)
        backups, epoch = self.backups, ledger.epoch
        gens = _generators(ledger.state)
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach() for p in ledger.params
        ]
        buffers = [b.detach() for b in ledger.buffers]
        try:
            found, ticket = backups.exchange(
                epoch=epoch.number, step=ledger.step, rank=epoch.rank, size=epoch.size,
                grads=grads, buffers=buffers, own_s=ledger.own_s, generators=gens,
                gone=lambda: _departed(ledger),
            )  # fmt: skip
        except RuntimeError as e:
            ledger.discard(e)
            return None
        abandoned = backups.gave_up(epoch.number, ledger.step)
        result = _apply(ledger, found, ticket, apply, gens, abandoned=abandoned)
        if epoch.rank in found.used:
            return result  # in time: in phase with the others, nothing to catch up
        while not ledger.reconfigure_due:  # late: catch up, then get back in phase
            try:
                later = backups.published(epoch.number, ledger.step, [*grads, *buffers])
                if later is None and (wait_s := backups.behind()) > 0:
                    later = backups.published(epoch.number, ledger.step, [*grads, *buffers], wait_s)
            except RuntimeError:
                break
            if later is None:
                break
            _apply(ledger, later, None, apply, gens)
        return result


def too_late(ledger: StepLedger, backups: BackupRound | None) -> bool:
    """Whether the current step already has its ``k`` contributions without this member.

    Poll it between micro-batches (one store read); True: skip the rest, call
    ``optimizer.step()`` (see "Abandoning a step" in :mod:`stalwart.elastic.backup`). False
    without backup workers.
    """
    if backups is None or ledger.epoch.size <= 1 or ledger.reconfigure_due:
        return False
    try:
        return backups.too_late(ledger.epoch.number, ledger.step, ledger.epoch.size)
    except RuntimeError:  # the store is gone: step() reports it
        return False


def _departed(ledger: StepLedger) -> set[int]:
    """The ranks of this epoch's members that the latest published epoch left out (a
    newcomer alone leaves nobody out; the store unreachable: none known)."""
    m = ledger.membership
    if m is None or not ledger.newer_epoch_published():
        return set()
    try:
        latest = set(decode(m.store.get(keys.members(m.latest_epoch()))))
    except RuntimeError:
        return set()
    epoch = ledger.epoch
    return {r for r in range(epoch.size) if epoch.worker(r) not in latest}


def _generators(state: Any) -> list[torch.Generator]:
    named = getattr(state, "generators", None)
    return list(named.values()) if isinstance(named, Mapping) else []


def _apply(
    ledger: StepLedger, found: Result, ticket: int | None, apply: Callable[[], Any],
    gens: Sequence[torch.Generator], abandoned: bool = False,
) -> Any:  # fmt: skip
    epoch = ledger.epoch
    ledger.events.write(EventKind.BACKUP, step=ledger.step, epoch=epoch.number, ticket=ticket,
                        used=[epoch.members[r] for r in found.used], next_k=found.next_k,
                        shares=list(found.shares), abandoned=abandoned)  # fmt: skip
    for p, g in zip(ledger.params, found.grads, strict=True):
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
    with torch.no_grad():
        for b, v in zip(ledger.buffers, found.buffers, strict=True):
            b.copy_(v)
    set_rng_state(found.rng, gens)
    result = apply()
    ledger.commit(change=found.change > 0)
    return result
