"""Point-to-point transfers of an erasure group: posted now, waited on together, counted."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from stalwart.checkpoint.memory.erasure_records import ErasureStats
from stalwart.errors import DistributedError

if TYPE_CHECKING:
    from stalwart.checkpoint.memory.erasure import ErasureGroup

__all__ = ["TAG_STRIDE", "PeerTransfers"]

TAG_STRIDE = 4096
"""gloo tag = message kind * TAG_STRIDE + stripe: unique per pair of ranks and call."""


class PeerTransfers:
    """Point-to-point sends and receives posted now, waited on later, with byte counts."""

    def __init__(self, eg: ErasureGroup, stats: ErasureStats) -> None:
        self.eg, self.stats = eg, stats
        self.works: list[tuple[Any, str]] = []
        self.keep: list[torch.Tensor] = []  # tensors in flight stay alive until wait()

    def send(self, t: torch.Tensor, member: int, kind: int, stripe: int = 0) -> None:
        if t.numel() == 0:
            return
        dst = self.eg._global(self.eg.members[member])
        w = dist.isend(t, dst=dst, group=self.eg.pg, tag=kind * TAG_STRIDE + stripe)
        self.works.append((w, f"send to member {member} (rank {dst})"))
        self.keep.append(t)
        self.stats.bytes_sent += int(t.numel())

    def recv(self, t: torch.Tensor, member: int, kind: int, stripe: int = 0) -> None:
        if t.numel() == 0:
            return
        src = self.eg._global(self.eg.members[member])
        w = dist.irecv(t, src=src, group=self.eg.pg, tag=kind * TAG_STRIDE + stripe)
        self.works.append((w, f"receive from member {member} (rank {src})"))
        self.keep.append(t)
        self.stats.bytes_received += int(t.numel())

    def wait(self) -> None:
        timeout = timedelta(seconds=self.eg.timeout_s)
        for w, what in self.works:
            try:
                w.wait(timeout)
            except RuntimeError as e:
                raise DistributedError(
                    f"erasure group {self.eg.group_index}: {what} failed or timed out after "
                    f"{self.eg.timeout_s:g}s ({e}); a peer crashed or is stuck"
                ) from e
        self.works.clear()
        self.keep.clear()
