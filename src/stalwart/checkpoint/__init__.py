"""Checkpoint engine: sharded, deduplicated, verified checkpoints that reshard on load.

The front door holds what a user calls: the checkpointers, their options, the state and
preemption helpers, and the save and retention policies. What operations return lives in
:mod:`stalwart.checkpoint.results`, the format's records in :mod:`stalwart.checkpoint.format`,
the policy protocols in :mod:`stalwart.checkpoint.policy`. See ``docs/format.md`` for the
on-disk format and ``durable/checkpointer.py`` for the flow.
"""

from __future__ import annotations

from stalwart.checkpoint import results
from stalwart.checkpoint.durable.checkpointer import Checkpointer
from stalwart.checkpoint.memory.tiers import Tier, TieredCheckpointer
from stalwart.checkpoint.options import CheckpointOptions
from stalwart.checkpoint.policy import (
    AnyOf,
    EveryNSeconds,
    EveryNSteps,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLast,
)
from stalwart.checkpoint.preemption import PreemptionGuard
from stalwart.checkpoint.training_state import TrainingState
from stalwart.moved import moved_getattr

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
]

MOVED = {
    **dict.fromkeys(
        ("FORMAT_VERSION", "ChunkRef", "Manifest", "ShardEntry", "TensorEntry"),
        "stalwart.checkpoint.format",
    ),
    **dict.fromkeys(results.__all__, results.__name__),  # every result type, one list of them
    "RetentionPolicy": "stalwart.checkpoint.policy",
    "SavePolicy": "stalwart.checkpoint.policy",
    "guard": "stalwart.checkpoint.durable.async_save",
}
"""Names this package exported before 0.2, and where they live now (importable from here,
with a DeprecationWarning, until the next release)."""


__getattr__ = moved_getattr(__name__, MOVED, hints={"guard": "Checkpointer.guard(optimizer)"})
