"""The public checkpointer: save, load, list, verify, retain and collect.

    save(step, tree) ──► plan ──► persist ──► commit ──► retain
    load(tree, step) ──► manifest ──► check keys/shapes ──► read boxes (verified) ──► tree

A save is durable and committed when it returns: every rank's pack is written atomically
and durably, then rank 0 writes the manifest (atomically) once all ranks reported success.
A crash at any instant leaves every earlier checkpoint loadable and no partial one visible.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from stalwart.checkpoint.collective import Group, resolve_group
from stalwart.checkpoint.durable.async_api import AsyncSaves, check_save_args, refuse_replacing
from stalwart.checkpoint.durable.async_save import AsyncSaver
from stalwart.checkpoint.durable.commit import build_manifest
from stalwart.checkpoint.durable.gc import GCReport, Lease, apply_retention, collect_garbage
from stalwart.checkpoint.durable.loading import Loads, short_steps
from stalwart.checkpoint.durable.manifest import (
    MANIFEST_PREFIX,
    ChunkRef,
    Manifest,
    manifest_key,
    step_from_key,
)
from stalwart.checkpoint.durable.manifest_cache import ManifestCache
from stalwart.checkpoint.durable.persist import FastIndex, persist_boxes
from stalwart.checkpoint.durable.plan import LocalItem, local_items, merge_skeletons, plan_writes
from stalwart.checkpoint.durable.results import LoadResult, SaveResult
from stalwart.checkpoint.events import CheckpointEvent, emit
from stalwart.checkpoint.options import CheckpointOptions
from stalwart.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    ObjectNotFoundError,
)
from stalwart.storage import open_storage
from stalwart.storage.base import ObjectInfo, Storage
from stalwart.storage.local import LocalStorage
from stalwart.tree import flatten

__all__ = ["Checkpointer", "LoadResult", "SaveResult"]

log = logging.getLogger(__name__)


class Checkpointer(AsyncSaves, Loads):
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
        self._storage_options = storage_options
        self._storage: Storage | None = None
        self._process_group = process_group
        self._pool = ThreadPoolExecutor(self.options.io_threads, thread_name_prefix="stalwart-io")
        self._tensor_pool = ThreadPoolExecutor(
            self.options.io_threads, thread_name_prefix="stalwart-tensor"
        )
        self._cache = ManifestCache()  # parses, each checked against the store before use
        self.last_load: LoadResult | None = None
        self._async = AsyncSaver(self.options.max_inflight_saves, self.options.exit_flush_timeout_s)
        self._background: Group | None = None
        self._fast_index: FastIndex = {}
        self._guarded: list[torch.optim.Optimizer] = []

    @property
    def _group(self) -> Group:
        # Resolved at each call, so a checkpointer made before init_process_group still
        # coordinates the ranks (and does not race them as independent one-rank jobs).
        return resolve_group(self._process_group)

    # -- storage -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Where the checkpoints live."""
        return self._store(create=False).url if self._exists() else str(self._root)

    def _exists(self) -> bool:
        if self._storage is not None or not isinstance(self._root, (str, os.PathLike)):
            return True
        s = os.fspath(self._root)
        return ("://" in s and not s.startswith("file://")) or Path(
            s.removeprefix("file://")
        ).is_dir()

    def _store(self, *, create: bool) -> Storage:
        gone = isinstance(self._storage, LocalStorage) and not Path(self._storage.root).is_dir()
        if create and gone:
            # Deleted under us (by a person or a cleanup job): a save recreates it, loudly.
            log.warning(
                "checkpoint root %s was deleted while this Checkpointer was open; recreating "
                "it (the checkpoints it held are gone)",
                self._storage.url,  # type: ignore[union-attr]
            )
            os.makedirs(self._storage.root, exist_ok=True)  # type: ignore[union-attr]
            self._cache.clear()
        if self._storage is None:
            if not create and not self._exists():
                raise CheckpointNotFoundError(
                    f"checkpoint root {os.fspath(self._root)!r} does not exist; check the path "  # type: ignore[arg-type]
                    "(it is created by the first save)"
                )
            self._storage = open_storage(
                self._root, storage_options=self._storage_options, create=True
            )
        return self._storage

    @property
    def storage(self) -> Storage:
        """The store under the root (read API for tools such as verify, diff and export).

        Raises:
            CheckpointNotFoundError: the root does not exist.
        """
        return self._store(create=False)

    # -- listing -----------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending (empty when the root holds none or does not exist)."""
        if not self._exists():
            return []
        keys = self._store(create=False).list(MANIFEST_PREFIX)
        return sorted(s for s in (step_from_key(i.key) for i in keys) if s is not None)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int) -> Manifest:
        """The manifest of a committed ``step``.

        Raises:
            CheckpointNotFoundError: the step was never committed (or was deleted).
            CorruptCheckpointError: the manifest is damaged.
        """
        return self._manifest(step)

    def _manifest(self, step: int, listed: ObjectInfo | None = None) -> Manifest:
        # As stored now, never an older copy: another process may have replaced or deleted
        # the step, and retention, dedup and load must act on what is there (see
        # manifest_cache). ``listed``: the step's entry in a listing made before this call.
        store = self._store(create=False)
        try:
            return self._cache.get(store, step, listed=listed)
        except ObjectNotFoundError:
            steps = self.steps()
            raise CheckpointNotFoundError(
                f"step {step} is not a committed checkpoint in {store.url}; committed steps: "
                f"{short_steps(steps)}" + ("" if steps else " (none yet)")
            ) from None

    def _known_chunks(self, steps: list[int]) -> dict[str, ChunkRef]:
        # Manifests as stored now (see _manifest): dedup must never reference a pack that
        # only an out-of-date copy of a manifest names. The listing comes before the reads.
        self._cache.keep_only(set(steps))
        listed = {step_from_key(i.key): i for i in self._store(create=False).list(MANIFEST_PREFIX)}
        known: dict[str, ChunkRef] = {}
        for s in steps:
            try:
                m = self._manifest(s, listed.get(s))
            except (CheckpointNotFoundError, CorruptCheckpointError) as e:
                log.warning("not deduplicating against step %s: %s", s, e)
                continue
            for c in m.chunks():
                known.setdefault(c.hash, c)
        return known

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
        check_save_args(step, metadata)
        self._async.flush()  # saves commit in call order; earlier async errors surface here

        def capture() -> tuple[list[LocalItem], dict[str, Any]]:
            flat = flatten(state)
            return local_items(flat), flat.skeleton

        return self._write(step, capture, metadata, self._group, time.perf_counter(), overwrite)

    def _write(
        self,
        step: int,
        capture: Callable[[], tuple[list[LocalItem], dict[str, Any]]],
        metadata: dict[str, str] | None,
        g: Group,
        t0: float,
        overwrite: bool,
    ) -> SaveResult:
        """:meth:`_write_step`, reported to ``options.on_event`` (saved or failed)."""
        on_event, meta = self.options.on_event, dict(metadata or {})
        try:
            r = self._write_step(step, capture, metadata, g, t0, overwrite)
        except BaseException as e:
            seconds = time.perf_counter() - t0
            failed = CheckpointEvent("save_failed", step, self.url, g.rank, seconds, metadata=meta)
            emit(on_event, dataclasses.replace(failed, error=repr(e)))
            raise
        sizes = (r.bytes_total, r.bytes_written)
        emit(
            on_event,
            CheckpointEvent("save", step, self.url, g.rank, r.seconds, *sizes, metadata=meta),
        )
        return r

    def _write_step(
        self,
        step: int,
        capture: Callable[[], tuple[list[LocalItem], dict[str, Any]]],
        metadata: dict[str, str] | None,
        g: Group,
        t0: float,
        overwrite: bool,
    ) -> SaveResult:
        """Plan, persist, commit and retain; ``capture`` yields this rank's boxes + skeleton.

        Rank 0 leases the committed steps before any rank reads their manifests, so that
        another process's retention or GC cannot delete a pack this save deduplicates
        against between that read and the commit (retention honours leased steps). Every
        rank refuses a committed ``step`` on that one listing, before anything is written.
        """
        local: dict[str, Any] = {}
        with contextlib.ExitStack() as held:

            def listing() -> list[int]:
                local["store"] = store = self._store(create=True)
                steps = self.steps() if g.rank == 0 else []
                if g.rank == 0:
                    held.enter_context(
                        Lease(store, steps=steps, packs=(), lease_s=self.options.lease_s)
                    )
                return steps

            steps = g.run(f"listing steps before step {step}", listing)[0]
            if not overwrite:  # every rank decides on rank 0's listing: all raise alike
                refuse_replacing(step, steps, self.url)

            def prepare() -> tuple[list[tuple[Any, ...]], dict[str, Any]]:
                # Everything that can fail on one rank alone (opening the store, reading
                # manifests, flattening the state) runs inside g.run, so that such a failure
                # fails every rank instead of leaving the others in the next collective.
                local["items"], skeleton = capture()
                local["known"] = self._known_chunks(steps)
                return [it.describe() for it in local["items"]], skeleton

            described = g.run(f"preparing step {step}", prepare)
            store, items, known = local["store"], local["items"], local["known"]
            plan = plan_writes(items, [d[0] for d in described], g.rank)
            skeleton = merge_skeletons([d[1] for d in described])
            pack_key = f"packs/step-{step:020d}-rank{g.rank:05d}-{uuid.uuid4().hex[:12]}.pack"

            def persist() -> Any:
                shards, stats = persist_boxes(
                    store,
                    plan.writes,
                    pack_key=pack_key,
                    known=known,
                    options=self.options,
                    pool=self._pool,
                    previous=self._fast_index,
                )
                local["fast_index"], stats.fast_index = stats.fast_index, {}  # this rank's
                return {k: s.to_json() for k, s in shards.items()}, stats

            if g.rank == 0:
                packs = {c.pack for c in known.values()}
                held.enter_context(
                    Lease(store, steps=steps, packs=packs, lease_s=self.options.lease_s)
                )
            results = g.run(f"saving step {step}", persist)

            done = (step, plan.tensors, plan.aliases, skeleton, results, g.world, metadata, t0)
            g.run(f"committing step {step}", lambda: None if g.rank else self._commit(*done))
        if g.rank == 0:
            try:
                self._retain(store)
            except Exception:  # the checkpoint is committed; retention retries next save
                log.warning("retention after step %s failed", step, exc_info=True)
        self._fast_index = local["fast_index"]  # committed: valid for the next save
        g.all_gather(None)  # nobody returns before retention finished on rank 0
        return SaveResult.summed(step, time.perf_counter() - t0, [r[1] for r in results])

    def _commit(
        self,
        step: int,
        tensors: dict[str, tuple[str, tuple[int, ...]]],
        aliases: dict[str, Any],
        skeleton: dict[str, Any],
        results: list[Any],
        world: int,
        metadata: dict[str, str] | None,
        t0: float,
    ) -> Manifest:
        m = build_manifest(step, tensors, skeleton, results, world, metadata, t0, aliases=aliases)
        data = m.to_bytes()
        self._store(create=True).write(manifest_key(step), [data])
        self._cache.adopt(step, data, m)  # known bytes: the next check is one read, no parse
        return m

    def _retain(self, store: Storage) -> GCReport:
        report = apply_retention(store, self.options.keep, self.steps(), self.manifest)
        for s in report.deleted_steps:
            self._cache.forget(s)
        return report

    # -- maintenance -------------------------------------------------------------------

    def delete(self, step: int) -> None:
        """Un-commit ``step`` (its manifest); its unshared packs go at the next gc().

        Works on a step whose manifest is damaged, so that it can be cleared away.
        """
        store = self._store(create=False)
        if step not in self.steps():
            raise CheckpointNotFoundError(
                f"step {step} is not a committed checkpoint in {store.url}; committed steps: "
                f"{short_steps(self.steps())}"
            )
        store.delete(manifest_key(step))
        self._cache.forget(step)

    def gc(self, *, grace_s: float | None = None) -> GCReport:
        """Apply retention, then delete pack files no checkpoint or lease references."""
        store = self._store(create=False)
        report = self._retain(store)
        grace = self.options.gc_grace_s if grace_s is None else grace_s
        return collect_garbage(store, grace_s=grace, report=report)

    def close(self) -> None:
        """Wait for saves in flight, then release threads and connections."""
        self._async.close()
        self._tensor_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        if self._storage is not None:
            self._storage.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpointer({str(self._root)!r})"
