"""What checkpoint operations return: results, pending saves, reports and events.

``Checkpointer.save`` returns a :class:`SaveResult`, ``save_async`` a :class:`PendingSave`,
``Checkpointer.last_load`` is a :class:`LoadResult`, ``gc`` a :class:`GCReport`;
``TieredCheckpointer.save`` returns a :class:`TieredSaveResult` and ``recover`` a
:class:`RecoveryReport`; ``options.on_event`` receives :class:`CheckpointEvent` records.
Users receive these rather than build them, so they live here and not at the front door.
"""

from __future__ import annotations

from stalwart.checkpoint.durable.async_save import PendingSave
from stalwart.checkpoint.durable.gc import GCReport
from stalwart.checkpoint.durable.results import LoadResult, SaveResult
from stalwart.checkpoint.events import CheckpointEvent
from stalwart.checkpoint.memory.tier_records import RecoveryReport, TieredSaveResult

__all__ = [
    "CheckpointEvent",
    "GCReport",
    "LoadResult",
    "PendingSave",
    "RecoveryReport",
    "SaveResult",
    "TieredSaveResult",
]
