"""What erasure coding leaves on a rank: its protected snapshot, and what each call cost."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stalwart.checkpoint.memory.snapshot import Snapshot

__all__ = ["ErasureStats", "ProtectedSnapshot"]


@dataclass
class ErasureStats:
    """What one ``protect`` or ``rebuild`` cost on this rank.

    Attributes:
        total_s: wall time of the whole collective on this rank.
        codec_s: time spent in the codec (encode in protect, decode in rebuild).
        verify_s: time spent checking digests (rebuilt ranks only).
        bytes_sent: payload bytes this rank sent.
        bytes_received: payload bytes this rank received.
    """

    total_s: float = 0.0
    codec_s: float = 0.0
    verify_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0


@dataclass
class ProtectedSnapshot:
    """A rank's snapshot plus its share of its group's redundancy.

    Attributes:
        snapshot: this rank's own snapshot.
        k: data pieces per stripe.
        m: parity pieces per stripe (losses tolerated per group).
        codec: the codec's name (``xor`` or ``rs``).
        members: process-group ranks of the group, by member index.
        member: this rank's member index.
        piece_nbytes: ``S``, the length of every piece.
        lengths: every member's blob length.
        indexes: every member's snapshot index JSON (to rebuild any of them).
        parity: ``stripe -> parity piece`` this rank holds (``m`` entries).
        meta: ``stripe -> codec metadata`` for those stripes.
        protect_id: the same on every member of one protect call (survivors must agree).
        stats: what the protect cost on this rank.
    """

    snapshot: Snapshot
    k: int
    m: int
    codec: str
    members: tuple[int, ...]
    member: int
    piece_nbytes: int
    lengths: tuple[int, ...]
    indexes: tuple[bytes, ...]
    parity: dict[int, torch.Tensor]
    meta: dict[int, bytes]
    protect_id: int
    stats: ErasureStats = field(default_factory=ErasureStats)

    @property
    def step(self) -> int:
        return self.snapshot.step

    @property
    def redundancy_nbytes(self) -> int:
        """Bytes this rank keeps beyond its own snapshot (parity and peers' indexes)."""
        return sum(int(p.numel()) for p in self.parity.values()) + sum(len(b) for b in self.indexes)
