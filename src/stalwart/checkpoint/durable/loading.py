"""The reading half of a checkpointer: :class:`Loader`.

``load`` (newest or a given step, strict or not, falling back past damaged steps on every
rank together), ``read_tensor`` (one whole tensor, verified: the read API tools use) and
``verify`` (the engine's check, ``verification.py``). The routine that fills a state is
``restore.py``; reading and verifying bytes is ``reshard.py``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from stalwart.checkpoint.durable.async_save import AsyncSaver
from stalwart.checkpoint.durable.context import CheckpointContext, short_steps
from stalwart.checkpoint.durable.reshard import read_box
from stalwart.checkpoint.durable.restore import load_first_that_verifies, load_step
from stalwart.checkpoint.durable.results import LoadResult
from stalwart.checkpoint.durable.verification import VerifyReport, verify_stored_step
from stalwart.checkpoint.events import CheckpointEvent, emit
from stalwart.errors import CheckpointNotFoundError
from stalwart.tree import dtype_from_name

__all__ = ["Loader"]


class Loader:
    """Loads and verified reads of one root; owns the record of the last load."""

    def __init__(self, ctx: CheckpointContext, queue: AsyncSaver) -> None:
        self.ctx, self.queue = ctx, queue  # queue: background failures surface at a load
        self.last_load: LoadResult | None = None

    def read_tensor(self, step: int, name: str) -> tuple[torch.Tensor, int]:
        """The whole tensor ``name`` of ``step`` as a CPU tensor, every chunk verified.

        Returns:
            The tensor and the number of bytes read from the store.

        Raises:
            CheckpointNotFoundError: no such step.
            KeyError: the step holds no tensor of that name.
            CorruptCheckpointError: a chunk fails its checksum.
        """
        e = self.ctx.manifest(step).tensors[name]
        store = self.ctx.store(create=False)
        dest = torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
        where = f"checkpoint {store.url} step {step}"
        stats = read_box(
            store, e, name, (0,) * len(e.shape), dest, pool=self.ctx.io_pool, where=where
        )
        return dest, stats.bytes_read

    def load(
        self,
        state: Any = None,
        step: int | None = None,
        *,
        strict: bool = True,
        fallback: bool = False,
    ) -> Any:
        """Load a checkpoint into ``state``; see :meth:`Checkpointer.load`."""
        self.queue.raise_unobserved()
        t0 = time.perf_counter()
        g = self.ctx.group
        # Rank 0 lists; every rank learns if that failed.
        steps = g.run("listing checkpoints", lambda: self.ctx.steps() if g.rank == 0 else [])[0]
        if not steps:
            raise CheckpointNotFoundError(
                f"no committed checkpoint under {self.ctx.url}; save one first or check the path"
            )
        if step is None:
            candidates = sorted(steps, reverse=True)
        elif step in steps:
            candidates = [s for s in sorted(steps, reverse=True) if s <= step]
        else:
            raise CheckpointNotFoundError(
                f"step {step} is not a committed checkpoint in {self.ctx.url}; "
                f"committed steps: {short_steps(steps)}"
            )
        if not fallback:
            candidates = candidates[:1]
        s, tree, read, mismatched, skipped = load_first_that_verifies(
            candidates,
            lambda s: self._load_step(s, state, strict),
            g,
            fallback=fallback,
            where=self.ctx.url,
        )
        self.last_load = LoadResult(s, time.perf_counter() - t0, read, skipped, mismatched)
        loaded = CheckpointEvent(
            "load", s, self.ctx.url, g.rank, self.last_load.seconds, bytes_read=read
        )
        emit(
            self.ctx.options.on_event,
            dataclasses.replace(loaded, skipped=tuple(k for k, _ in skipped)),
        )
        return tree

    def _load_step(self, step: int, state: Any, strict: bool) -> tuple[Any, int, list[str]]:
        store = self.ctx.store(create=False)
        return load_step(
            self.ctx.manifest(step),
            store,
            state,
            strict=strict,
            where=f"checkpoint {store.url} step {step}",
            io_pool=self.ctx.io_pool,
            tensor_pool=self.ctx.tensor_pool,
            lease_s=self.ctx.options.lease_s,
        )

    def verify(self, step: int | None = None) -> VerifyReport:
        """Read and hash every chunk of ``step`` (the newest when None); report all damage.

        Unlike ``load``, this does not stop at the first problem: ``report.damaged`` lists
        every damaged chunk with its tensor and shard. ``report.ok`` is True when intact.
        """
        if step is None:
            step = self.ctx.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"no committed checkpoint under {self.ctx.url}")
        ctx = self.ctx
        return verify_stored_step(
            ctx.store(create=False),
            step,
            io_threads=ctx.options.io_threads,
            lease_s=ctx.options.lease_s,
            committed=ctx.steps,
        )
