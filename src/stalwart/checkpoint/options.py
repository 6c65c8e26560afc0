"""Options of the checkpoint engine, validated once, in one place, and the checkpoint
engine's ``STALWART_*`` environment variables: their defaults and parsing live here, the
reading in :mod:`stalwart.environment` (the one module that reads the environment; its
docstring lists every variable, the elastic job's too).

An explicit argument wins over the environment variable, which wins over the default. The
variables cover what operators change without touching code:

    STALWART_IO_THREADS              CheckpointOptions.io_threads            (4)
    STALWART_COMPRESSION             CheckpointOptions.compression: none|zstd (none)
    STALWART_LEASE_S                 CheckpointOptions.lease_s               (900)
    STALWART_GC_GRACE_S              CheckpointOptions.gc_grace_s            (3600)
    STALWART_MAX_INFLIGHT_SAVES      CheckpointOptions.max_inflight_saves    (2)
    STALWART_EXIT_FLUSH_TIMEOUT_S    CheckpointOptions.exit_flush_timeout_s  (600)
    STALWART_PREEMPTION_SIGNALS      PreemptionGuard signals, e.g. TERM,USR1 (TERM,USR1)

A variable is read when the options (or the guard) are made; a value that does not parse
raises :class:`~stalwart.errors.ConfigError` naming the variable.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from stalwart.checkpoint.events import EventListener
from stalwart.checkpoint.policy import KeepAll, RetentionPolicy
from stalwart.environment import CHECKPOINT_VARS, setting
from stalwart.errors import ConfigError

__all__ = ["ENV_VARS", "CheckpointOptions", "env_signals"]

T = TypeVar("T")

ENV_VARS = CHECKPOINT_VARS


def _env(name: str, default: T, parse: Callable[[str], T]) -> Callable[[], T]:
    """A default factory: ``parse(value)`` of variable ``name`` when set, else ``default``."""
    assert name in ENV_VARS
    return setting(name, default, parse)


def _compression(raw: str) -> str | None:
    return None if raw.lower() == "none" else raw


def _signal(name: str) -> signal.Signals:
    name = name.strip().upper()
    try:
        return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except KeyError:
        raise ValueError(f"{name} is not a signal name such as TERM or USR1") from None


def env_signals(default: tuple[signal.Signals, ...]) -> tuple[signal.Signals, ...]:
    """The signals named by ``STALWART_PREEMPTION_SIGNALS`` (``TERM,USR1``), else ``default``."""
    return _env(
        "STALWART_PREEMPTION_SIGNALS",
        default,
        lambda raw: tuple(_signal(n) for n in raw.split(",") if n.strip()),
    )()


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """How a :class:`~stalwart.Checkpointer` cuts, compresses, writes and retains.

    Attributes:
        chunk_bytes: largest chunk, in bytes. Smaller chunks dedup finer but cost more
            manifest entries; tensors are cut at fixed offsets so an unchanged tensor
            always yields the same chunks.
        compression: ``None`` or ``"zstd"``. A chunk is stored compressed only when that
            makes it smaller; hashes are always of the raw bytes.
        compression_level: zstd level (1 is fast and usually enough for weights).
        io_threads: threads per process that hash, compress, read and verify chunks.
        keep: which committed steps survive after each save (default: all).
        gc_grace_s: unreferenced pack files younger than this are never collected. Saves
            and loads in flight are safe whatever the grace (their leases and locked
            temporaries protect them); the grace covers writers that take no lease.
        lease_s: how long a reader's or writer's lease protects the steps it uses. A process
            killed mid-save leaves its lease behind, which holds back retention of the
            steps it named until it expires; keep it above your longest save or load.
        max_inflight_saves: asynchronous saves that may be staged or persisting at once;
            each holds one set of host buffers. A further ``save_async`` waits.
        max_staging_bytes: the most host memory one asynchronous save stages at once, in
            bytes; ``None`` (default) copies this rank's whole state before ``save_async``
            returns. With a cap, the state is copied in windows of at most this many bytes,
            each written before the next is copied, and ``save_async`` returns once the last
            window is copied (it blocks for the writing of the others); lazy saves then copy
            everything before returning too. At least ``chunk_bytes``. Each save in flight
            holds one such buffer (``max_inflight_saves`` x the cap in all).
        exit_flush_timeout_s: at interpreter exit, how long to wait for saves in flight.
        on_event: called with a :class:`~stalwart.checkpoint.events.CheckpointEvent` after
            each save commits or fails and after each load, on every rank (from the
            background thread for asynchronous saves); see :mod:`stalwart.checkpoint.events`.

    Fields marked in the module docstring default to their ``STALWART_*`` variable.
    """

    chunk_bytes: int = 16 << 20
    compression: str | None = field(
        default_factory=_env("STALWART_COMPRESSION", None, _compression)
    )
    compression_level: int = 1
    io_threads: int = field(default_factory=_env("STALWART_IO_THREADS", 4, int))
    keep: RetentionPolicy = field(default_factory=KeepAll)
    gc_grace_s: float = field(default_factory=_env("STALWART_GC_GRACE_S", 3600.0, float))
    lease_s: float = field(default_factory=_env("STALWART_LEASE_S", 900.0, float))
    max_inflight_saves: int = field(default_factory=_env("STALWART_MAX_INFLIGHT_SAVES", 2, int))
    exit_flush_timeout_s: float = field(
        default_factory=_env("STALWART_EXIT_FLUSH_TIMEOUT_S", 600.0, float)
    )
    max_staging_bytes: int | None = None
    on_event: EventListener | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 4096:
            raise ConfigError(f"chunk_bytes={self.chunk_bytes!r}: must be an int >= 4096")
        if self.compression not in (None, "zstd"):
            raise ConfigError(f"compression={self.compression!r}: use None or 'zstd'")
        if not 1 <= self.compression_level <= 22:
            raise ConfigError(f"compression_level={self.compression_level!r}: use 1..22")
        if not isinstance(self.io_threads, int) or self.io_threads < 1:
            raise ConfigError(f"io_threads={self.io_threads!r}: must be an int >= 1")
        if not callable(getattr(self.keep, "keep", None)):
            raise ConfigError(f"keep={self.keep!r}: must be a retention policy (KeepLast, ...)")
        if not isinstance(self.max_inflight_saves, int) or self.max_inflight_saves < 1:
            raise ConfigError(f"max_inflight_saves={self.max_inflight_saves!r}: must be >= 1")
        cap = self.max_staging_bytes
        if cap is not None and (
            isinstance(cap, bool) or not isinstance(cap, int) or cap < self.chunk_bytes
        ):
            raise ConfigError(
                f"max_staging_bytes={cap!r}: must be None (stage the whole state at once) or "
                f"an int >= chunk_bytes ({self.chunk_bytes}): a staging window holds at "
                f"least one chunk, e.g. max_staging_bytes={max(self.chunk_bytes, 256 << 20)}"
            )
        if self.gc_grace_s < 0 or self.lease_s <= 0:
            raise ConfigError("gc_grace_s must be >= 0 and lease_s > 0")
        if self.on_event is not None and not callable(self.on_event):
            raise ConfigError(f"on_event={self.on_event!r}: must be a callable taking an event")
