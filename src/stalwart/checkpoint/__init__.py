"""Checkpoint engine: sharded, deduplicated, verified checkpoints that reshard on load.

See ``docs/format.md`` for the on-disk format and ``checkpointer.py`` for the flow.
"""

from stalwart.checkpoint.async_save import PendingSave, guard
from stalwart.checkpoint.checkpointer import Checkpointer
from stalwart.checkpoint.gc import GCReport
from stalwart.checkpoint.manifest import FORMAT_VERSION, ChunkRef, Manifest, ShardEntry, TensorEntry
from stalwart.checkpoint.options import CheckpointOptions
from stalwart.checkpoint.policy import (
    AnyOf,
    EveryNSeconds,
    EveryNSteps,
    KeepAll,
    KeepEvery,
    KeepLast,
    RetentionPolicy,
    SavePolicy,
)
from stalwart.checkpoint.results import LoadResult, SaveResult
from stalwart.checkpoint.tiers import RecoveryReport, Tier, TieredCheckpointer
from stalwart.checkpoint.training_state import TrainingState

__all__ = [
    "FORMAT_VERSION",
    "AnyOf",
    "CheckpointOptions",
    "Checkpointer",
    "ChunkRef",
    "EveryNSeconds",
    "EveryNSteps",
    "GCReport",
    "KeepAll",
    "KeepEvery",
    "KeepLast",
    "LoadResult",
    "Manifest",
    "PendingSave",
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
