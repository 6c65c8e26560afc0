"""Options of the checkpoint engine, validated once, in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

from stalwart.checkpoint.policy import KeepAll, RetentionPolicy
from stalwart.errors import ConfigError

__all__ = ["CheckpointOptions"]


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
        gc_grace_s: unreferenced pack files younger than this are never collected, so a
            save in flight in another process is safe from garbage collection.
        lease_s: how long a reader's or writer's lease protects the steps it uses. A process
            killed mid-save leaves its lease behind, which holds back retention of the
            steps it named until it expires; keep it above your longest save or load.
        max_inflight_saves: asynchronous saves that may be staged or persisting at once;
            each holds one set of host buffers. A further ``save_async`` waits.
        exit_flush_timeout_s: at interpreter exit, how long to wait for saves in flight.
    """

    chunk_bytes: int = 16 << 20
    compression: str | None = None
    compression_level: int = 1
    io_threads: int = 4
    keep: RetentionPolicy = field(default_factory=KeepAll)
    gc_grace_s: float = 3600.0
    lease_s: float = 900.0
    max_inflight_saves: int = 2
    exit_flush_timeout_s: float = 600.0

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
        if self.gc_grace_s < 0 or self.lease_s <= 0:
            raise ConfigError("gc_grace_s must be >= 0 and lease_s > 0")
