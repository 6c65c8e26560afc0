"""Asynchronous saves: stage into reused host buffers, persist in the background.

    save_async(step, state)
      ├─ blocking: flatten, copy every box into host buffers   (eager mode)
      │            flatten only; a stager thread copies          (lazy mode)
      └─ background: plan ─► persist ─► commit ─► retain        (one writer thread)

The only part that stalls training is the copy into host buffers, and in lazy mode not even
that: parameters and optimizer state only change in ``optimizer.step()``, so the copy runs
while the next forward and backward run, and :func:`guard` makes ``optimizer.step()`` wait
for whatever copy is still in flight. Buffers are allocated once per in-flight slot and
reused (fresh pages cost several times more than reused ones); on CUDA they are pinned and
the copies run on a side stream ordered after the training's (see ``checkpoint/capture.py``).

Lazy mode is exact: only boxes a guarded optimizer owns (parameters, optimizer state) are
copied late; every other tensor (BatchNorm buffers, EMA weights, RNG, user tensors) is copied
before ``save_async`` returns, and values other than tensors are read at the call.

Errors in the background are never silent: ``PendingSave.wait()`` raises them, and so does
the checkpointer's next ``save``, ``save_async`` or ``load``, or its ``close``, if nobody
waited. At exit, saves still in flight are flushed (or their steps logged as not persisted).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from stalwart.checkpoint.buffer_pool import HOST_BUFFERS
from stalwart.checkpoint.capture import Capture, HostBuffer, stage
from stalwart.checkpoint.durable.plan import LocalItem
from stalwart.checkpoint.durable.staging import StagingWindows
from stalwart.errors import CheckpointError

if TYPE_CHECKING:
    from stalwart.checkpoint.durable.results import SaveResult

__all__ = ["AsyncSaver", "Guards", "PendingSave", "StagedCapture", "guard"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagedCapture:
    """This rank's boxes copied (or being copied) to host, for a background save to persist.

    One host copy feeds every tier that saves the step. Whoever staged it owns the buffer and
    keeps it unchanged until every save of it has completed.

    Attributes:
        capture: the host copy of the boxes.
        items: the boxes it was laid out from, in its order.
        skeleton: the state's skeleton.
        staged: completes once every box has landed (deferred copies included).
    """

    capture: Capture
    items: list[LocalItem]
    skeleton: dict[str, Any]
    staged: Future[None]

    def host_items(self) -> list[LocalItem]:
        """``items`` pointing at their copies in the host buffer (read once ``staged``)."""
        return [
            dataclasses.replace(it, tensor=self.capture.view(rec))
            for it, rec in zip(self.items, self.capture.records, strict=True)
        ]


class PendingSave:
    """A save running in the background.

    ``staged`` is set once every tensor has been copied (the state may change from then on);
    the future completes when the checkpoint is committed.
    """

    def __init__(self, step: int, lazy: bool) -> None:
        self.step = step
        self.lazy = lazy
        self.staged = threading.Event()
        self.future: Future[SaveResult] = Future()
        self.blocking_s = 0.0
        self.staging_s = 0.0
        self.slot: HostBuffer | None = None
        self.capture: Capture | None = None
        self._observed = False

    @property
    def observed(self) -> bool:
        """True once someone saw the outcome (``wait``/``result``, or an error raised)."""
        return self._observed

    def mark_observed(self) -> None:
        """Record that the outcome was seen: a failure is then not raised again later."""
        self._observed = True

    def done(self) -> bool:
        """True once the save committed or failed."""
        return self.future.done()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until committed; return the SaveResult or raise the background error."""
        try:
            return self.future.result(timeout)
        finally:
            if self.future.done():
                self._observed = True

    result = wait

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Block until the state has been copied (the caller may then mutate it)."""
        return self.staged.wait(timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "staged" if self.staged.is_set() else "staging"
        return f"PendingSave(step={self.step}, {state})"


class AsyncSaver:
    """The background half of a checkpointer: slots, a stager, one writer thread."""

    def __init__(self, max_inflight: int, exit_flush_timeout_s: float, pool_key: str = "") -> None:
        self.max_inflight = max_inflight
        self.pool_key = pool_key  # buffers of HOST_BUFFERS are reused by root
        self.slots: list[HostBuffer] = []  # buffers taken from HOST_BUFFERS, first first
        self.pending: deque[PendingSave] = deque()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="stalwart-persist")
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="stalwart-stage")
        self._lock = threading.Lock()
        self._finished: list[PendingSave] = []
        ref = weakref.ref(self)
        self._atexit = lambda: _flush_at_exit(ref, exit_flush_timeout_s)
        _register_exit_flush(self._atexit)

    def submit(
        self,
        step: int,
        items: list[LocalItem],
        skeleton: dict[str, Any],
        lazy: bool,
        write: Callable[[Callable[[], tuple[list[LocalItem], dict[str, Any]]]], SaveResult],
        *,
        defer: frozenset[int] = frozenset(),
    ) -> PendingSave:
        """Stage ``items`` and persist them with ``write``.

        Every box is copied before this returns except, when ``lazy``, the boxes whose
        storage is in ``defer`` (those only a guarded ``optimizer.step()`` changes): the
        stager thread copies them, and the guard makes that step wait.
        """
        t0 = time.perf_counter()
        self._make_room()
        # The warmest free buffer of the process: back-to-back saves, of this checkpointer
        # or of a new one, reuse the same pages instead of faulting in fresh ones.
        slot = HOST_BUFFERS.take(self.pool_key)
        try:
            cap, finish = stage(items, slot, defer=defer if lazy else frozenset())
        except BaseException:
            HOST_BUFFERS.give(self.pool_key, slot)
            raise
        staged: Future[None] = Future()
        if finish is None:
            staged.set_result(None)
        else:
            staged = self._stager.submit(finish)
        captured = StagedCapture(cap, items, skeleton, staged)
        pending = self.submit_captured(step, captured, write, t0=t0, slot=slot)
        pending.lazy = lazy
        if slot not in self.slots:
            self.slots.append(slot)  # the buffers this saver used, first first
        return pending

    def submit_captured(
        self,
        step: int,
        captured: StagedCapture,
        write: Callable[[Callable[[], tuple[list[LocalItem], dict[str, Any]]]], SaveResult],
        *,
        t0: float | None = None,
        slot: HostBuffer | None = None,
    ) -> PendingSave:
        """Persist ``captured`` with ``write``.

        The buffer belongs to whoever staged it, who keeps it unchanged until the save
        completes; a ``slot`` of :data:`HOST_BUFFERS` goes back there once the save is done
        with it (before its future completes, so a save waiting on this one finds it free).
        """
        t0 = time.perf_counter() if t0 is None else t0
        if slot is None:
            self._make_room()
        staged = captured.staged
        pending = PendingSave(step, lazy=not staged.done())
        pending.capture, pending.slot = captured.capture, slot

        def on_staged(_f: Future[None]) -> None:
            pending.staging_s = time.perf_counter() - t0
            pending.staged.set()  # also on a staging error: never leave a guard waiting

        staged.add_done_callback(on_staged)

        def capture() -> tuple[list[LocalItem], dict[str, Any]]:
            staged.result()  # a staging error fails the save on every rank
            captured.capture.ready()
            return captured.host_items(), captured.skeleton

        self._enqueue(pending, lambda: write(capture), staged)
        pending.blocking_s = time.perf_counter() - t0
        return pending

    def submit_windowed(
        self, step: int, cap: int, write: Callable[[StagingWindows], SaveResult]
    ) -> PendingSave:
        """Persist with ``write``, staging through a buffer of at most ``cap`` bytes.

        The background writer copies the state window by window (``durable/staging.py``)
        while this call waits; it returns once the last window is copied. The caller must
        not change the state before then (it is blocked here, so it cannot).
        """
        t0 = time.perf_counter()
        self._make_room()
        slot = HOST_BUFFERS.take(self.pool_key)
        windows = StagingWindows(slot, cap)
        pending = PendingSave(step, lazy=False)
        pending.slot = slot

        def on_staged(_f: Future[None]) -> None:
            pending.staging_s = time.perf_counter() - t0
            pending.staged.set()

        windows.staged.add_done_callback(on_staged)

        def job() -> SaveResult:
            try:
                return write(windows)
            finally:
                windows.finish()  # a failure before the last window releases the caller too

        self._enqueue(pending, job, windows.staged)
        if slot not in self.slots:
            self.slots.append(slot)
        windows.staged.result()
        pending.blocking_s = time.perf_counter() - t0
        return pending

    def _make_room(self) -> None:
        """Raise an unseen background failure; wait while too many saves are in flight."""
        self.raise_unobserved()
        while len(self.pending) >= self.max_inflight:
            self.pending[0].future.exception()  # wait for the oldest (errors surface later)
            self._reap()

    def _enqueue(
        self, pending: PendingSave, job: Callable[[], SaveResult], staged: Future[None]
    ) -> None:
        def run() -> None:
            if not pending.future.set_running_or_notify_cancel():
                return
            try:
                result = job()
            except BaseException as e:
                pending.staged.set()  # never leave a guard waiting on a failed save
                self._give_back(pending, staged)
                pending.future.set_exception(e)
            else:
                self._give_back(pending, staged)
                pending.future.set_result(result)

        self.pending.append(pending)
        self._writer.submit(run)

    def _give_back(self, pending: PendingSave, staged: Future[None]) -> None:
        """Return the save's buffer to the pool once its copies are done (now, usually)."""
        if pending.slot is not None:
            HOST_BUFFERS.give_when_done(self.pool_key, pending.slot, [staged])

    def _reap(self) -> None:
        while self.pending and self.pending[0].done():
            self._finished.append(self.pending.popleft())

    def wait_staged(self) -> None:
        """Block until every pending save has copied its state (the optimizer guard)."""
        for p in list(self.pending):
            p.staged.wait()
            if p.capture is not None:
                p.capture.order_after_copies()  # CUDA: the step's kernels after the copies

    def raise_unobserved(self) -> None:
        """Raise the first background failure that nobody has seen yet (once)."""
        self._reap()
        while self._finished:
            p = self._finished.pop(0)
            err = p.future.exception()
            if err is not None and not p.observed:
                p.mark_observed()
                raise CheckpointError(
                    f"the background save of step {p.step} failed: {err}; that step was not "
                    "committed (earlier checkpoints are intact)"
                ) from err

    def flush(self) -> None:
        """Wait for every pending save, then raise any failure nobody has seen."""
        for p in list(self.pending):
            p.future.exception()
        self.raise_unobserved()

    def close(self) -> None:
        """Wait for the pending saves, release the threads, then raise any unseen failure."""
        try:
            self.flush()
        finally:
            self._writer.shutdown(wait=True)
            self._stager.shutdown(wait=True)
            if self._atexit in _exit_flushes:
                _exit_flushes.remove(self._atexit)


