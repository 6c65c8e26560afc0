"""Retention policies: which committed steps to keep, as small composable objects.

A policy looks at the committed steps (ascending) and returns the set to keep; everything
else may be deleted by the checkpointer after a save. Compose with :class:`AnyOf` (keep a
step if any policy keeps it)::

    AnyOf(KeepLast(3), KeepEvery(1000))   # the last three, plus every 1000th step forever
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from stalwart.errors import ConfigError

__all__ = ["AnyOf", "KeepAll", "KeepEvery", "KeepLast", "RetentionPolicy"]


@runtime_checkable
class RetentionPolicy(Protocol):
    """Decides which committed steps survive."""

    def keep(self, steps: Sequence[int]) -> set[int]:
        """Return the subset of ``steps`` (ascending) to keep."""
        ...


@dataclass(frozen=True)
class KeepAll:
    """Keep every checkpoint (the default)."""

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(steps)


@dataclass(frozen=True)
class KeepLast:
    """Keep the newest ``n`` checkpoints."""

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"KeepLast(n={self.n!r}): n must be an int >= 1")

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(sorted(steps)[-self.n :])


@dataclass(frozen=True)
class KeepEvery:
    """Keep every checkpoint whose step is a multiple of ``n`` (milestones)."""

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"KeepEvery(n={self.n!r}): n must be an int >= 1")

    def keep(self, steps: Sequence[int]) -> set[int]:
        return {s for s in steps if s % self.n == 0}


class AnyOf:
    """Keep a step if any of the given policies keeps it."""

    def __init__(self, *policies: RetentionPolicy) -> None:
        if not policies:
            raise ConfigError("AnyOf() needs at least one policy")
        self.policies = policies

    def keep(self, steps: Sequence[int]) -> set[int]:
        kept: set[int] = set()
        for p in self.policies:
            kept |= p.keep(steps)
        return kept

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"
