"""Checkpoint engine: sharded, deduplicated, verified checkpoints that reshard on load.

See ``docs/format.md`` for the on-disk format and ``checkpointer.py`` for the flow.
"""

from stalwart.checkpoint.checkpointer import Checkpointer
from stalwart.checkpoint.gc import GCReport
from stalwart.checkpoint.manifest import FORMAT_VERSION, ChunkRef, Manifest, ShardEntry, TensorEntry
from stalwart.checkpoint.options import CheckpointOptions
from stalwart.checkpoint.policy import AnyOf, KeepAll, KeepEvery, KeepLast, RetentionPolicy
from stalwart.checkpoint.results import LoadResult, SaveResult
from stalwart.checkpoint.training_state import TrainingState

__all__ = [
    "FORMAT_VERSION",
    "AnyOf",
    "CheckpointOptions",
    "Checkpointer",
    "ChunkRef",
    "GCReport",
    "KeepAll",
    "KeepEvery",
    "KeepLast",
    "LoadResult",
    "Manifest",
    "RetentionPolicy",
    "SaveResult",
    "ShardEntry",
    "TensorEntry",
    "TrainingState",
]
