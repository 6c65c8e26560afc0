"""The writing half of a checkpointer: plan, persist, commit, retain one step.

    write(request, capture) ──► lease + list ──► plan ──► persist ──► commit ──► retain

A save is durable and committed when it returns: every rank's pack is written atomically
and durably, then rank 0 writes the manifest (atomically) once all ranks reported success.
A crash at any instant leaves every earlier checkpoint loadable and no partial one visible.
A save that fails deletes rank 0's packs (:func:`~.gc.discard_uncommitted`; the only rank that
knows no manifest will name them), so a full disk is not made fuller by every try of a
one-process job; a killed save leaves a temporary that the next ``gc`` removes.
The synchronous ``save`` and the background writer of ``save_async`` both call :meth:`write`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from stalwart.checkpoint.collective import Group
from stalwart.checkpoint.durable.commit import SaveRequest, build_manifest, refuse_replacing
from stalwart.checkpoint.durable.context import CheckpointContext
from stalwart.checkpoint.durable.gc import GCReport, apply_retention, discard_uncommitted
from stalwart.checkpoint.durable.lease import Lease
from stalwart.checkpoint.durable.manifest import (
    ChunkRef,
    Manifest,
    committed_manifests,
    manifest_key,
)
from stalwart.checkpoint.durable.persist import ChunkSink, FastIndex, persist_boxes
from stalwart.checkpoint.durable.plan import LocalItem, merge_skeletons, plan_writes
from stalwart.checkpoint.durable.results import SaveResult
from stalwart.checkpoint.durable.staging import StagingWindows
from stalwart.checkpoint.events import CheckpointEvent, emit
from stalwart.errors import CheckpointNotFoundError, CorruptCheckpointError
from stalwart.storage.base import Storage

__all__ = ["Capturer", "Saver"]

log = logging.getLogger(__name__)

Capturer = Callable[[], tuple[list[LocalItem], dict[str, Any]]]
"""Yields this rank's boxes and the state's skeleton, inside the save's first collective."""


