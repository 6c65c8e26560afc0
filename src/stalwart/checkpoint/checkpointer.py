"""The public checkpointer: save, load, list, verify, retain and collect.

    save(step, tree) ──► plan ──► persist ──► commit ──► retain
    load(tree, step) ──► manifest ──► check keys/shapes ──► read boxes (verified) ──► tree

A save is durable and committed when it returns: every rank's pack is written atomically
and durably, then rank 0 writes the manifest (atomically) once all ranks reported success.
A crash at any instant leaves every earlier checkpoint loadable and no partial one visible.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stalwart.checkpoint.collective import resolve_group
from stalwart.checkpoint.gc import GCReport, Lease, collect_garbage, read_leases
from stalwart.checkpoint.manifest import (
    MANIFEST_PREFIX,
    ChunkRef,
    Manifest,
    TensorEntry,
    manifest_key,
    step_from_key,
)
from stalwart.checkpoint.options import CheckpointOptions
from stalwart.checkpoint.persist import persist_boxes
from stalwart.checkpoint.plan import local_box, local_items, merge_skeletons, plan_writes
from stalwart.checkpoint.reshard import read_box
from stalwart.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DistributedError,
    ObjectNotFoundError,
    StalwartError,
    StateMismatchError,
)
from stalwart.storage import open_storage
from stalwart.storage.base import Storage
from stalwart.tree import (
    FlatTree,
    dtype_from_name,
    dtype_name,
    flatten,
    get_path,
    iter_skeleton_tensors,
    unflatten,
)

if TYPE_CHECKING:
    from stalwart.checkpoint.verify import VerifyReport

__all__ = ["Checkpointer", "LoadResult", "SaveResult"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveResult:
    """What a save did, summed over all ranks.

    Attributes:
        step: the committed step.
        seconds: wall time of the save on this rank.
        bytes_total: logical bytes of all tensors saved (raw, before dedup/compression).
        bytes_written: bytes actually written to packs.
        bytes_reused: logical bytes not written because the store already held them.
        chunks_written: new chunks written.
        chunks_reused: chunks deduplicated.
    """

    step: int
    seconds: float
    bytes_total: int
    bytes_written: int
    bytes_reused: int
    chunks_written: int
    chunks_reused: int


@dataclass
class LoadResult:
    """What the last load did.

    Attributes:
        step: the step loaded.
        seconds: wall time on this rank.
        bytes_read: stored bytes read by this rank (all verified).
        skipped: ``(step, reason)`` for newer steps passed over by ``fallback=True``.
        mismatched: problems ignored because ``strict=False``.
    """

    step: int
    seconds: float
    bytes_read: int
    skipped: list[tuple[int, str]] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)


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
        self._storage_options = storage_options
        self._storage: Storage | None = None
        self._group = resolve_group(process_group)
        self._pool = ThreadPoolExecutor(self.options.io_threads, thread_name_prefix="stalwart-io")
        self._tensor_pool = ThreadPoolExecutor(
            self.options.io_threads, thread_name_prefix="stalwart-tensor"
        )
        self._manifests: dict[int, Manifest] = {}
        self.last_load: LoadResult | None = None

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
        if step in self._manifests:
            return self._manifests[step]
        store = self._store(create=False)
        key = manifest_key(step)
        try:
            data = store.read(key)
        except ObjectNotFoundError:
            steps = self.steps()
            raise CheckpointNotFoundError(
                f"step {step} is not a committed checkpoint in {store.url}; committed steps: "
                f"{_short(steps)}" + ("" if steps else " (none yet)")
            ) from None
        m = Manifest.from_bytes(data, where=f"{store.url}/{key}")
        if m.step != step:
            raise CorruptCheckpointError(f"{store.url}/{key} claims step {m.step}, not {step}")
        self._manifests[step] = m
        return m

    def _known_chunks(self, steps: list[int]) -> dict[str, ChunkRef]:
        for s in list(self._manifests):
            if s not in steps:
                del self._manifests[s]
        known: dict[str, ChunkRef] = {}
        for s in steps:
            try:
                m = self.manifest(s)
            except (CheckpointNotFoundError, CorruptCheckpointError) as e:
                log.warning("not deduplicating against step %s: %s", s, e)
                continue
            for c in m.chunks():
                known.setdefault(c.hash, c)
        return known

    # -- save --------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, metadata: dict[str, str] | None = None) -> SaveResult:
        """Save ``state`` as ``step``; durable and committed when this returns.

        Every rank of the process group must call it with the same step. Saving a step
        that already exists replaces it atomically.

        Raises:
            UnsupportedValueError: the tree holds something that cannot be stored.
            StorageError: the store failed (full, read-only, ...); earlier checkpoints stay.
            DistributedError: another rank failed; nothing was committed.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        if metadata and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise ConfigError("metadata must map str to str")
        t0 = time.perf_counter()
        g = self._group
        store = self._store(create=True)
        flat = flatten(state)
        items = local_items(flat)
        described = g.all_gather(([it.describe() for it in items], flat.skeleton))
        plan = plan_writes(items, [d[0] for d in described], g.rank)
        skeleton = merge_skeletons([d[1] for d in described])
        steps = self.steps()
        known = self._known_chunks(steps)
        lease = Lease(
            store, steps=steps, packs={c.pack for c in known.values()}, lease_s=self.options.lease_s
        )
        pack_key = f"packs/step-{step:020d}-rank{g.rank:05d}-{uuid.uuid4().hex[:12]}.pack"

        def persist() -> Any:
            shards, stats = persist_boxes(
                store,
                plan.writes,
                pack_key=pack_key,
                known=known,
                options=self.options,
                pool=self._pool,
            )
            return {k: s.to_json() for k, s in shards.items()}, stats

        with lease if g.rank == 0 else _nullcontext():
            results = g.run(f"saving step {step}", persist)

            def commit() -> Manifest | None:
                if g.rank != 0:
                    return None
                return self._commit(step, plan.tensors, skeleton, results, metadata, t0)

            g.run(f"committing step {step}", commit)
        if g.rank == 0:
            try:
                self._retain(store)
            except Exception:  # the checkpoint is committed; retention retries next save
                log.warning("retention after step %s failed", step, exc_info=True)
        stats = [r[1] for r in results]
        g.all_gather(None)  # nobody returns before retention finished on rank 0
        return SaveResult(
            step=step,
            seconds=time.perf_counter() - t0,
            bytes_total=sum(s.bytes_total for s in stats),
            bytes_written=sum(s.bytes_written for s in stats),
            bytes_reused=sum(s.bytes_reused for s in stats),
            chunks_written=sum(s.chunks_written for s in stats),
            chunks_reused=sum(s.chunks_reused for s in stats),
        )

    def _commit(
        self,
        step: int,
        tensors: dict[str, tuple[str, tuple[int, ...]]],
        skeleton: dict[str, Any],
        results: list[Any],
        metadata: dict[str, str] | None,
        t0: float,
    ) -> Manifest:
        from stalwart.checkpoint.manifest import ShardEntry

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
        entries = {
            fqn: TensorEntry(dtype, shape, tuple(sorted(shards[fqn], key=lambda s: s.offsets)))
            for fqn, (dtype, shape) in tensors.items()
        }
        stats = [r[1] for r in results]
        m = Manifest(
            step=step,
            tensors=entries,
            skeleton=skeleton,
            world_size=self._group.world,
            created_unix=time.time(),
            metadata=dict(metadata or {}),
            stats={
                "bytes_total": float(sum(s.bytes_total for s in stats)),
                "bytes_written": float(sum(s.bytes_written for s in stats)),
                "bytes_reused": float(sum(s.bytes_reused for s in stats)),
                "seconds": time.perf_counter() - t0,
            },
        )
        self._store(create=True).write(manifest_key(step), [m.to_bytes()])
        self._manifests[step] = m
        return m

    def _retain(self, store: Storage) -> GCReport:
        report = GCReport()
        steps = self.steps()
        keep = set(self.options.keep.keep(steps))
        leases = read_leases(store)
        doomed = [s for s in steps if s not in keep and s not in leases.steps]
        if not doomed:
            return report
        kept_packs: set[str] = set(leases.packs)
        doomed_packs: set[str] = set()
        for s in steps:
            try:
                packs = self.manifest(s).packs()
            except CorruptCheckpointError:
                return report  # unknown references: delete nothing (gc() explains)
            (doomed_packs if s in doomed else kept_packs).update(packs)
        for s in doomed:
            store.delete(manifest_key(s))
            self._manifests.pop(s, None)
            report.deleted_steps.append(s)
        sizes = {i.key: i.size for i in store.list("packs/")}
        for p in sorted(doomed_packs - kept_packs):
            store.delete(p)
            report.deleted_packs.append(p)
            report.bytes_freed += sizes.get(p, 0)
        log.info("retention deleted steps %s and %d packs", doomed, len(report.deleted_packs))
        return report

    # -- load --------------------------------------------------------------------------

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
        t0 = time.perf_counter()
        g = self._group
        steps = g.broadcast(self.steps())
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
                f"committed steps: {_short(steps)}"
            )
        if not fallback:
            candidates = candidates[:1]
        skipped: list[tuple[int, str]] = []
        for s in candidates:
            try:
                tree, read, mismatched = self._load_step(s, state, strict)
                ok: tuple[bool, str] = (True, "")
            except CorruptCheckpointError as e:
                if not fallback and g.world == 1:
                    raise
                ok, err = (False, str(e)), e
            outcomes = g.all_gather(ok)
            bad = [msg for good, msg in outcomes if not good]
            if not bad:
                self.last_load = LoadResult(s, time.perf_counter() - t0, read, skipped, mismatched)
                if skipped:
                    log.warning("loaded step %s after skipping damaged steps %s", s, skipped)
                return tree
            if not fallback:
                if not ok[0]:
                    raise err
                raise DistributedError(f"loading step {s} failed on another rank: {bad[0]}")
            skipped.append((s, bad[0]))
            log.warning("step %s is damaged, falling back to an older one: %s", s, bad[0])
        raise CorruptCheckpointError(
            f"no checkpoint in {self.url} verifies (tried steps {[s for s, _ in skipped]}); "
            "see the reasons in .damaged",
            damaged=[f"step {s}: {why}" for s, why in skipped],
        )

    def _load_step(self, step: int, state: Any, strict: bool) -> tuple[Any, int, list[str]]:
        m = self.manifest(step)
        store = self._store(create=False)
        where = f"checkpoint {store.url} step {step}"
        flat = flatten(state) if state is not None else FlatTree(skeleton={"k": "none"})
        problems: list[str] = []
        targets: dict[str, torch.Tensor] = {}
        stateful_paths = [path for path, _ in flat.statefuls]
        for fqn, leaf in flat.leaves.items():
            e = m.tensors.get(fqn)
            t = leaf.tensor
            if e is None and any(leaf.path[: len(p)] == p for p in stateful_paths):
                # A stateful object decides in load_state_dict what it can do without
                # (nn.Module raises on missing keys; TrainingState re-derives a new
                # rank's RNG); the engine only refuses to write mismatched data.
                continue
            if e is None:
                problems.append(f"{fqn}: in the state but not in the checkpoint")
            elif tuple(t.shape) != e.shape:
                problems.append(
                    f"{fqn}: shape {list(t.shape)} in the state, {list(e.shape)} in the checkpoint"
                )
            elif dtype_name(t.dtype) != e.dtype:
                problems.append(
                    f"{fqn}: dtype {dtype_name(t.dtype)} in the state, {e.dtype} in the checkpoint"
                )
            else:
                targets[fqn] = t
        if problems and strict:
            raise StateMismatchError(
                f"the state does not match {where} ({len(problems)} problem(s)):\n  "
                + "\n  ".join(problems[:20])
                + ("\n  …" if len(problems) > 20 else "")
                + "\npass strict=False to load what matches and leave the rest untouched"
            )
        tensors = dict(targets)
        for fqn in iter_skeleton_tensors(m.skeleton):
            if fqn in tensors:
                continue
            e = m.tensors.get(fqn)
            if e is None:
                raise CorruptCheckpointError(f"{where}: skeleton names unknown tensor {fqn!r}")
            tensors[fqn] = torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
        with Lease(store, steps=[step], packs=m.packs(), lease_s=self.options.lease_s):
            # Tensors in parallel (many small ones are latency-bound); each tensor's chunks
            # in parallel on the I/O pool.
            futures = [
                self._tensor_pool.submit(self._fill, store, m.tensors[fqn], fqn, t, where)
                for fqn, t in tensors.items()
            ]
            read = sum(f.result() for f in futures)
        tree = unflatten(m.skeleton, tensors.__getitem__)
        for path, obj in reversed(flat.statefuls):
            try:
                sub = get_path(tree, path)
            except (KeyError, IndexError, TypeError):
                if strict:
                    raise StateMismatchError(
                        f"{'.'.join(map(str, path))}: not in {where}"
                    ) from None
                problems.append(f"{'.'.join(map(str, path))}: not in the checkpoint")
                continue
            _restore_stateful(obj, sub, path, strict, where, problems)
        return tree, read, problems

    def _fill(
        self, store: Storage, entry: TensorEntry, fqn: str, target: torch.Tensor, where: str
    ) -> int:
        offsets, _sizes, local = local_box(target)
        if local.numel() == 0:
            return 0
        direct = local.is_contiguous() and local.device.type == "cpu"
        dest = local if direct else torch.empty(local.shape, dtype=local.dtype)
        with torch.no_grad():
            stats = read_box(store, entry, fqn, offsets, dest, pool=self._pool, where=where)
            if not direct:
                local.copy_(dest)
        return stats.bytes_read

    # -- maintenance -------------------------------------------------------------------

    def verify(self, step: int | None = None) -> VerifyReport:
        """Read and hash every chunk of ``step`` (the newest when None); report all damage.

        Unlike ``load``, this does not stop at the first problem: ``report.damaged`` lists
        every damaged chunk with its tensor and shard. ``report.ok`` is True when intact.
        """
        from stalwart.checkpoint.verify import verify_step

        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"no committed checkpoint under {self.url}")
        return verify_step(self, step)

    def delete(self, step: int) -> None:
        """Un-commit ``step`` (its manifest); its unshared packs go at the next gc().

        Works on a step whose manifest is damaged, so that it can be cleared away.
        """
        store = self._store(create=False)
        if step not in self.steps():
            raise CheckpointNotFoundError(
                f"step {step} is not a committed checkpoint in {store.url}; committed steps: "
                f"{_short(self.steps())}"
            )
        store.delete(manifest_key(step))
        self._manifests.pop(step, None)

    def gc(self, *, grace_s: float | None = None) -> GCReport:
        """Apply retention, then delete pack files no checkpoint or lease references."""
        store = self._store(create=False)
        report = self._retain(store)
        grace = self.options.gc_grace_s if grace_s is None else grace_s
        return collect_garbage(store, grace_s=grace, report=report)

    def close(self) -> None:
        """Release threads and connections."""
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


def _restore_stateful(
    obj: Any, sub: Any, path: tuple[Any, ...], strict: bool, where: str, problems: list[str]
) -> None:
    """Hand ``sub`` to ``obj.load_state_dict``, translating a refusal into our errors."""
    name = ".".join(map(str, path)) or "<root>"
    try:
        if not strict and "strict" in inspect.signature(obj.load_state_dict).parameters:
            obj.load_state_dict(sub, strict=False)  # nn.Module: load what matches
        else:
            obj.load_state_dict(sub)
    except StalwartError:
        raise
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        msg = f"{name}: {type(obj).__name__}.load_state_dict refused {where}: {e}"
        if strict:
            raise StateMismatchError(
                msg + "\npass strict=False to load what matches and leave the rest untouched"
            ) from e
        problems.append(msg)
        log.warning("%s", msg)


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _short(steps: list[int]) -> str:
    if len(steps) <= 8:
        return str(steps)
    return f"[{steps[0]}, {steps[1]}, …, {steps[-2]}, {steps[-1]}] ({len(steps)} in all)"
