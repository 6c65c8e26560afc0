"""The public checkpointer: save, load, list, verify, retain and collect.

    save(step, tree) ──► plan ──► persist ──► commit ──► retain
    load(tree, step) ──► manifest ──► check keys/shapes ──► read boxes (verified) ──► tree

The Checkpointer is a front: a :class:`Saver` writes steps, a :class:`Loader` reads them,
:class:`AsyncSaves` runs saves in the background; all three share one
:class:`CheckpointContext` (the store, options, group, threads and manifest cache).

A save is durable and committed when it returns: every rank's pack is written atomically
and durably, then rank 0 writes the manifest (atomically) once all ranks reported success.
A crash at any instant leaves every earlier checkpoint loadable and no partial one visible.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from stalwart.checkpoint.durable.async_api import AsyncSaves
from stalwart.checkpoint.durable.async_save import AsyncSaver, PendingSave, StagedCapture
from stalwart.checkpoint.durable.commit import SaveRequest
from stalwart.checkpoint.durable.context import CheckpointContext, short_steps
from stalwart.checkpoint.durable.gc import GCReport, collect_garbage, retire
from stalwart.checkpoint.durable.lease import read_leases
from stalwart.checkpoint.durable.loading import Loader
from stalwart.checkpoint.durable.manifest import Manifest
from stalwart.checkpoint.durable.plan import LocalItem, local_items
from stalwart.checkpoint.durable.results import LoadResult, SaveResult
from stalwart.checkpoint.durable.saver import Saver
from stalwart.checkpoint.durable.verification import Progress, VerifyReport
from stalwart.checkpoint.options import CheckpointOptions
from stalwart.errors import CheckpointError, CheckpointNotFoundError, ConfigError
from stalwart.storage.base import Storage
from stalwart.tree import flatten

__all__ = ["Checkpointer", "LoadResult", "SaveResult", "close_on_exit"]

log = logging.getLogger(__name__)


class Checkpointer:
    """Sharded, deduplicated, verified checkpoints of state trees under one root.

    Args:
        root: a local folder (created on the first save) or an fsspec URL
            (``s3://bucket/prefix``, ``memory://name``), or a :class:`Storage`.
        options: chunking, compression, threads and retention.
        process_group: the ranks that save and load together; the default group when
            ``torch.distributed`` is initialised, else this process alone.
        storage_options: passed to fsspec for remote roots (credentials, endpoint).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage,
        options: CheckpointOptions | None = None,
        *,
        process_group: Any = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.options = options or CheckpointOptions()
        if not isinstance(self.options, CheckpointOptions):
            raise ConfigError(f"options must be CheckpointOptions, got {type(options).__name__}")
        self._root = root
        self._ctx = CheckpointContext(
            root, self.options, process_group=process_group, storage_options=storage_options
        )
        self._async = AsyncSaver(
            self.options.max_inflight_saves,
            self.options.exit_flush_timeout_s,
            pool_key=(  # staging buffers are reused by the next Checkpointer of this root
                os.path.abspath(root) if isinstance(root, (str, os.PathLike)) else root.url
            ),
        )
        self._saver = Saver(self._ctx)
        self._loader = Loader(self._ctx, self._async)
        self._async_saves = AsyncSaves(self._ctx, self._saver, self._async)
        self._on_close: list[Callable[[], object]] = []

    # -- storage and listing -----------------------------------------------------------

    @property
    def url(self) -> str:
        """Where the checkpoints live."""
        return self._ctx.url

    @property
    def storage(self) -> Storage:
        """The store under the root (read API for tools such as verify, diff and export).

        Raises:
            CheckpointNotFoundError: the root does not exist.
        """
        return self._ctx.store(create=False)

    def steps(self) -> list[int]:
        """Committed steps, ascending (empty when the root holds none or does not exist)."""
        return self._ctx.steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        return self._ctx.latest_step()

    def manifest(self, step: int) -> Manifest:
        """The manifest of a committed ``step``, as stored now.

        Raises:
            CheckpointNotFoundError: the step was never committed (or was deleted).
            CorruptCheckpointError: the manifest is damaged.
        """
        return self._ctx.manifest(step)

    # -- save --------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        metadata: dict[str, str] | None = None,
        overwrite: bool = False,
    ) -> SaveResult:
        """Save ``state`` as ``step``; durable and committed when this returns.

        Every rank of the process group must call it with the same step. A committed step
        is refused unless ``overwrite`` is True; then it is replaced by one atomic write of
        its manifest (until then the old step stays loadable; a crash leaves it whole).

        Raises:
            StepExistsError: ``step`` is committed and ``overwrite`` is False (every rank).
            UnsupportedValueError: the tree holds something that cannot be stored.
            StorageError: the store failed (full, read-only, ...); earlier checkpoints stay.
            DistributedError: another rank failed; nothing was committed.
        """
        request = SaveRequest(step, metadata, overwrite)
        self._async.flush()  # saves commit in call order; earlier async errors surface here

        def capture() -> tuple[list[LocalItem], dict[str, Any]]:
            flat = flatten(state)
            return local_items(flat), flat.skeleton

        g, t0 = self._ctx.group, time.perf_counter()
        return self._saver.write(request, capture, g, t0)

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
        request = SaveRequest(step, metadata, overwrite)
        return self._async_saves.save_async(request, state, lazy)

    def save_captured(self, request: SaveRequest, captured: StagedCapture) -> PendingSave:
        """Persist a capture made by another tier; see :meth:`AsyncSaves.save_captured`."""
        return self._async_saves.save_captured(request, captured)

    def check_new_step(self, step: int, *, overwrite: bool = False) -> None:
        """Refuse, on every rank alike, to replace ``step`` unless ``overwrite`` is True.

        Collective; see :meth:`AsyncSaves.check_new_step`.

        Raises:
            StepExistsError: ``step`` is committed or in flight and ``overwrite`` is False.
        """
        self._async_saves.check_new_step(step, overwrite=overwrite)

    def wait(self) -> None:
        """Wait for every save in flight; raise the first failure nobody has seen."""
        self._async_saves.wait()

    def wait_staged(self) -> None:
        """Wait until every save in flight has copied its state (used by :meth:`guard`)."""
        self._async_saves.wait_staged()

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step()`` wait for lazy copies still in flight (install once).

        Its parameters and state may then be copied lazily: they must change only in
        ``optimizer.step()`` (the usual case; an in-place edit of a parameter between
        ``save_async`` and the step would leak into the checkpoint). :meth:`close` takes the
        guard off again.
        """
        return self._async_saves.guard(optimizer)

    def deferrable(self) -> frozenset[int]:
        """Storages a lazy save may copy late: those of the guarded optimizers."""
        return self._async_saves.deferrable()

    # -- load --------------------------------------------------------------------------

    @property
    def last_load(self) -> LoadResult | None:
        """What the last :meth:`load` loaded (step, seconds, bytes, skipped, mismatched)."""
        return self._loader.last_load

    def load(
        self,
        state: Any = None,
        step: int | None = None,
        *,
        strict: bool = True,
        fallback: bool = False,
    ) -> Any:
        """Load a checkpoint into ``state``'s tensors in place and return the loaded tree.

        This checkpointer's saves still in flight (``save_async``) are waited for first.

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
        return self._loader.load(state, step, strict, fallback)

    def read_tensor(
        self, step: int, name: str, *, leased: bool = False
    ) -> tuple[torch.Tensor, int]:
        """The whole tensor ``name`` of ``step`` as a CPU tensor, every chunk verified,
        and the number of bytes read (see :meth:`Loader.read_tensor`; ``leased``: the caller
        holds a reader lease on ``step``, so none is written per tensor)."""
        return self._loader.read_tensor(step, name, leased=leased)

    def verify(
        self,
        step: int | None = None,
        *,
        pool: ThreadPoolExecutor | None = None,
        progress: Progress | None = None,
    ) -> VerifyReport:
        """Read and hash every chunk of ``step`` (the newest when None); report all damage.

        Unlike ``load``, this does not stop at the first problem: ``report.damaged`` lists
        every damaged chunk with its tensor and shard. ``report.ok`` is True when intact.

        Args:
            step: a committed step; the newest when None.
            pool: threads that read and hash chunks; ``options.io_threads`` of them, made
                for this call, by default.
            progress: called as ``progress(done, total)`` after each distinct chunk.
        """
        return self._loader.verify(step, pool, progress)

    # -- maintenance -------------------------------------------------------------------

    def delete(self, step: int, *, force: bool = False) -> GCReport:
        """Un-commit ``step`` (its manifest) and delete at once the packs only it used.

        Its packs go as retention's do (:func:`~.gc.retire`): those another step or a live
        lease uses stay; with a damaged manifest (this step's included) none goes now, and
        the next gc() takes them after its grace. Returns what was deleted and freed.

        Works on a step whose manifest is damaged, so that it can be cleared away. A step a
        live reader holds a lease on (a load in progress, here or in another process) is
        refused unless ``force``: forced, that reader fails with ``StepRetiredError`` instead
        of finishing its load (its packs stay until its lease ends either way).

        Raises:
            CheckpointNotFoundError: ``step`` is not committed.
            CheckpointError: a live lease holds ``step`` and ``force`` is False.
        """
        store = self._ctx.store(create=False)
        if step not in self.steps():
            raise CheckpointNotFoundError(
                f"step {step} is not a committed checkpoint in {store.url}; committed steps: "
                f"{short_steps(self.steps())}"
            )
        if not force and step in read_leases(store).read_steps:
            raise CheckpointError(
                f"step {step} in {store.url} is being read now (a live lease under leases/); "
                "delete it once that load finished, or pass force=True (CLI: --force) to "
                "delete it anyway: the reader then fails instead of finishing its load"
            )
        report = retire(store, [step], self.steps(), self._ctx.manifest, asked=True)
        self._ctx.cache.forget(step)
        return report

    def gc(self, *, grace_s: float | None = None) -> GCReport:
        """Apply retention, then delete pack files no checkpoint or lease references."""
        store = self._ctx.store(create=False)
        report = self._saver.retain(store)
        grace = self.options.gc_grace_s if grace_s is None else grace_s
        return collect_garbage(store, grace_s=grace, report=report)

    def on_close(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` when this checkpointer closes: an integration takes off there the
        hooks it installed for it on the user's objects (a closed checkpointer must not be
        called, nor kept alive, by them)."""
        self._on_close.append(fn)

    def close(self) -> None:
        """Wait for saves in flight, then release threads and connections.

        Raises:
            CheckpointError: a background save failed and nobody has seen it yet (its step
                was not committed; earlier checkpoints are intact). Everything is released
                first.
        """
        try:
            self._async.close()
        finally:
            callbacks, self._on_close = self._on_close, []
            for fn in callbacks:
                fn()
            self._async_saves.close()
            self._ctx.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        close_on_exit(self.close, exc_type)

    def __repr__(self) -> str:
        return f"Checkpointer({str(self._root)!r})"


def close_on_exit(close: Callable[[], object], exc_type: object) -> None:
    """``close()`` as a ``with`` block ends. While an error unwinds, a background save that
    failed unseen is logged instead of raised, so it does not hide that first error."""
    if exc_type is None:
        close()
        return
    try:
        close()
    except CheckpointError as e:
        log.error("%s", e)
