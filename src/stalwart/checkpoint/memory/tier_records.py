"""The records of the tiered checkpointer: a :class:`Tier` (where, how often, how many) and
the :class:`RecoveryReport` of a restart (which tier, which step, how long, who was rebuilt).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from stalwart.checkpoint.policy import EveryNSteps, KeepLast, RetentionPolicy, SavePolicy
from stalwart.errors import ConfigError
from stalwart.storage.base import Storage

__all__ = ["RecoveryReport", "Tier"]


@dataclass(frozen=True, kw_only=True)
class Tier:
    """One level of the checkpoint hierarchy.

    Attributes:
        name: shown in reports (``memory``, ``local``, ``remote``, ...).
        root: ``None`` for host memory (snapshots kept in this process, protected by
            erasure coding when the tiered checkpointer has ``erasure``), else a folder, an
            fsspec URL or a Storage, as for :class:`Checkpointer`.
        every: save policy (``EveryNSteps``, ``EveryNSeconds``, ``AnyOf``).
        keep: retention; the memory tier takes ``KeepLast(n)`` only (others are refused).
        storage_options: passed to fsspec for remote roots.
    """

    name: str
    root: str | os.PathLike[str] | Storage | None = None
    every: SavePolicy = field(default_factory=lambda: EveryNSteps(1))
    keep: RetentionPolicy = field(default_factory=lambda: KeepLast(2))
    storage_options: dict[str, Any] | None = None
    keep_in: str | os.PathLike[str] | None = None
    """Memory tier only: a tmpfs folder (``/dev/shm/<job>``) whose files hold the snapshots,
    so that they outlive a crashed trainer on the same node (see ``snapshot_keeper.py``)."""

    def __post_init__(self) -> None:
        if self.keep_in is not None and self.root is not None:
            raise ConfigError(f"tier {self.name!r}: keep_in is for the memory tier (root=None)")
        if not callable(getattr(self.every, "due", None)):
            raise ConfigError(f"tier {self.name!r}: every={self.every!r} is not a save policy")
        if self.root is None and not isinstance(self.keep, KeepLast):
            raise ConfigError(
                f"memory tier {self.name!r}: keep={self.keep!r}; host memory keeps the newest "
                "snapshots only, so give keep=KeepLast(n)"
            )


@dataclass
class RecoveryReport:
    """How a restarted job got its state back.

    Attributes:
        step: the step recovered.
        source: the tier used (``memory``, ``memory+erasure`` when lost ranks were rebuilt
            from peers, or a durable tier's name).
        seconds: wall time on this rank.
        rebuilt_ranks: ranks whose snapshot was rebuilt from their peers.
        attempts: ``(tier, outcome)`` for every tier tried, in order.
        tree: the loaded tree, values other than tensors included (tensors were also
            written into the state in place).
    """

    step: int
    source: str
    seconds: float
    rebuilt_ranks: list[int] = field(default_factory=list)
    attempts: list[tuple[str, str]] = field(default_factory=list)
    tree: Any = field(default=None, repr=False)
