"""stalwart keeps PyTorch training and inference alive through faults, and explains them.

The public surface is small and listed in ``__all__`` (a test keeps it honest):
checkpoints (:class:`Checkpointer`, :class:`TrainingState`, options and retention policies)
and the exception tree (:mod:`stalwart.errors`).
"""

from typing import TYPE_CHECKING

from stalwart.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StalwartError,
    StateMismatchError,
)

if TYPE_CHECKING:
    from stalwart.checkpoint import (
        AnyOf,
        Checkpointer,
        CheckpointEvent,
        CheckpointOptions,
        EveryNSeconds,
        EveryNSteps,
        KeepAll,
        KeepBest,
        KeepEvery,
        KeepLast,
        LoadResult,
        PendingSave,
        PreemptionGuard,
        RecoveryReport,
        SaveResult,
        Tier,
        TieredCheckpointer,
        TrainingState,
    )

__version__ = "0.1.0"

__all__ = [
    "AnyOf",
    "CheckpointError",
    "CheckpointEvent",
    "CheckpointNotFoundError",
    "CheckpointOptions",
    "Checkpointer",
    "CorruptCheckpointError",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "LoadResult",
    "PendingSave",
    "PreemptionGuard",
    "RecoveryReport",
    "SaveResult",
    "StalwartError",
    "StateMismatchError",
    "Tier",
    "TieredCheckpointer",
    "TrainingState",
    "__version__",
]


def __getattr__(name: str) -> object:
    """Checkpoint names and ``stalwart.elastic`` are imported on first use, so ``import stalwart``
    (and ``import stalwart.diagnose``, which needs no torch) stays light."""
    import importlib

    if name in __all__:  # every public name not defined above comes from stalwart.checkpoint
        value = getattr(importlib.import_module("stalwart.checkpoint"), name)
        globals()[name] = value
        return value
    if name == "elastic":
        return importlib.import_module("stalwart.elastic")
    raise AttributeError(f"module 'stalwart' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