_exit_flushes: list[Callable[[], None]] = []
_exit_hook: list[bool] = []  # [True] once the process's one exit hook is registered


def _register_exit_flush(fn: Callable[[], None]) -> None:
    """Run ``fn`` at exit while thread pools still accept work.

    ``atexit`` handlers run after ``concurrent.futures`` has stopped accepting new tasks, so
    a save flushed from there fails with "cannot schedule new futures after interpreter
    shutdown" (seen in tests/unit/test_async_save.py). ``threading``'s exit hooks run
    earlier, newest first, so one registered after ``concurrent.futures`` is imported runs
    before its pools shut. We register one hook for all savers, at the first saver (once a
    process: registering again whenever the list emptied added a hook per closed saver).
    """
    if not _exit_hook:
        _exit_hook.append(True)
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(_run_exit_flushes)
        else:  # other Python implementations: best effort
            atexit.register(_run_exit_flushes)
    _exit_flushes.append(fn)


def _run_exit_flushes() -> None:
    for fn in list(_exit_flushes):
        fn()


def _flush_at_exit(ref: weakref.ref[AsyncSaver], timeout_s: float) -> None:
    saver = ref()
    if saver is None:
        return
    lost = []
    deadline = time.monotonic() + timeout_s
    for p in list(saver.pending):
        try:
            p.future.result(max(0.0, deadline - time.monotonic()))
        except Exception as e:
            lost.append(f"step {p.step}: {e}")
    if lost:
        log.error("checkpoints not persisted at exit: %s", "; ".join(lost))


class Guards:
    """Guarded optimizers (``step()`` first waits for the lazy copies) and their hooks, which
    refer to their checkpointer: :meth:`remove`, at its close, takes them off, or a closed one
    would live, with its host copy of the state, as long as the optimizer."""

    def __init__(self) -> None:
        self.optimizers: list[torch.optim.Optimizer] = []  # a lazy save defers only theirs
        self._hooks: list[Any] = []

    def add(self, optimizer: torch.optim.Optimizer, wait: Callable[[], object]) -> Any:
        """Guard ``optimizer`` (install once; free when nothing is staging); the hook's handle."""
        self.optimizers.append(optimizer)
        handle = optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: wait())
        self._hooks.append(handle)
        return handle

    def remove(self) -> None:
        """Take every hook off and forget the optimizers."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.optimizers.clear()


def guard(optimizer: torch.optim.Optimizer, checkpointer: Any) -> Any:
    """The old ``stalwart.checkpoint.guard``: ``step()`` waits for ``checkpointer``'s staging
    (prefer ``Checkpointer.guard``, which its ``close()`` undoes); returns the hook handle."""
    return optimizer.register_step_pre_hook(lambda _opt, _a, _k: checkpointer.wait_staged())
