"""``AllReduceCommit``: the synchronous commit, one all-reduce per step and a vote per member.

The gradients, the float buffers, one vote per member and the newer-epoch flag travel in one
SUM all-reduce per dtype (:func:`stalwart.elastic.reduce.reduce_`); the update is applied only
when every member's vote arrived, else the step is discarded on this member.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from stalwart.elastic.ledger import StepLedger
from stalwart.elastic.reduce import reduce_
from stalwart.errors import DistributedError

__all__ = ["AllReduceCommit"]


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
        try:
            control = reduce_(ledger.params, ledger.buffers, control, ledger.group, self.reduce)
        except RuntimeError as e:
            ledger.discard(e)
            return None
        votes, change = float(control[0]), float(control[1])
        if votes < ledger.epoch.size:  # cannot happen with gloo SUM; kept as the commit rule
            ledger.discard(DistributedError(f"{votes:g} of {ledger.epoch.size} votes"))
            return None
        result = apply()
        ledger.commit(change=change > 0)
        return result