class Saver:
    """Writes committed steps of one root; owns the fast index of the last committed save."""

    def __init__(self, ctx: CheckpointContext) -> None:
        self.ctx = ctx
        self.fast_index: FastIndex = {}  # valid for the next save once a save committed

    def write(
        self,
        request: SaveRequest,
        capture: Capturer,
        g: Group,
        t0: float,
        windows: StagingWindows | None = None,
    ) -> SaveResult:
        """:meth:`_write_step`, reported to ``options.on_event`` (saved or failed).

        ``windows``: stage the boxes this rank writes through a bounded buffer, window by
        window, as they are persisted (``capture`` then yields the live state's boxes).
        """
        step, on_event, url = request.step, self.ctx.options.on_event, self.ctx.url
        meta = dict(request.metadata or {})
        try:
            r = self._write_step(request, capture, g, t0, windows)
        except BaseException as e:
            seconds = time.perf_counter() - t0
            failed = CheckpointEvent("save_failed", step, url, g.rank, seconds, metadata=meta)
            emit(on_event, dataclasses.replace(failed, error=repr(e)))
            raise
        sizes = (r.bytes_total, r.bytes_written)
        emit(on_event, CheckpointEvent("save", step, url, g.rank, r.seconds, *sizes, metadata=meta))
        return r

    def _write_step(
        self,
        request: SaveRequest,
        capture: Capturer,
        g: Group,
        t0: float,
        windows: StagingWindows | None,
    ) -> SaveResult:
        """Plan, persist, commit and retain; ``capture`` yields this rank's boxes + skeleton.

        Rank 0 leases the committed steps before any rank reads their manifests, so that
        another process's retention or GC cannot delete a pack this save deduplicates
        against between that read and the commit (retention honours leased steps), and each
        rank then leases the packs it may reference (:meth:`_dedup_sources`). Every rank
        refuses a committed ``step`` on that one listing, before anything is written.
        """
        step, metadata, overwrite = request.step, request.metadata, request.overwrite
        ctx, local = self.ctx, dict[str, Any]()
        lease_s = ctx.options.lease_s
        with contextlib.ExitStack() as held:

            def listing() -> list[int]:
                local["store"] = store = ctx.store(create=True)
                steps = ctx.steps() if g.rank == 0 else []
                if g.rank == 0:
                    held.enter_context(Lease(store, steps=steps, packs=(), lease_s=lease_s))
                return steps

            steps = g.run(f"listing steps before step {step}", listing)[0]
            if not overwrite:  # every rank decides on rank 0's listing: all raise alike
                refuse_replacing(step, steps, ctx.url)

            def prepare() -> tuple[list[tuple[Any, ...]], dict[str, Any]]:
                # Everything that can fail on one rank alone (opening the store, reading
                # manifests, flattening the state) runs inside g.run, so that such a failure
                # fails every rank instead of leaving the others in the next collective.
                local["items"], skeleton = capture()
                local["known"] = self._dedup_sources(local["store"], steps, held)
                return [it.describe() for it in local["items"]], skeleton

            described = g.run(f"preparing step {step}", prepare)
            store, items, known = local["store"], local["items"], local["known"]
            plan = plan_writes(items, [d[0] for d in described], g.rank)
            skeleton = merge_skeletons([d[1] for d in described])
            pack_key = f"packs/step-{step:020d}-rank{g.rank:05d}-{uuid.uuid4().hex[:12]}.pack"
            local["packs"] = [pack_key]  # and a pack per further staging window

            def persist() -> Any:
                return self._persist(store, plan.writes, pack_key, known, local, windows)

            held.enter_context(_discarded_on_failure(store, local["packs"], g.rank))
            results = g.run(f"saving step {step}", persist)

            done = (step, plan.tensors, plan.aliases, skeleton, results, g.world, metadata, t0)
            g.run_on_root(f"committing step {step}", lambda: self._commit(*done))
        if g.rank == 0:
            self._retain_after(step, store)
        self.fast_index = local["fast_index"]  # committed: valid for the next save
        g.count(True)  # nobody returns before retention finished on rank 0
        return SaveResult.summed(step, time.perf_counter() - t0, [r[1] for r in results])

    def _persist(
        self,
        store: Storage,
        writes: Any,
        pack_key: str,
        known: dict[str, ChunkRef],
        local: dict[str, Any],
        windows: StagingWindows | None = None,
    ) -> tuple[dict[Any, Any], Any]:
        """Write this rank's pack; its shard records (JSON) and stats go to the commit.

        With ``windows``, one pack per staging window, each a fresh name of the same form
        (``gc`` collects only names of that form).
        The new fast index stays in ``local`` until the commit: valid only once committed.
        """
        sink = ChunkSink(store, known, self.ctx.options, self.ctx.io_pool, previous=self.fast_index)
        if windows is None:
            shards, stats = persist_boxes(sink, writes, pack_key)
        else:
            stem = pack_key[: -len("-0123456789ab.pack")]

            def window_pack(i: int) -> str:
                key = pack_key if i == 0 else f"{stem}-{uuid.uuid4().hex[:12]}.pack"
                if i:
                    local["packs"].append(key)  # a failed save deletes them all
                return key

            shards, stats = windows.persist(sink, writes, window_pack)
        local["fast_index"], stats.fast_index = stats.fast_index, {}  # this rank's
        return {k: s.to_json() for k, s in shards.items()}, stats

    def _dedup_sources(
        self, store: Storage, steps: list[int], held: contextlib.ExitStack
    ) -> dict[str, ChunkRef]:
        """The committed chunks this rank may reference, under its own lease on their packs.

        Read the manifests, lease their packs, read the manifests again. A step may have been
        replaced in between (``save(overwrite=True)`` elsewhere), and a gc that read the
        leases before this one was written may already have condemned the packs that only the
        old version named: chunks in a pack that no manifest read now names are written again
        instead. Packs of a step deleted meanwhile stay usable: gc deletes no pack while a
        live lease names a deleted step. Every rank leases what it read itself, since ranks
        may read different versions of a replaced step. See docs/checkpoint.md, "Saves,
        leases and gc".
        """
        known, read = self._known_chunks(steps)
        packs = {c.pack for c in known.values()}
        held.enter_context(Lease(store, steps=steps, packs=packs, lease_s=self.ctx.options.lease_s))
        replaced = self._replaced(read)
        if not replaced:
            return known
        named = set().union(*(replaced.get(s, m).packs() for s, m in read.items()))
        log.info(
            "step(s) %s were replaced while this save read them: writing again the chunks of "
            "%d pack(s) only their old versions named",
            sorted(replaced),
            len(packs - named),
        )
        return {h: c for h, c in known.items() if c.pack in named}

    def _known_chunks(self, steps: list[int]) -> tuple[dict[str, ChunkRef], dict[int, Manifest]]:
        """Every chunk of ``steps``, by hash, and the manifests it came from."""
        # Manifests as stored now (see CheckpointContext.manifest): dedup must never reference
        # a pack that only an out-of-date copy of a manifest names. Listing before reading.
        self.ctx.cache.keep_only(set(steps))
        listed = committed_manifests(self.ctx.store(create=False))
        known: dict[str, ChunkRef] = {}
        read: dict[int, Manifest] = {}
        for s in steps:
            try:
                read[s] = m = self.ctx.manifest(s, listed.get(s))
            except (CheckpointNotFoundError, CorruptCheckpointError) as e:
                log.warning("not deduplicating against step %s: %s", s, e)
                continue
            for c in m.chunks():
                known.setdefault(c.hash, c)
        return known, read

    def _replaced(self, read: dict[int, Manifest]) -> dict[int, Manifest]:
        """The steps of ``read`` whose manifest is another one now: that one, by step."""
        listed = committed_manifests(self.ctx.store(create=False))
        replaced: dict[int, Manifest] = {}
        for s, m in read.items():
            try:
                now = self.ctx.manifest(s, listed[s])
            except (KeyError, CheckpointNotFoundError, CorruptCheckpointError):
                continue  # deleted, or damaged: gc deletes no pack until it is repaired
            if now is not m and now != m:
                replaced[s] = now
        return replaced

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
        self.ctx.store(create=True).write(manifest_key(step), [data])
        self.ctx.cache.adopt(step, data, m)  # known bytes: the next check is one read, no parse
        return m

    def _retain_after(self, step: int, store: Storage) -> None:
        try:
            self.retain(store)
        except Exception:  # the checkpoint is committed; retention retries next save
            log.warning("retention after step %s failed", step, exc_info=True)

    def retain(self, store: Storage) -> GCReport:
        """Apply the retention policy to ``store``; forget the steps it deleted."""
        report = apply_retention(store, self.ctx.options.keep, self.ctx.steps(), self.ctx.manifest)
        for s in report.deleted_steps:
            self.ctx.cache.forget(s)
        return report


@contextlib.contextmanager
def _discarded_on_failure(store: Storage, packs: list[str], rank: int) -> Iterator[None]:
    """Delete ``packs`` (rank 0's, of a save in flight) when the save fails.

    Only rank 0 does: it writes the manifest, so when it fails no manifest naming the packs
    comes later. Another rank whose collective timed out cannot tell whether rank 0 went on
    to commit a manifest naming its pack; its pack stays until gc finds it unreferenced.
    """
    try:
        yield
    except BaseException:
        if rank != 0:
            raise
        try:
            discard_uncommitted(store, packs)
        except Exception:  # the save's own error is the one to raise
            log.warning("could not delete the packs %s of a failed save", packs, exc_info=True)
        raise
