"""Every environment variable stalwart's library reads, read here and nowhere else.

An explicit argument wins over the environment variable, which wins over the default; the
modules that own each setting (``checkpoint/options.py``, ``elastic/protocol.py``,
``elastic/job.py``) ask this module for the raw value, so an operator's knob is found in one
table:

    STALWART_IO_THREADS              checkpoint: CheckpointOptions.io_threads
    STALWART_COMPRESSION             checkpoint: CheckpointOptions.compression
    STALWART_LEASE_S                 checkpoint: CheckpointOptions.lease_s
    STALWART_GC_GRACE_S              checkpoint: CheckpointOptions.gc_grace_s
    STALWART_MAX_INFLIGHT_SAVES      checkpoint: CheckpointOptions.max_inflight_saves
    STALWART_EXIT_FLUSH_TIMEOUT_S    checkpoint: CheckpointOptions.exit_flush_timeout_s
    STALWART_PREEMPTION_SIGNALS      checkpoint: PreemptionGuard's signals
    STALWART_ELASTIC_STORE           elastic: the coordinator's host:port (set by stalwart run)
    STALWART_ELASTIC_WORKER          elastic: this worker's id
    STALWART_ELASTIC_EVENTS          elastic: the event files' folder
    STALWART_ELASTIC_TIMEOUT_S       elastic: each epoch's gloo timeout
    STALWART_ELASTIC_HANG_S          elastic: the hang timeout (heartbeat rate)
    STALWART_ELASTIC_STORE_FILE      elastic: where a re-hosted coordinator's address appears
    RANK, WORLD_SIZE                 torchrun's world (elastic.Job's fixed-world mode)

Each module keeps its defaults and parsing; this one only reads. The test helpers
(``stalwart.testing``) read their own chaos variables, and the launcher passes its whole
environment on to the workers it starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TypeVar

from stalwart.errors import ConfigError

__all__ = [
    "CHECKPOINT_VARS",
    "ELASTIC_VARS",
    "TORCHRUN_VARS",
    "elastic_worker",
    "read",
    "setting",
    "torchrun_world",
]

T = TypeVar("T")

CHECKPOINT_VARS = (
    "STALWART_IO_THREADS",
    "STALWART_COMPRESSION",
    "STALWART_LEASE_S",
    "STALWART_GC_GRACE_S",
    "STALWART_MAX_INFLIGHT_SAVES",
    "STALWART_EXIT_FLUSH_TIMEOUT_S",
    "STALWART_PREEMPTION_SIGNALS",
)
ELASTIC_VARS = (
    "STALWART_ELASTIC_STORE",
    "STALWART_ELASTIC_WORKER",
    "STALWART_ELASTIC_EVENTS",
    "STALWART_ELASTIC_TIMEOUT_S",
    "STALWART_ELASTIC_HANG_S",
    "STALWART_ELASTIC_STORE_FILE",
)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE")
_KNOWN = frozenset(CHECKPOINT_VARS + ELASTIC_VARS + TORCHRUN_VARS)


def read(name: str) -> str | None:
    """The variable's value, stripped; None when unset or empty."""
    if name not in _KNOWN:
        raise ConfigError(f"{name} is not one of stalwart's variables: list it in {__name__}")
    raw = os.environ.get(name, "").strip()
    return raw or None


def setting(name: str, default: T, parse: Callable[[str], T]) -> Callable[[], T]:
    """A default factory: ``parse(value)`` when ``name`` is set and not empty, else ``default``.

    The factory raises :class:`~stalwart.errors.ConfigError` naming the variable when the
    value does not parse.
    """
    read(name)  # an unknown name fails now, not when the factory first runs

    def value() -> T:
        raw = read(name)
        if raw is None:
            return default
        try:
            return parse(raw)
        except ValueError as e:
            raise ConfigError(
                f"environment variable {name}={raw!r} does not parse ({e}); fix or unset it"
            ) from None

    return value


def elastic_worker() -> Mapping[str, str]:
    """The ``STALWART_ELASTIC_*`` variables that are set (``stalwart run`` sets them)."""
    return {name: value for name in ELASTIC_VARS if (value := read(name)) is not None}


def torchrun_world() -> tuple[int, int] | None:
    """``(RANK, WORLD_SIZE)`` under torchrun; None when either is unset.

    Raises:
        ConfigError: one of them is not an integer.
    """
    rank, size = read("RANK"), read("WORLD_SIZE")
    if rank is None or size is None:
        return None
    try:
        return int(rank), int(size)
    except ValueError:
        raise ConfigError(f"RANK={rank!r} / WORLD_SIZE={size!r} must be integers") from None
