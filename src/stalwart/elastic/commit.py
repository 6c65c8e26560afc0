"""``AllReduceCommit``: the synchronous commit, one all-reduce per step and a vote per member.

The gradients, the float buffers, one vote per member and the newer-epoch flag travel in one
SUM all-reduce per dtype (:func:`stalwart.elastic.reduce.reduce_`) on the replicate group;
the update is applied only when every member's vote arrived, else the step is discarded on
this member. With replica groups the ranks of a group then agree (:meth:`StepLedger.agree`,
chaos point ``group-agree``) before any applies the step: a rank whose replicate all-reduce
failed makes its whole group discard, so no group holds half a step.

In-reduction signals (without replica groups): the control vector also carries, per member
slot (its rank), a flag for non-finite gradients (a NaN, an infinity or an overflowing norm)
and the squared local gradient norm, 2·W floats. Every member sees the same sums, so every
member decides alike (:func:`grad_signals`): a non-finite flag names the member (``SdcSuspect``,
``decided_by="nonfinite-count"``) and the step is discarded on every member without a fault
(the retried step recomputes; non-finite again at the same step is not transient: every member
raises ``DistributedError``); a norm above ``grad_norm_k`` times the median of the others' (≥ 3
members with gradients, off at 0) is recorded (``decided_by="grad-norm"``) and the step kept.
A member whose norm is 0 computed nothing this step (an empty ``ElasticSampler`` share at the
end of a data epoch: no backward, so no gradient or a zeroed one) and is left out of the rule.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from stalwart.elastic.events import SdcSuspect
from stalwart.elastic.ledger import StepLedger
from stalwart.elastic.reduce import reduce_
from stalwart.elastic.sdc import leave_if_excluded
from stalwart.errors import ConfigError, DistributedError

__all__ = ["DEFAULT_GRAD_NORM_K", "AllReduceCommit", "CommitStrategy", "grad_signals"]

_PARTNER_FAILED = "another rank of this replica group could not reduce: the group discards"
DEFAULT_GRAD_NORM_K = 10.0  # a member's squared-norm root this many times the others' median


def grad_signals(
    nonfinite: Sequence[float], norms_sq: Sequence[float], k: float
) -> tuple[list[int], list[int]]:
    """The member slots with non-finite gradients, and those whose norm is an outlier.

    A slot's norm (the root of ``norms_sq``) is an outlier when it exceeds ``k`` times the
    median of the other slots' norms. Only slots with finite, non-zero norms take part (a norm
    of 0: the member computed no gradient this step), and only when ≥ 3 of them do; never
    when ``k`` is 0.
    """
    bad = [i for i, n in enumerate(nonfinite) if n > 0]
    norms = {i: max(float(s), 0.0) ** 0.5 for i, s in enumerate(norms_sq) if i not in bad}
    computed = {i: n for i, n in norms.items() if n > 0}
    outliers: list[int] = []
    if k > 0 and len(computed) >= 3:
        for i, n in computed.items():
            median = statistics.median(m for j, m in computed.items() if j != i)
            if median > 0 and n > k * median:
                outliers.append(i)
    return bad, outliers


def _local_signals(params: list[torch.Tensor]) -> tuple[float, float]:
    """This member's non-finite flag (1.0: a gradient holds a NaN or an infinity, or its norm
    overflows) and its squared gradient norm: one read of the gradients, no copies, and one
    host synchronisation (the norm of the per-tensor norms), not one per parameter."""
    norms = [torch.linalg.vector_norm(p.grad.detach()) for p in params if p.grad is not None]
    if not norms:
        return 0.0, 0.0
    device = norms[0].device
    sq = float(torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))) ** 2
    return (0.0, sq) if math.isfinite(sq) else (1.0, 0.0)


class CommitStrategy(Protocol):
    """How a step's contributions are combined before its update is applied (the all-reduce
    below, or backup workers in :mod:`stalwart.elastic.backup_job`); ``close()`` releases
    what the strategy holds (threads, connections) when the job closes."""

    def commit(self, ledger: StepLedger, apply: Callable[[], Any]) -> Any:
        """Combine the contributions, ``apply()`` and ``ledger.commit(...)``; or
        ``ledger.discard(err)`` and return None."""

    def close(self) -> None: ...


class AllReduceCommit:
    """Commit a step when its all-reduce completed with every member's vote.

    Args:
        reduce: how gradients combine, ``"mean"`` or ``"adasum"`` (see ``reduce.py``).
        grad_norm_k: the gradient-norm outlier factor (see :func:`grad_signals`; 0: off).
    """

    def __init__(self, reduce: str = "mean", grad_norm_k: float = DEFAULT_GRAD_NORM_K) -> None:
        if grad_norm_k < 0:
            raise ConfigError(f"grad_norm_k={grad_norm_k}: use 0 (off) or a factor > 0")
        self.reduce, self.grad_norm_k = reduce, grad_norm_k
        self._nonfinite_at: int | None = None  # the step last discarded for non-finite gradients

    def close(self) -> None:
        """Nothing to release."""

    def commit(self, ledger: StepLedger, apply: Callable[[], Any]) -> Any:
        """Reduce gradients and buffers, then ``apply()`` if every member voted; else discard."""
        size, signals = ledger.epoch.size, ledger.group_size == 1
        control = torch.zeros(2 + (2 * size if signals else 0))
        control[0], control[1] = 1.0, ledger.change_flag()
        if signals:
            rank = ledger.epoch.rank
            control[2 + rank], control[2 + size + rank] = _local_signals(ledger.params)
        err: BaseException | None = None
        try:
            control = reduce_(ledger.params, ledger.buffers, control, ledger.group, self.reduce)
        except RuntimeError as e:
            err = e
        votes = float(control[0])
        if err is None and votes < size:  # cannot happen with gloo SUM; kept as the commit rule
            err = DistributedError(f"{votes:g} of {size} votes")
        if err is None and signals and self._suspects(ledger, control[2:].tolist(), size):
            ledger.discard(DistributedError("non-finite gradients"), fault=False)
            if control[2 + ledger.epoch.rank] > 0:  # this member's: the exclusion policy
                leave_if_excluded(ledger.epoch.worker(ledger.epoch.rank))
            return None
        ledger.notify("group-agree")
        ok, change = ledger.agree(err is None, float(control[1]))
        if not ok:
            ledger.discard(err or DistributedError(_PARTNER_FAILED))
            return None
        if ledger.follow is not None:  # a replacement follows: the reduced step goes to it
            ledger.follow.push(ledger, change)
        result = apply()
        ledger.commit(change=change)
        return result

    def _suspects(self, ledger: StepLedger, sums: list[float], size: int) -> bool:
        """Record the signals' suspects; True when a member's gradients were non-finite."""
        bad, outliers = grad_signals(sums[:size], sums[size:], self.grad_norm_k)
        if bad and self._nonfinite_at == ledger.step:  # every member sees the same sums
            raise DistributedError(
                f"gradients non-finite again at step {ledger.step} on worker(s) "
                f"{[ledger.epoch.worker(i) for i in bad]} after a retry: not a transient fault "
                "(the model diverged, or a device is persistently faulty); lower the learning "
                "rate or exclude that host, and resume from the last checkpoint"
            )
        self._nonfinite_at = ledger.step if bad else None
        for slot, rule in [(i, "nonfinite-count") for i in bad] + [
            (i, "grad-norm") for i in outliers
        ]:
            ledger.events.record(SdcSuspect(
                step=ledger.step, epoch=ledger.epoch.number, suspect=ledger.epoch.worker(slot),
                tensor=None, decided_by=rule,
            ))  # fmt: skip
        return bool(bad)
