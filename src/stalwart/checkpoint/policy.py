"""Save and retention policies: when to save, which steps to keep; small composable objects.

A retention policy looks at the committed steps (ascending) and returns the set to keep;
everything else may be deleted after a save. A save policy says whether a step is due.
Compose either kind with :class:`AnyOf` (keep or save if any policy says so)::

    AnyOf(KeepLast(3), KeepEvery(1000))      # the last three, plus every 1000th step forever
    AnyOf(EveryNSteps(500), EveryNSeconds(1800))   # every 500 steps or every half hour
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from stalwart.errors import ConfigError

__all__ = [
    "AnyOf",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepAll",
    "KeepEvery",
    "KeepLast",
    "RetentionPolicy",
    "SavePolicy",
]


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


@runtime_checkable
class SavePolicy(Protocol):
    """Decides whether ``step`` is due, given the last saved step and its time."""

    def due(self, step: int, now_s: float, last_step: int | None, last_s: float | None) -> bool:
        """True when ``step`` should be saved (``now_s``/``last_s``: ``time.monotonic()``)."""
        ...


@dataclass(frozen=True)
class EveryNSteps:
    """Save every step that is a multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"EveryNSteps(n={self.n!r}): n must be an int >= 1")

    def due(self, step: int, now_s: float, last_step: int | None, last_s: float | None) -> bool:
        return step % self.n == 0


@dataclass(frozen=True)
class EveryNSeconds:
    """Save when at least ``seconds`` passed since the last save (and at the first step)."""

    seconds: float

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ConfigError(f"EveryNSeconds(seconds={self.seconds!r}): must be > 0")

    def due(self, step: int, now_s: float, last_step: int | None, last_s: float | None) -> bool:
        return last_s is None or now_s - last_s >= self.seconds


class AnyOf:
    """Keep (or save) a step if any of the given policies keeps it (or says it is due)."""

    def __init__(self, *policies: Any) -> None:
        if not policies:
            raise ConfigError("AnyOf() needs at least one policy")
        self.policies = policies

    def keep(self, steps: Sequence[int]) -> set[int]:
        kept: set[int] = set()
        for p in self.policies:
            kept |= p.keep(steps)
        return kept

    def due(self, step: int, now_s: float, last_step: int | None, last_s: float | None) -> bool:
        return any(p.due(step, now_s, last_step, last_s) for p in self.policies)

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"
