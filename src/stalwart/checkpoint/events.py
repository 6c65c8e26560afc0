"""Checkpoint events (saved, failed, loaded) for a user's callback: metrics and dashboards.

Give ``CheckpointOptions(on_event=fn)``; ``fn(event)`` runs on every rank after each save
commits or fails and after each load. An asynchronous save reports from its background
thread, so ``fn`` must be thread-safe and quick (hand the event to your metrics client; do
not save or load from it). An exception in ``fn`` is logged and never fails the save or load.
Ready-made listeners for TensorBoard, Prometheus and Weights & Biases are in
:mod:`stalwart.integrations.events`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["CheckpointEvent", "EventListener", "emit"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointEvent:
    """One thing that happened to a checkpoint.

    Attributes:
        kind: ``"save"`` (committed), ``"save_failed"`` (nothing committed), ``"load"``, or
            ``"recover"`` (``TieredCheckpointer.recover``; ``metadata["source"]`` is the tier).
        step: the step saved or loaded.
        url: the checkpoint root.
        rank: this process's rank in the checkpointer's group (0 alone).
        seconds: wall time of the save (from the call, background time included) or load.
        bytes_total: logical bytes of the saved state (summed over ranks).
        bytes_written: bytes this save wrote after deduplication (summed over ranks).
        bytes_read: bytes a load read.
        skipped: damaged steps a load with ``fallback=True`` passed over (newest first).
        error: what went wrong, for ``save_failed``.
        metadata: the save's metadata.
    """

    kind: str
    step: int
    url: str
    rank: int = 0
    seconds: float = 0.0
    bytes_total: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    skipped: tuple[int, ...] = ()
    error: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)


EventListener = Callable[[CheckpointEvent], None]


def emit(listener: EventListener | None, event: CheckpointEvent) -> None:
    """Call ``listener`` with ``event``; a failing listener is logged, never raised."""
    if listener is None:
        return
    try:
        listener(event)
    except Exception:
        log.warning(
            "on_event listener failed on %s of step %s", event.kind, event.step, exc_info=True
        )
