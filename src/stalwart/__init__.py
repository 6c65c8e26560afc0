"""stalwart keeps PyTorch training and inference alive through faults, and explains them.

The front door holds what a user calls (a test keeps it small and honest): the checkpointers
(:class:`Checkpointer`, :class:`TieredCheckpointer` with its :class:`Tier`), their options,
:class:`TrainingState`, :class:`PreemptionGuard`, and the save and retention policies. The
exception tree is :mod:`stalwart.errors`; what operations return is
:mod:`stalwart.checkpoint.results`; the other packages (``stalwart.diagnose``,
``stalwart.vulnerability``, ``stalwart.elastic``, ...) have front doors of their own.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from stalwart.moved import find_moved

if TYPE_CHECKING:
    from stalwart.checkpoint import (
        AnyOf,
        Checkpointer,
        CheckpointOptions,
        EveryNSeconds,
        EveryNSteps,
        KeepAll,
        KeepBest,
        KeepEvery,
        KeepLast,
        PreemptionGuard,
        Tier,
        TieredCheckpointer,
        TrainingState,
    )

__version__ = "0.1.0"

__all__ = [
    "AnyOf",
    "CheckpointOptions",
    "Checkpointer",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "PreemptionGuard",
    "Tier",
    "TieredCheckpointer",
    "TrainingState",
    "__version__",
]

MOVED = {
    **dict.fromkeys(
        (
            "CheckpointError",
            "CheckpointNotFoundError",
            "CorruptCheckpointError",
            "StalwartError",
            "StateMismatchError",
        ),
        "stalwart.errors",
    ),
    **dict.fromkeys(
        ("CheckpointEvent", "LoadResult", "PendingSave", "RecoveryReport", "SaveResult"),
        "stalwart.checkpoint.results",
    ),
}
"""Names the front door held before 0.2, and where they live now (still found here, with a
DeprecationWarning, until the next release)."""


def __getattr__(name: str) -> object:
    """The public names, imported on first use so ``import stalwart`` (and
    ``import stalwart.diagnose``, which needs no torch) stays light; ``stalwart.elastic``; and
    the names that left the front door, found where they moved, with a warning."""
    if name in __all__:  # every public name but __version__ comes from stalwart.checkpoint
        value = getattr(importlib.import_module("stalwart.checkpoint"), name)
        globals()[name] = value
        return value
    if name == "elastic":
        return importlib.import_module("stalwart.elastic")
    return find_moved("stalwart", MOVED, name, stacklevel=3)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
