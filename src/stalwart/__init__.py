"""stalwart keeps PyTorch training and inference alive through faults, and explains them.

The public surface is small and listed in ``__all__`` (a test keeps it honest):
checkpoints (:class:`Checkpointer`, :class:`TrainingState`, options and retention policies)
and the exception tree (:mod:`stalwart.errors`).
"""

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
from stalwart.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StalwartError,
    StateMismatchError,
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
    """``stalwart.elastic`` is imported on first use, so ``import stalwart`` stays light."""
    if name == "elastic":
        import importlib

        return importlib.import_module("stalwart.elastic")
    raise AttributeError(f"module 'stalwart' has no attribute {name!r}")
