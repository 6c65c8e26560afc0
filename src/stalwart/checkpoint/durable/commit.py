"""Commit: turn every rank's shard records into the manifest that makes a step exist.

The manifest is written last, by one rank, after every rank reported its pack durable
(see ``Saver.write``); a single atomic ``Storage.write`` makes the step visible. Before
anything is written, a :class:`SaveRequest` (checked by :func:`check_save_args` when built)
and :func:`refuse_replacing` refuse what may not be committed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stalwart.checkpoint.durable.aliases import TensorAlias
from stalwart.checkpoint.durable.integrity import MAX_TREE_DEPTH, check_skeleton
from stalwart.checkpoint.durable.manifest import (
    MAX_STEP,
    ChunkRef,
    Manifest,
    ShardEntry,
    TensorEntry,
)
from stalwart.errors import (
    ConfigError,
    CorruptCheckpointError,
    StepExistsError,
    UnsupportedValueError,
)

__all__ = ["SaveRequest", "build_manifest", "check_save_args", "refuse_replacing"]


@dataclass(frozen=True)
class SaveRequest:
    """One save as the caller asked for it, checked when built (:func:`check_save_args`).

    ``save``, ``save_async`` and a tier's ``save_captured`` build one and hand it to the
    :class:`~stalwart.checkpoint.durable.saver.Saver`, so every path checks the same things
    once and the collaborators share one signature.

    Raises:
        ConfigError: ``step`` is not a non-negative int the format holds, or ``metadata`` does
            not map str to str.
    """

    step: int
    metadata: dict[str, str] | None = None
    """Free-form strings stored in the manifest."""
    overwrite: bool = False
    """Replace ``step`` if it is committed (else :class:`StepExistsError`)."""

    def __post_init__(self) -> None:
        check_save_args(self.step, self.metadata)


def build_manifest(
    step: int,
    tensors: dict[str, tuple[str, tuple[int, ...]]],
    skeleton: dict[str, Any],
    results: list[Any],
    world_size: int,
    metadata: dict[str, str] | None,
    t0: float,
    *,
    aliases: Mapping[str, TensorAlias] | None = None,
) -> Manifest:
    """The manifest of ``step`` from the plan's tensors and every rank's persist results.

    Args:
        step: the step being committed.
        tensors: ``fqn -> (dtype, global shape)`` from the plan.
        skeleton: the merged tree skeleton.
        results: per rank, ``(shards by box key as JSON, PersistStats)``.
        world_size: ranks that saved.
        metadata: the user's string metadata.
        t0: ``time.perf_counter()`` at the start of the save, for the stats.
        aliases: leaves that are views of another leaf's memory (see ``aliases.py``).

    Raises:
        UnsupportedValueError: the skeleton is one no reader would accept (too deep).
    """
    entries = _tensor_entries(tensors, results)
    try:  # refuse here what every reader would refuse (a tree too deep to read back)
        check_skeleton(skeleton, entries)
    except CorruptCheckpointError as e:
        raise UnsupportedValueError(
            f"the state tree cannot be stored: {e}; flatten the tree (at most "
            f"{MAX_TREE_DEPTH} levels of dicts, lists and tuples)"
        ) from e
    stats = [r[1] for r in results]
    return Manifest(
        step=step,
        tensors=entries,
        skeleton=skeleton,
        world_size=world_size,
        created_unix=time.time(),
        metadata=dict(metadata or {}),
        stats={
            "bytes_total": float(sum(s.bytes_total for s in stats)),
            "bytes_written": float(sum(s.bytes_written for s in stats)),
            "bytes_reused": float(sum(s.bytes_reused for s in stats)),
            "seconds": time.perf_counter() - t0,
        },
        aliases=dict(aliases or {}),
    )


def _tensor_entries(
    tensors: dict[str, tuple[str, tuple[int, ...]]], results: list[Any]
) -> dict[str, TensorEntry]:
    """Each tensor's entry: its shards from every rank's results, in offset order."""
    shards: dict[str, list[ShardEntry]] = {fqn: [] for fqn in tensors}
    for rank_shards, _ in results:
        for (fqn, _offsets, _sizes), s in rank_shards.items():
            shards[fqn].append(
                ShardEntry(
                    tuple(s["offsets"]),
                    tuple(s["sizes"]),
                    tuple(ChunkRef.from_json(c) for c in s["chunks"]),
                )
            )
    return {
        fqn: TensorEntry(dtype, shape, tuple(sorted(shards[fqn], key=lambda s: s.offsets)))
        for fqn, (dtype, shape) in tensors.items()
    }


def check_save_args(step: Any, metadata: Any) -> None:
    """Refuse a step or metadata the format cannot hold, saying what is allowed."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"step must be a non-negative int, got {step!r}")
    if step > MAX_STEP:
        raise ConfigError(
            f"step {step} is too large: manifest names hold 20 digits, so steps go up to "
            f"{MAX_STEP}; number steps from 0 (a counter, not a timestamp in nanoseconds)"
        )
    if metadata and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ConfigError("metadata must map str to str")


def refuse_replacing(
    step: int,
    committed: list[int],
    url: str,
    *,
    in_flight: list[int] | None = None,
    fix: str = "pass overwrite=True (CLI: --overwrite)",
) -> None:
    """Raise :class:`StepExistsError` when ``step`` is committed (or still saving) at ``url``.

    Callers skip it when the user passed ``overwrite=True``. Every rank must call it with
    the same lists (rank 0's listing), so that they all raise the same error.
    """
    if step in (in_flight or ()):
        raise StepExistsError(
            f"step {step} is still being saved to {url} by an earlier save_async; wait for it "
            "(pending.wait()), or pass overwrite=True to replace it once it commits"
        )
    if step not in committed:
        return
    latest = max(committed)
    raise StepExistsError(
        f"step {step} is already committed in {url}; to replace it {fix}; to continue a "
        "run, load the latest step first "
        f"(ckpt.load(state), latest is {latest}) and save from step {latest + 1} on"
    )
