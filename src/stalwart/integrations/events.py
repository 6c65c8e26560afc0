"""Checkpoint events to TensorBoard, Prometheus and Weights & Biases: one listener each.

Each function returns a callable for ``CheckpointOptions(on_event=...)``; combine several
with :func:`fan_out`. Only rank 0 reports by default (every rank gets the events; a
dashboard usually wants one line per job). The listener runs in the background save thread
for asynchronous saves: each of these clients is thread-safe for what they do here.

    from torch.utils.tensorboard import SummaryWriter
    from stalwart.integrations.events import tensorboard_listener
    ckpt = stalwart.Checkpointer(
        "runs/exp1", stalwart.CheckpointOptions(on_event=tensorboard_listener(SummaryWriter()))
    )
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stalwart.checkpoint.events import CheckpointEvent, EventListener

__all__ = ["fan_out", "prometheus_listener", "tensorboard_listener", "wandb_listener"]


def fan_out(*listeners: EventListener) -> EventListener:
    """One listener that calls each of ``listeners`` in turn."""

    def call(event: CheckpointEvent) -> None:
        for listener in listeners:
            listener(event)

    return call


def _rank0(fn: Callable[[CheckpointEvent], None], all_ranks: bool) -> EventListener:
    def call(event: CheckpointEvent) -> None:
        if all_ranks or event.rank == 0:
            fn(event)

    return call


def tensorboard_listener(writer: Any, *, all_ranks: bool = False) -> EventListener:
    """Scalars under ``checkpoint/`` of a ``torch.utils.tensorboard.SummaryWriter``, by step.

    Saves log ``checkpoint/save_seconds``, ``checkpoint/bytes_written`` and
    ``checkpoint/dedup_ratio``; loads ``checkpoint/load_seconds``; failures
    ``checkpoint/save_failures`` (1 at the failed step).
    """

    def write(e: CheckpointEvent) -> None:
        if e.kind == "save":
            writer.add_scalar("checkpoint/save_seconds", e.seconds, e.step)
            writer.add_scalar("checkpoint/bytes_written", e.bytes_written, e.step)
            if e.bytes_written:
                writer.add_scalar("checkpoint/dedup_ratio", e.bytes_total / e.bytes_written, e.step)
        elif e.kind == "load":
            writer.add_scalar("checkpoint/load_seconds", e.seconds, e.step)
        else:
            writer.add_scalar("checkpoint/save_failures", 1, e.step)
        writer.flush()

    return _rank0(write, all_ranks)


def prometheus_listener(
    registry: Any = None, *, prefix: str = "stalwart", all_ranks: bool = False
) -> EventListener:
    """Counters and gauges in a ``prometheus_client`` registry (default: the global one).

    ``{prefix}_checkpoint_events_total{kind=...}``, ``{prefix}_checkpoint_seconds{kind=...}``
    (a histogram), ``{prefix}_checkpoint_bytes_written_total`` and
    ``{prefix}_checkpoint_last_step{kind=...}``. Serve them with
    ``prometheus_client.start_http_server`` or push them to a gateway.
    """
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    reg = REGISTRY if registry is None else registry
    events = Counter(
        f"{prefix}_checkpoint_events", "Checkpoint events by kind", ["kind"], registry=reg
    )
    seconds = Histogram(
        f"{prefix}_checkpoint_seconds", "Save and load wall time", ["kind"], registry=reg
    )
    written = Counter(
        f"{prefix}_checkpoint_bytes_written", "Bytes written after dedup", registry=reg
    )
    last = Gauge(f"{prefix}_checkpoint_last_step", "Last step by kind", ["kind"], registry=reg)

    def record(e: CheckpointEvent) -> None:
        events.labels(kind=e.kind).inc()
        seconds.labels(kind=e.kind).observe(e.seconds)
        last.labels(kind=e.kind).set(e.step)
        written.inc(e.bytes_written)

    return _rank0(record, all_ranks)


def wandb_listener(run: Any, *, all_ranks: bool = False) -> EventListener:
    """``run.log`` of ``checkpoint/*`` values (a ``wandb.init()`` run; offline mode works).

    Logged without a ``step=`` (W&B steps must only grow; a load goes back in steps): the
    training step is a value, ``checkpoint/step``.
    """

    def log(e: CheckpointEvent) -> None:
        values: dict[str, Any] = {"checkpoint/step": e.step, "checkpoint/kind": e.kind}
        values[f"checkpoint/{e.kind}_seconds"] = e.seconds
        if e.kind == "save":
            values["checkpoint/bytes_written"] = e.bytes_written
        run.log(values)

    return _rank0(log, all_ranks)
