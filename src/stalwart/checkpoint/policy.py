"""Save and retention policies: when to save, which steps to keep; small composable objects.

A retention policy looks at the committed steps (ascending) and returns the set to keep;
everything else may be deleted after a save. A save policy says whether a step is due.
Compose either kind with :class:`AnyOf` (keep or save if any policy says so)::

    AnyOf(KeepLast(3), KeepEvery(1000))      # the last three, plus every 1000th step forever
    AnyOf(KeepLast(1), KeepBest(3, metric="val_loss"))   # the newest, plus the 3 best by metric
    AnyOf(EveryNSteps(500), EveryNSeconds(1800))   # every 500 steps or every half hour

A retention policy that ranks steps by what their saves recorded (:class:`KeepBest`) sets
``uses_metadata = True`` and takes ``keep(steps, metadata=...)``, a function from a step to
its save's ``metadata``; :func:`kept_steps` is how the engine calls any policy.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from stalwart.errors import ConfigError

__all__ = [
    "AnyOf",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "RetentionPolicy",
    "SavePolicy",
    "kept_steps",
]

log = logging.getLogger(__name__)

MetadataOf = Callable[[int], Mapping[str, str]]


def _check_count(policy: str, name: str, value: object) -> None:
    """Refuse a count (of steps or checkpoints) that is not an int >= 1."""
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{policy}({name}={value!r}): {name} must be an int >= 1")


@dataclass(frozen=True)
class _CountPolicy:
    """A policy set by one count ``n``, an int >= 1 (checked when the policy is made)."""

    n: int

    def __post_init__(self) -> None:
        _check_count(type(self).__name__, "n", self.n)


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
class KeepLast(_CountPolicy):
    """Keep the newest ``n`` checkpoints."""

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(sorted(steps)[-self.n :])


@dataclass(frozen=True)
class KeepEvery(_CountPolicy):
    """Keep every checkpoint whose step is a multiple of ``n`` (milestones)."""

    def keep(self, steps: Sequence[int]) -> set[int]:
        return {s for s in steps if s % self.n == 0}


@dataclass(frozen=True)
class KeepBest:
    """Keep the ``k`` steps with the best ``metric``, read from each save's ``metadata``.

    Record the metric when saving, e.g. ``ckpt.save(step, state, metadata={"val_loss":
    f"{loss:.6g}"})``, and compose with a policy that keeps the newest steps (to resume
    from): ``AnyOf(KeepLast(1), KeepBest(3, metric="val_loss"))``. Ties go to the newer step.

    Attributes:
        k: how many of the best steps to keep.
        metric: the metadata key holding the metric (a number written as a string).
        mode: ``"min"`` (lower is better, e.g. a loss) or ``"max"`` (e.g. accuracy).
        keep_unscored: keep steps whose metadata lacks the metric or holds no finite number
            (they cannot be ranked); False lets them go unless another policy keeps them.
    """

    k: int
    metric: str
    mode: str = "min"
    keep_unscored: bool = True
    uses_metadata: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_count("KeepBest", "k", self.k)
        if self.mode not in ("min", "max"):
            raise ConfigError(f"KeepBest(mode={self.mode!r}): use 'min' or 'max'")
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(f"KeepBest(metric={self.metric!r}): name a metadata key")

    def keep(self, steps: Sequence[int], metadata: MetadataOf | None = None) -> set[int]:
        """The ``k`` best steps (and the unscored ones if ``keep_unscored``)."""
        if metadata is None:
            log.warning(
                "KeepBest(%r) got no metadata to rank steps by, so it keeps them all; use it "
                "as a Checkpointer's retention (CheckpointOptions(keep=...))",
                self.metric,
            )
            return set(steps)
        scored: list[tuple[float, int]] = []
        unscored: set[int] = set()
        for s in steps:
            value = _number(metadata(s).get(self.metric))
            if value is None:
                unscored.add(s)
            else:
                scored.append((value if self.mode == "min" else -value, -s))
        best = {-neg_step for _, neg_step in sorted(scored)[: self.k]}
        return best | unscored if self.keep_unscored else best


def _number(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None else math.nan
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def kept_steps(policy: Any, steps: Sequence[int], metadata: MetadataOf | None = None) -> set[int]:
    """``policy.keep(steps)``, handing ``metadata`` to the policies that rank by it."""
    if getattr(policy, "uses_metadata", False):
        return set(policy.keep(steps, metadata=metadata))
    return set(policy.keep(steps))


@runtime_checkable
class SavePolicy(Protocol):
    """Decides whether ``step`` is due, given the last saved step and its time."""

    def due(self, step: int, now_s: float, last_step: int | None, last_s: float | None) -> bool:
        """True when ``step`` should be saved (``now_s``/``last_s``: ``time.monotonic()``)."""
        ...


@dataclass(frozen=True)
class EveryNSteps(_CountPolicy):
    """Save every step that is a multiple of ``n``."""

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

    @property
    def uses_metadata(self) -> bool:
        """True when one of the policies ranks steps by their save's metadata."""
        return any(getattr(p, "uses_metadata", False) for p in self.policies)

    def keep(self, steps: Sequence[int], metadata: MetadataOf | None = None) -> set[int]:
        kept: set[int] = set()
        for p in self.policies:
            kept |= kept_steps(p, steps, metadata)
        return kept

    def due(self, step: int, now_s: float, last_step: int | None, last_s: float | None) -> bool:
        return any(p.due(step, now_s, last_step, last_s) for p in self.policies)

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"
