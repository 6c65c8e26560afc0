"""``AllReduceCommit``: the synchronous commit, one all-reduce per step and a vote per member.

The gradients, the float buffers, one vote per member and the newer-epoch flag travel in one
SUM all-reduce per dtype (:func:`stalwart.elastic.reduce.reduce_`) on the replicate group;
the update is applied only when every member's vote arrived, else the step is discarded on
this member. With replica groups the ranks of a group then agree (:meth:`StepLedger.agree`,
chaos point ``group-agree``) before any applies the step: a rank whose replicate all-reduce
failed makes its whole group discard, so no group holds half a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from stalwart.elastic.ledger import StepLedger
from stalwart.elastic.reduce import reduce_
from stalwart.errors import DistributedError

__all__ = ["AllReduceCommit"]

_PARTNER_FAILED = "another rank of this replica group could not reduce: the group discards"


class AllReduceCommit:
    """Commit a step when its all-reduce completed with every member's vote.

    Args:
        reduce: how gradients combine, ``"mean"`` or ``"adasum"`` (see ``reduce.py``).
    """

    def __init__(self, reduce: str = "mean") -> None:
        self.reduce = reduce

    def commit(self, ledger: StepLedger, apply: Callable[[], Any]) -> Any:
        """Reduce gradients and buffers, then ``apply()`` if every member voted; else discard."""
        control = torch.tensor([1.0, ledger.change_flag()])
        err: BaseException | None = None
        try:
            control = reduce_(ledger.params, ledger.buffers, control, ledger.group, self.reduce)
        except RuntimeError as e:
            err = e
        votes, size = float(control[0]), ledger.epoch.size
        if err is None and votes < size:  # cannot happen with gloo SUM; kept as the commit rule
            err = DistributedError(f"{votes:g} of {size} votes")
        ledger.notify("group-agree")
        ok, change = ledger.agree(err is None, float(control[1]))
        if not ok:
            ledger.discard(err or DistributedError(_PARTNER_FAILED))
            return None
        result = apply()
        ledger.commit(change=change)
        return result
