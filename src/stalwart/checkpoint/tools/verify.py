"""Verify committed checkpoints of a root: one step or all of them, with progress.

The check itself (parse the manifest afresh, read each distinct chunk once, compare hashes,
report every damaged item) is the engine's:
:mod:`stalwart.checkpoint.durable.verification`; this module runs it over a checkpointer's
steps for the CLI and scripts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from stalwart.checkpoint.durable.checkpointer import Checkpointer
from stalwart.checkpoint.durable.verification import Progress, VerifyReport, reader_lease
from stalwart.errors import CheckpointNotFoundError

__all__ = ["VerifyReport", "reader_lease", "verify_all", "verify_step"]

log = logging.getLogger(__name__)


def verify_step(
    ckpt: Checkpointer,
    step: int,
    *,
    pool: ThreadPoolExecutor | None = None,
    progress: Progress | None = None,
) -> VerifyReport:
    """Read and hash every chunk of ``step`` and report every damaged item.

    Args:
        ckpt: the checkpointer of the root to check.
        step: a committed step.
        pool: threads that read and hash chunks; a pool of ``options.io_threads`` by default.
        progress: called as ``progress(done, total)`` after each distinct chunk.

    Returns:
        The report; ``ok`` is False when anything is damaged (including the manifest).

    Raises:
        CheckpointNotFoundError: the root or the step does not exist.
    """
    return ckpt.verify(step, pool=pool, progress=progress)


def verify_all(
    ckpt: Checkpointer,
    *,
    pool: ThreadPoolExecutor | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> list[VerifyReport]:
    """Verify every committed step, oldest first.

    Args:
        ckpt: the checkpointer of the root to check.
        pool: threads that read and hash chunks; the checkpointer's by default.
        progress: called as ``progress(step, done, total)`` after each distinct chunk.

    Raises:
        CheckpointNotFoundError: the root does not exist.
    """
    _ = ckpt.storage  # a missing root is an error, not an empty success
    reports = []
    for step in ckpt.steps():
        cb = None if progress is None else _for_step(progress, step)
        try:
            reports.append(verify_step(ckpt, step, pool=pool, progress=cb))
        except CheckpointNotFoundError:
            log.info("step %s was deleted while verifying; skipped", step)
    return reports


def _for_step(progress: Callable[[int, int, int], None], step: int) -> Progress:
    def cb(done: int, total: int) -> None:
        progress(step, done, total)

    return cb
