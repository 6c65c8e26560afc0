"""Checkpoint engine: sharded, deduplicated, verified checkpoints that reshard on load.

See ``docs/format.md`` for the on-disk format and ``checkpointer.py`` for the flow.
"""

from stalwart.checkpoint.durable.async_save import PendingSave, guard
from stalwart.checkpoint.durable.checkpointer import Checkpointer
from stalwart.checkpoint.durable.gc import GCReport
from stalwart.checkpoint.durable.manifest import (
    FORMAT_VERSION,
    ChunkRef,
    Manifest,
    ShardEntry,
    TensorEntry,
)
from stalwart.checkpoint.durable.results import LoadResult, SaveResult
from stalwart.checkpoint.events import CheckpointEvent
from stalwart.checkpoint.memory.tiers import RecoveryReport, Tier, TieredCheckpointer
from stalwart.checkpoint.options import CheckpointOptions
from stalwart.checkpoint.policy import (
    AnyOf,
    EveryNSeconds,
    EveryNSteps,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLast,
    RetentionPolicy,
    SavePolicy,
)
from stalwart.checkpoint.preemption import PreemptionGuard
from stalwart.checkpoint.training_state import TrainingState

__all__ = [
    "FORMAT_VERSION",
    "AnyOf",
    "CheckpointEvent",
    "CheckpointOptions",
    "Checkpointer",
    "ChunkRef",
    "EveryNSeconds",
    "EveryNSteps",
    "GCReport",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "LoadResult",
    "Manifest",
    "PendingSave",
    "PreemptionGuard",
    "RecoveryReport",
    "RetentionPolicy",
    "SavePolicy",
    "SaveResult",
    "ShardEntry",
    "TensorEntry",
    "Tier",
    "TieredCheckpointer",
    "TrainingState",
    "guard",
]
