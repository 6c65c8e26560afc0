"""The asynchronous half of :class:`~stalwart.checkpoint.durable.checkpointer.Checkpointer`.

``save_async`` (eager or lazy), ``save_captured`` (a capture another tier made), the optimizer
guard and the waits. The background machinery (host buffers, the stager, the writer thread)
is ``async_save.py``; what may be copied late is decided in ``checkpoint/capture.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from stalwart.checkpoint.capture import Capture, optimizer_storages
from stalwart.checkpoint.collective import Group, dedicated_group
from stalwart.checkpoint.durable.async_save import AsyncSaver, PendingSave, guard
from stalwart.checkpoint.durable.manifest import MAX_STEP
from stalwart.checkpoint.durable.plan import LocalItem, local_items
from stalwart.errors import ConfigError
from stalwart.tree import flatten

if TYPE_CHECKING:
    from stalwart.checkpoint.durable.results import SaveResult

__all__ = ["AsyncSaves", "check_save_args"]

log = logging.getLogger(__name__)

WriteFn = Callable[[Callable[[], tuple[list[LocalItem], dict[str, Any]]]], "SaveResult"]


class AsyncSaves:
    """Mixed into the Checkpointer: asynchronous saves and the optimizer guard."""

    _async: AsyncSaver
    _background: Group | None
    _guarded: list[torch.optim.Optimizer]

    @property
    def _group(self) -> Group:  # provided by the Checkpointer
        raise NotImplementedError

    def _write(
        self,
        step: int,
        capture: Callable[[], tuple[list[LocalItem], dict[str, Any]]],
        metadata: dict[str, str] | None,
        g: Group,
        t0: float,
    ) -> SaveResult:  # provided by the Checkpointer
        raise NotImplementedError

    def save_async(
        self,
        step: int,
        state: Any,
        *,
        lazy: bool = False,
        metadata: dict[str, str] | None = None,
    ) -> PendingSave:
        """Start saving ``state`` as ``step``; return once the state may change again.

        Eager (default): returns after copying every tensor into reused host buffers.
        Lazy: the parameters and state of the optimizers given to :meth:`guard` are copied
        in the background while the next forward and backward run (``optimizer.step()``
        waits for them); every other tensor is copied before this returns and every other
        value is read now, so the checkpoint holds the state of the call exactly, whatever
        the model changes next (BatchNorm buffers, EMA weights, schedulers, RNG). Without a
        guarded optimizer, lazy saves copy everything now.
        Hashing, dedup, compression, writing and the commit run in a background thread;
        at most ``options.max_inflight_saves`` saves are in flight (a further call waits).

        Returns:
            A :class:`PendingSave`: ``done()``, ``wait()`` / ``result()`` (the SaveResult,
            or the background error), ``wait_staged()``.

        Raises:
            CheckpointError: an earlier background save failed and nobody had waited on it.
            UnsupportedValueError: the tree holds something that cannot be stored.
        """
        check_save_args(step, metadata)
        self._async.raise_unobserved()
        g = self._background_group()
        try:
            flat = flatten(state)
            items, skeleton, err = local_items(flat), flat.skeleton, None
        except Exception as e:  # every rank must still meet in the background collectives
            if g.world == 1:
                raise
            items, skeleton, err = [], {}, e

        def write(capture: Callable[[], tuple[list[LocalItem], dict[str, Any]]]) -> SaveResult:
            def checked() -> tuple[list[LocalItem], dict[str, Any]]:
                if err is not None:
                    raise err
                return capture()

            return self._write(step, checked, metadata, g, time.perf_counter())

        defer = self.deferrable() if lazy else frozenset()
        if lazy and not self._guarded:
            log.info("save_async(lazy=True) without guard(optimizer): every tensor copied now")
        pending = self._async.submit(step, items, skeleton, lazy, write, defer=defer)
        if err is not None:
            pending._observed = True  # raised here; not again at the next call
            raise err
        return pending

    def save_captured(
        self,
        step: int,
        cap: Capture,
        items: list[LocalItem],
        skeleton: dict[str, Any],
        staged: Future[None],
        *,
        metadata: dict[str, str] | None = None,
    ) -> PendingSave:
        """Persist a capture made by another tier (one host copy feeds every tier).

        ``items`` are the boxes the capture was laid out from, in its order; ``staged``
        completes once every copy has landed. The caller keeps the capture's buffer
        unchanged until the returned save completes.
        """
        check_save_args(step, metadata)
        g = self._background_group()

        def write(capture: Callable[[], tuple[list[LocalItem], dict[str, Any]]]) -> SaveResult:
            return self._write(step, capture, metadata, g, time.perf_counter())

        return self._async.submit_captured(step, cap, items, skeleton, staged, write)

    def _background_group(self) -> Group:
        # Background saves never share the training's group (see dedicated_group); made on
        # the first save_async, which all ranks make together.
        g = self._group
        if g.world > 1 and self._background is None:
            self._background = dedicated_group(g)
        return self._background if g.world > 1 and self._background else g

    def wait(self) -> None:
        """Wait for every save in flight; raise the first failure nobody has seen."""
        self._async.flush()

    def wait_staged(self) -> None:
        """Wait until every save in flight has copied its state (used by :meth:`guard`)."""
        self._async.wait_staged()

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step()`` wait for lazy copies still in flight (install once).

        Its parameters and state may then be copied lazily: they must change only in
        ``optimizer.step()`` (the usual case; an in-place edit of a parameter between
        ``save_async`` and the step would leak into the checkpoint).
        """
        self._guarded.append(optimizer)  # held: a lazy save defers only its tensors
        return guard(optimizer, self)

    def deferrable(self) -> frozenset[int]:
        """Storages a lazy save may copy late: those of the guarded optimizers."""
        return optimizer_storages(self._guarded)


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
