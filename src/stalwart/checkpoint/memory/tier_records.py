"""The records of the tiered checkpointer: a :class:`Tier` (where, how often, how many), the
:class:`TieredSaveResult` of a save (what each tier did) and the :class:`RecoveryReport` of a
restart (which tier, which step, how long, who was rebuilt).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from stalwart.checkpoint.policy import EveryNSteps, KeepLast, RetentionPolicy, SavePolicy
from stalwart.errors import ConfigError
from stalwart.storage.base import Storage

__all__ = ["RecoveryReport", "Tier", "TieredSaveResult"]


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

    Build one with :meth:`memory` or :meth:`durable`; ``Tier(name=..., root=None)`` is the
    memory tier too.
    """

    name: str
    root: str | os.PathLike[str] | Storage | None = None
    every: SavePolicy = field(default_factory=lambda: EveryNSteps(1))
    keep: RetentionPolicy = field(default_factory=lambda: KeepLast(2))
    storage_options: dict[str, Any] | None = None
    keep_in: str | os.PathLike[str] | None = None
    """Memory tier only: a tmpfs folder (``/dev/shm/<job>``) whose files hold the snapshots,
    so that they outlive a crashed trainer on the same node (see
    :mod:`stalwart.checkpoint.memory.keeper`)."""

    @classmethod
    def memory(
        cls,
        name: str = "memory",
        *,
        every: SavePolicy | None = None,
        keep: KeepLast | None = None,
        keep_in: str | os.PathLike[str] | None = None,
    ) -> Tier:
        """The host-memory tier: snapshots in this process (``keep_in``: a tmpfs folder)."""
        return cls(
            name=name, every=every or EveryNSteps(1), keep=keep or KeepLast(2), keep_in=keep_in
        )

    @classmethod
    def durable(
        cls,
        name: str,
        root: str | os.PathLike[str] | Storage,
        *,
        every: SavePolicy | None = None,
        keep: RetentionPolicy | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> Tier:
        """A durable tier under ``root`` (a folder, an fsspec URL or a Storage)."""
        if root is None:
            raise ConfigError(f"durable tier {name!r}: give a root (Tier.memory() for memory)")
        return cls(
            name=name,
            root=root,
            every=every or EveryNSteps(1),
            keep=keep or KeepLast(2),
            storage_options=storage_options,
        )

    @property
    def is_memory(self) -> bool:
        """True for the host-memory tier (no root)."""
        return self.root is None

    def __post_init__(self) -> None:
        if self.keep_in is not None and self.root is not None:
            raise ConfigError(f"tier {self.name!r}: keep_in is for the memory tier (root=None)")
        if not isinstance(self.every, SavePolicy):
            raise ConfigError(f"tier {self.name!r}: every={self.every!r} is not a save policy")
        if self.root is None and not isinstance(self.keep, KeepLast):
            raise ConfigError(
                f"memory tier {self.name!r}: keep={self.keep!r}; host memory keeps the newest "
                "snapshots only, so give keep=KeepLast(n)"
            )


@dataclass(frozen=True)
class TieredSaveResult(Mapping[str, Any]):
    """What one tiered save did, per due tier (a read-only mapping of tier name to outcome).

    Attributes:
        step: the step saved.
        outcomes: per due tier, in tier order: for a durable tier its ``SaveResult``
            (``save``) or ``PendingSave`` (``save_async``); for the memory tier the kept
            snapshot, or a Future of it (lazy ``save_async``). Empty when no tier was due.
    """

    step: int
    outcomes: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.outcomes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.outcomes)

    def __len__(self) -> int:
        return len(self.outcomes)

    @property
    def tiers(self) -> list[str]:
        """The tiers that saved this step."""
        return list(self.outcomes)


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
