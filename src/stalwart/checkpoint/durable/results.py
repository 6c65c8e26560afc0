"""What a save or a load did: the records returned to callers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LoadResult", "SaveResult"]


@dataclass(frozen=True)
class SaveResult:
    """What a save did, summed over all ranks.

    Attributes:
        step: the committed step.
        seconds: wall time of the save on this rank.
        bytes_total: logical bytes of all tensors saved (raw, before dedup/compression).
        bytes_written: bytes actually written to packs.
        bytes_reused: logical bytes not written because the store already held them.
        chunks_written: new chunks written.
        chunks_reused: chunks deduplicated.
    """

    step: int
    seconds: float
    bytes_total: int
    bytes_written: int
    bytes_reused: int
    chunks_written: int
    chunks_reused: int

    @classmethod
    def summed(cls, step: int, seconds: float, stats: Sequence[Any]) -> SaveResult:
        """The job-wide result from every rank's ``PersistStats``."""
        return cls(
            step=step,
            seconds=seconds,
            bytes_total=sum(s.bytes_total for s in stats),
            bytes_written=sum(s.bytes_written for s in stats),
            bytes_reused=sum(s.bytes_reused for s in stats),
            chunks_written=sum(s.chunks_written for s in stats),
            chunks_reused=sum(s.chunks_reused for s in stats),
        )


@dataclass
class LoadResult:
    """What the last load did.

    Attributes:
        step: the step loaded.
        seconds: wall time on this rank.
        bytes_read: stored bytes read by this rank (all verified).
        skipped: ``(step, reason)`` for newer steps passed over by ``fallback=True``.
        mismatched: problems ignored because ``strict=False``.
    """

    step: int
    seconds: float
    bytes_read: int
    skipped: list[tuple[int, str]] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
