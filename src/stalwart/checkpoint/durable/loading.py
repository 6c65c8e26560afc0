"""The reading half of :class:`~stalwart.checkpoint.durable.checkpointer.Checkpointer`.

``load`` (newest or a given step, strict or not, falling back past damaged steps on every
rank together), ``read_tensor`` (one whole tensor, verified: the read API tools use) and
``verify``. The routine that fills a state is ``restore.py``; reading and verifying bytes is
``reshard.py``.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

import torch

from stalwart.checkpoint.collective import Group
from stalwart.checkpoint.durable.manifest import Manifest
from stalwart.checkpoint.durable.reshard import read_box
from stalwart.checkpoint.durable.restore import load_first_that_verifies, load_step
from stalwart.checkpoint.durable.results import LoadResult
from stalwart.checkpoint.events import CheckpointEvent, emit
from stalwart.checkpoint.options import CheckpointOptions
from stalwart.errors import CheckpointNotFoundError
from stalwart.storage.base import Storage
from stalwart.tree import dtype_from_name

if TYPE_CHECKING:
    from stalwart.checkpoint.durable.async_save import AsyncSaver
    from stalwart.checkpoint.durable.checkpointer import Checkpointer
    from stalwart.checkpoint.tools.verify import VerifyReport

__all__ = ["Loads", "short_steps"]


class Loads:
    """Mixed into the Checkpointer: loading and verified reads."""

    options: CheckpointOptions
    last_load: LoadResult | None
    _async: AsyncSaver
    _pool: ThreadPoolExecutor
    _tensor_pool: ThreadPoolExecutor

    @property
    def _group(self) -> Group:  # provided by the Checkpointer
        raise NotImplementedError

    @property
    def url(self) -> str:  # provided by the Checkpointer
        raise NotImplementedError

    @property
    def storage(self) -> Storage:  # provided by the Checkpointer
        raise NotImplementedError

    def _store(self, *, create: bool) -> Storage:  # provided by the Checkpointer
        raise NotImplementedError

    def steps(self) -> list[int]:  # provided by the Checkpointer
        raise NotImplementedError

    def latest_step(self) -> int | None:  # provided by the Checkpointer
        raise NotImplementedError

    def manifest(self, step: int) -> Manifest:  # provided by the Checkpointer
        raise NotImplementedError

    def read_tensor(self, step: int, name: str) -> tuple[torch.Tensor, int]:
        """The whole tensor ``name`` of ``step`` as a CPU tensor, every chunk verified.

        Returns:
            The tensor and the number of bytes read from the store.

        Raises:
            CheckpointNotFoundError: no such step.
            KeyError: the step holds no tensor of that name.
            CorruptCheckpointError: a chunk fails its checksum.
        """
        e = self.manifest(step).tensors[name]
        store = self.storage
        dest = torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
        where = f"checkpoint {store.url} step {step}"
        stats = read_box(store, e, name, (0,) * len(e.shape), dest, pool=self._pool, where=where)
        return dest, stats.bytes_read

    def load(
        self,
        state: Any = None,
        step: int | None = None,
        *,
        strict: bool = True,
        fallback: bool = False,
    ) -> Any:
        """Load a checkpoint into ``state``'s tensors in place and return the loaded tree.

        Args:
            state: a state tree whose tensors (plain or DTensor, any sharding) receive the
                data; stateful objects get ``load_state_dict``. ``None`` returns the whole
                checkpoint as full CPU tensors (the consolidated view).
            step: the step to load; the newest committed one when None.
            strict: raise when ``state`` and the checkpoint differ in keys, shapes or dtypes;
                with False, load what matches and leave the rest untouched.
            fallback: when the step is damaged, load the newest older step that verifies,
                and say so in a warning and in ``last_load.skipped``.

        Raises:
            CheckpointNotFoundError: no such root or step.
            CorruptCheckpointError: damaged data (and no fallback left).
            StateMismatchError: keys, shapes or dtypes differ and ``strict`` is True.
        """
        self._async.raise_unobserved()
        t0 = time.perf_counter()
        g = self._group
        # Rank 0 lists; every rank learns if that failed.
        steps = g.run("listing checkpoints", lambda: self.steps() if g.rank == 0 else [])[0]
        if not steps:
            raise CheckpointNotFoundError(
                f"no committed checkpoint under {self.url}; save one first or check the path"
            )
        if step is None:
            candidates = sorted(steps, reverse=True)
        elif step in steps:
            candidates = [s for s in sorted(steps, reverse=True) if s <= step]
        else:
            raise CheckpointNotFoundError(
                f"step {step} is not a committed checkpoint in {self.url}; "
                f"committed steps: {short_steps(steps)}"
            )
        if not fallback:
            candidates = candidates[:1]
        s, tree, read, mismatched, skipped = load_first_that_verifies(
            candidates,
            lambda s: self._load_step(s, state, strict),
            g,
            fallback=fallback,
            where=self.url,
        )
        self.last_load = LoadResult(s, time.perf_counter() - t0, read, skipped, mismatched)
        loaded = CheckpointEvent(
            "load", s, self.url, g.rank, self.last_load.seconds, bytes_read=read
        )
        emit(
            self.options.on_event, dataclasses.replace(loaded, skipped=tuple(k for k, _ in skipped))
        )
        return tree

    def _load_step(self, step: int, state: Any, strict: bool) -> tuple[Any, int, list[str]]:
        store = self._store(create=False)
        return load_step(
            self.manifest(step),
            store,
            state,
            strict=strict,
            where=f"checkpoint {store.url} step {step}",
            io_pool=self._pool,
            tensor_pool=self._tensor_pool,
            lease_s=self.options.lease_s,
        )

    def verify(self, step: int | None = None) -> VerifyReport:
        """Read and hash every chunk of ``step`` (the newest when None); report all damage.

        Unlike ``load``, this does not stop at the first problem: ``report.damaged`` lists
        every damaged chunk with its tensor and shard. ``report.ok`` is True when intact.
        """
        from stalwart.checkpoint.tools.verify import verify_step

        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"no committed checkpoint under {self.url}")
        return verify_step(cast("Checkpointer", self), step)


def short_steps(steps: list[int]) -> str:
    """A list of steps for a message: whole when short, else its ends and its count."""
    if len(steps) <= 8:
        return str(steps)
    return f"[{steps[0]}, {steps[1]}, …, {steps[-2]}, {steps[-1]}] ({len(steps)} in all)"
