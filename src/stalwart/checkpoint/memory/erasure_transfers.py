"""Point-to-point transfers of an erasure group: posted now, waited on together, counted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from stalwart.checkpoint.memory.erasure_records import ErasureStats
from stalwart.errors import DistributedError

__all__ = ["TAG_STRIDE", "PeerRoute", "PeerTransfers"]

TAG_STRIDE = 4096
"""gloo tag = message kind * TAG_STRIDE + stripe: unique per pair of ranks and call."""


@dataclass(frozen=True)
class PeerRoute:
    """Where an erasure group's messages go: what transfers need to know of the group.

    Attributes:
        ranks: the global rank of each member, in member order.
        pg: the process group the transfers use (None: the default group).
        timeout_s: how long a transfer may take before the peer counts as lost.
        group_index: the erasure group's index (for messages).
    """

    ranks: tuple[int, ...]
    pg: Any
    timeout_s: float
    group_index: int


class PeerTransfers:
    """Point-to-point sends and receives posted now, waited on later, with byte counts."""

    def __init__(self, route: PeerRoute, stats: ErasureStats) -> None:
        self.route, self.stats = route, stats
        self.works: list[tuple[Any, str]] = []
        self.keep: list[torch.Tensor] = []  # tensors in flight stay alive until wait()

    def send(self, t: torch.Tensor, member: int, kind: int, stripe: int = 0) -> None:
        self.stats.bytes_sent += self._post(dist.isend, t, member, kind, stripe, "send to")

    def recv(self, t: torch.Tensor, member: int, kind: int, stripe: int = 0) -> None:
        self.stats.bytes_received += self._post(dist.irecv, t, member, kind, stripe, "receive from")

    def _post(
        self,
        op: Callable[..., Any],
        t: torch.Tensor,
        member: int,
        kind: int,
        stripe: int,
        what: str,
    ) -> int:
        """Start ``op`` (``dist.isend`` or ``dist.irecv``) of ``t`` with ``member``; its bytes."""
        if t.numel() == 0:
            return 0
        peer = self.route.ranks[member]
        w = op(t, peer, group=self.route.pg, tag=kind * TAG_STRIDE + stripe)
        self.works.append((w, f"{what} member {member} (rank {peer})"))
        self.keep.append(t)
        return int(t.numel())

    def wait(self) -> None:
        timeout = timedelta(seconds=self.route.timeout_s)
        for w, what in self.works:
            try:
                w.wait(timeout)
            except RuntimeError as e:
                raise DistributedError(
                    f"erasure group {self.route.group_index}: {what} failed or timed out after "
                    f"{self.route.timeout_s:g}s ({e}); a peer crashed or is stuck"
                ) from e
        self.works.clear()
        self.keep.clear()
