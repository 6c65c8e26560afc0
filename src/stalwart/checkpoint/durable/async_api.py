"""The asynchronous saves of a :class:`~stalwart.checkpoint.durable.checkpointer.Checkpointer`.

:class:`AsyncSaves` owns ``save_async`` (eager or lazy), ``save_captured`` (a capture another
tier made), the optimizer guard and the waits. The background machinery (host buffers, the
stager, the writer thread) is ``async_save.py``; what may be copied late is decided in
``checkpoint/capture.py``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from stalwart.checkpoint.capture import optimizer_storages
from stalwart.checkpoint.collective import BACKGROUND_GROUPS, Group
from stalwart.checkpoint.durable.async_save import AsyncSaver, Guards, PendingSave, StagedCapture
from stalwart.checkpoint.durable.commit import SaveRequest, refuse_replacing
from stalwart.checkpoint.durable.context import CheckpointContext
from stalwart.checkpoint.durable.plan import LocalItem, local_items
from stalwart.checkpoint.durable.results import SaveResult
from stalwart.checkpoint.durable.saver import Capturer, Saver
from stalwart.checkpoint.durable.staging import StagingWindows
from stalwart.errors import DistributedError, StorageError
from stalwart.tree import flatten

__all__ = ["AsyncSaves"]

log = logging.getLogger(__name__)


class AsyncSaves:
    """Asynchronous saves of one root and the optimizer guard.

    Owns the optimizers it guards and the dedicated group background saves use; writes
    through the shared :class:`Saver` and queues on the shared :class:`AsyncSaver`.
    """

    def __init__(self, ctx: CheckpointContext, saver: Saver, queue: AsyncSaver) -> None:
        self.ctx, self.saver, self.queue = ctx, saver, queue
        self.background: Group | None = None
        self.guards = Guards()  # taken off at close: their hooks hold this object alive
        self.newest: int | None = None  # the newest step checked here (None: root not listed)

    def check_new_step(self, step: int, *, overwrite: bool = False) -> None:
        """Refuse, on every rank alike, to replace ``step`` unless ``overwrite`` is True.

        A step still saving in the background counts as taken (every rank submitted the
        same saves, so they agree on it). The first check of a Checkpointer, and any check of
        a step not newer than every step checked before, is collective: rank 0 lists the
        committed steps and every rank decides on that one listing (a restarted run that
        forgot to resume is refused at once). A training loop's rising steps add no listing
        and no collective to the blocking phase; a step another process committed meanwhile
        is refused by the save itself, which lists the root, on every rank alike, before it
        writes anything (the refusal surfaces at ``wait()`` or the next call). A listing that
        fails (a flaky store) is logged and left to the save.

        Raises:
            StepExistsError: ``step`` is committed or in flight and ``overwrite`` is False.
        """
        if overwrite:
            return
        in_flight = [p.step for p in self.queue.pending if not p.done()]  # before listing
        listing: list[int] = []
        if self.newest is None or step <= self.newest:  # the same decision on every rank
            g = self.ctx.group
            try:
                listed = g.run(
                    f"listing steps before {step}", lambda: [] if g.rank else self.ctx.steps()
                )
                listing = listed[0]
            except (StorageError, DistributedError) as e:  # raised on every rank alike
                log.warning(
                    "could not list the steps before step %s (%s); checked at save", step, e
                )
        refuse_replacing(step, listing, self.ctx.url, in_flight=in_flight)
        self.newest = step if self.newest is None else max(self.newest, step)

    def save_async(self, request: SaveRequest, state: Any, lazy: bool) -> PendingSave:
        """Start saving ``state`` as asked; see :meth:`Checkpointer.save_async`."""
        self.queue.raise_unobserved()
        self.check_new_step(request.step, overwrite=request.overwrite)
        g = self.background_group()
        try:
            flat = flatten(state)
            items, skeleton, err = local_items(flat), flat.skeleton, None
        except Exception as e:  # every rank must still meet in the background collectives
            if g.world == 1:
                raise
            items, skeleton, err = [], {}, e

        def write(capture: Capturer) -> SaveResult:
            def checked() -> tuple[list[LocalItem], dict[str, Any]]:
                if err is not None:
                    raise err
                return capture()

            return self.saver.write(request, checked, g, time.perf_counter())

        cap = self.ctx.options.max_staging_bytes
        if cap is not None:
            return self._save_windowed(request, items, skeleton, err, cap, g)
        defer = self.deferrable() if lazy else frozenset()
        if lazy and not self.guards.optimizers:
            log.info("save_async(lazy=True) without guard(optimizer): every tensor copied now")
        pending = self.queue.submit(request.step, items, skeleton, lazy, write, defer=defer)
        if err is not None:
            pending.mark_observed()  # raised here; not again at the next call
            raise err
        return pending

    def _save_windowed(
        self,
        request: SaveRequest,
        items: list[LocalItem],
        skeleton: dict[str, Any],
        err: Exception | None,
        cap: int,
        g: Group,
    ) -> PendingSave:
        """``save_async`` with bounded staging (``options.max_staging_bytes``; ``staging.py``)."""
        if any(it.tensor.device.type == "cuda" for it in items):
            torch.cuda.current_stream().synchronize()  # the writer thread reads the state

        def live() -> tuple[list[LocalItem], dict[str, Any]]:
            if err is not None:
                raise err
            return items, skeleton

        def write(windows: StagingWindows) -> SaveResult:
            return self.saver.write(request, live, g, time.perf_counter(), windows)

        pending = self.queue.submit_windowed(request.step, cap, write)
        if err is not None:
            pending.mark_observed()
            raise err
        return pending

    def save_captured(self, request: SaveRequest, captured: StagedCapture) -> PendingSave:
        """Persist a capture made by another tier (one host copy feeds every tier).

        The caller keeps the capture's buffer unchanged until the returned save completes.
        The caller checks the step first (:meth:`check_new_step`); the background save checks
        it again before it commits.
        """
        g = self.background_group()

        def write(capture: Capturer) -> SaveResult:
            return self.saver.write(request, capture, g, time.perf_counter())

        return self.queue.submit_captured(request.step, captured, write)

    def background_group(self) -> Group:
        """The group background saves use: never the training's (see dedicated_group).

        Taken on the first save_async, which all ranks make together: a group a closed
        Checkpointer of this process gave back, else a new one (``BACKGROUND_GROUPS``).
        """
        g = self.ctx.group
        if g.world > 1 and self.background is None:
            self.background = BACKGROUND_GROUPS.take(g)
        return self.background if g.world > 1 and self.background else g

    def close(self) -> None:
        """Give the background group back for the process's next Checkpointer (the saves
        are already waited for), and take the guards off the optimizers: a guard's hook
        refers to this object, and would keep a closed Checkpointer alive with them."""
        self.guards.remove()
        if self.background is not None:
            BACKGROUND_GROUPS.give(self.background)
            self.background = None

    def wait(self) -> None:
        """See :meth:`Checkpointer.wait`."""
        self.queue.flush()

    def wait_staged(self) -> None:
        """See :meth:`Checkpointer.wait_staged`."""
        self.queue.wait_staged()

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """Guard ``optimizer`` (its step waits for staging); see :meth:`Checkpointer.guard`."""
        return self.guards.add(optimizer, self.wait_staged)

    def deferrable(self) -> frozenset[int]:
        """Storages a lazy save may copy late: those of the guarded optimizers."""
        return optimizer_storages(self.guards.optimizers)
