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
from stalwart.errors import ConfigError, DistributedError, StepExistsError, StorageError
from stalwart.tree import flatten

if TYPE_CHECKING:
    from stalwart.checkpoint.durable.results import SaveResult

__all__ = ["AsyncSaves", "check_save_args", "refuse_replacing"]

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

    @property
    def url(self) -> str:  # provided by the Checkpointer
        raise NotImplementedError

    def steps(self) -> list[int]:  # provided by the Checkpointer
        raise NotImplementedError

    def _write(
        self,
        step: int,
        capture: Callable[[], tuple[list[LocalItem], dict[str, Any]]],
        metadata: dict[str, str] | None,
        g: Group,
        t0: float,
        overwrite: bool,
    ) -> SaveResult:  # provided by the Checkpointer
        raise NotImplementedError

    def check_new_step(self, step: int, *, overwrite: bool = False) -> None:
        """Refuse, on every rank alike, to replace ``step`` unless ``overwrite`` is True.

        Collective: every rank of the group calls it. Rank 0 lists the committed steps and
        every rank decides on that one listing; a step still saving in the background
        counts as taken (every rank submitted the same saves, so they agree on it too).
        A listing that fails (a flaky store) is logged and left to the save itself, which
        lists again, on every rank alike, before it writes anything.

        Raises:
            StepExistsError: ``step`` is committed or in flight and ``overwrite`` is False.
        """
        if overwrite:
            return
        in_flight = [p.step for p in self._async.pending if not p.done()]  # before listing
        g = self._group
        try:
            listing = g.run(f"listing steps before {step}", lambda: [] if g.rank else self.steps())
        except (StorageError, DistributedError) as e:  # raised on every rank alike
            log.warning("could not list the steps before step %s (%s); checked at save", step, e)
            listing = [[]]
        refuse_replacing(step, listing[0], self.url, in_flight=in_flight)

    def save_async(
        self,
        step: int,
        state: Any,
        *,
        lazy: bool = False,
        metadata: dict[str, str] | None = None,
        overwrite: bool = False,
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
        A committed step (or one still saving) is refused here, before anything is copied,
        unless ``overwrite`` is True (see :meth:`save`).

        Returns:
            A :class:`PendingSave`: ``done()``, ``wait()`` / ``result()`` (the SaveResult,
            or the background error), ``wait_staged()``.

        Raises:
            CheckpointError: an earlier background save failed and nobody had waited on it.
            StepExistsError: ``step`` is committed or saving and ``overwrite`` is False.
            UnsupportedValueError: the tree holds something that cannot be stored.
        """
        check_save_args(step, metadata)
        self._async.raise_unobserved()
        self.check_new_step(step, overwrite=overwrite)
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

            return self._write(step, checked, metadata, g, time.perf_counter(), overwrite)

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
        overwrite: bool = False,
    ) -> PendingSave:
        """Persist a capture made by another tier (one host copy feeds every tier).

        ``items`` are the boxes the capture was laid out from, in its order; ``staged``
        completes once every copy has landed. The caller keeps the capture's buffer
        unchanged until the returned save completes. The caller checks the step first
        (:meth:`check_new_step`); the background save checks it again before it commits.
        """
        check_save_args(step, metadata)
        g = self._background_group()

        def write(capture: Callable[[], tuple[list[LocalItem], dict[str, Any]]]) -> SaveResult:
            return self._write(step, capture, metadata, g, time.perf_counter(), overwrite)

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
