"""DCP (``torch.distributed.checkpoint``) adapters: stalwart's format under ``dcp.save``/``load``.

* :class:`StalwartWriter` and :class:`StalwartReader` are a DCP ``StorageWriter`` /
  ``StorageReader`` pair. ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` (and so
  torchtitan's checkpoint manager) read and write stalwart checkpoints: every rank's boxes
  become content-addressed chunks in one pack per rank (a chunk the root already holds is
  not written again), and the coordinator commits one stalwart manifest last, atomically.
  The step comes from ``checkpoint_id``: an int, or a name ending in digits
  (``"step-100"``, ``"runs/x/step-100"``; with no root given, the parent is the root).
  Loading verifies every chunk it reads (BLAKE3) before its bytes land; DCP's planner asks
  for any sub-box of any saved shard, so loads reshard to any world size and placement.
* Non-tensor values: DCP hands the writer a ``torch.save`` pickle of each. A value that
  ``torch.load(weights_only=True)`` reads back as plain data (numbers, strings, lists, ...)
  is stored as plain JSON in the manifest's skeleton, and the reader re-serialises it, so
  loading runs no pickle from the checkpoint. Any other value is stored as its pickle bytes
  and loading it needs ``StalwartReader(..., trust_pickle=True)``.
* :func:`export_dcp` writes a stalwart step to a DCP folder (or fsspec URL) with DCP's own
  writer, reading one tensor at a time; :func:`import_dcp` reads a DCP folder or URL with
  DCP's own reader, a batch of tensors at a time, without unpickling its ``.metadata``
  (see :mod:`stalwart.checkpoint.tools.dcp_import`), and commits it as a stalwart step.
"""

from __future__ import annotations

import io
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    LoadPlan,
    LoadPlanner,
    Metadata,
    SavePlan,
    SavePlanner,
    StorageReader,
    StorageWriter,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta, TensorProperties
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from stalwart.checkpoint.durable.checkpointer import Checkpointer
from stalwart.checkpoint.durable.manifest import Manifest
from stalwart.checkpoint.durable.persist import PersistStats
from stalwart.checkpoint.durable.plan import LocalItem
from stalwart.checkpoint.durable.reshard import Box, read_boxes
from stalwart.checkpoint.options import CheckpointOptions
from stalwart.errors import CheckpointNotFoundError, ConfigError
from stalwart.integrations.dcp_root import (
    PICKLED_KEY,
    READ_BATCH_BYTES,
    Root,
    dcp_leaves,
    fqn_of,
    parse_checkpoint_id,
    plain_value,
    strip_numpy,
)
from stalwart.tree import dtype_from_name, dtype_name, flatten, unflatten

__all__ = ["StalwartReader", "StalwartWriter", "export_dcp", "import_dcp"]  # noqa: F822

_TRUST_HINT = (
    "loading it would run a pickle from the checkpoint; if you trust the checkpoint, pass "
    "StalwartReader(..., trust_pickle=True)"
)


@dataclass(frozen=True)
class _Stored:
    """``WriteResult.storage_data``: a tensor box's shard entry, or a non-tensor value."""

    shard: dict[str, Any] | None = None
    value: Any = None
    pickled: bool = False
    stats: PersistStats | None = None


class StalwartWriter(StorageWriter):
    """A DCP ``StorageWriter`` that saves into a stalwart root (chunked, deduplicated).

    Args:
        root: the stalwart root (a folder or fsspec URL); None takes the parent of each
            ``checkpoint_id`` (``dcp.save(sd, checkpoint_id="runs/x/step-10", ...)``).
        step: the step to save when no ``checkpoint_id`` is passed to ``dcp.save``.
        options: chunking, compression, threads and retention.
        storage_options: passed to fsspec for remote roots.
        overwrite: replace a committed step (atomically); False refuses it with
            ``StepExistsError`` in DCP's ``CheckpointException``, as ``FileSystemWriter`` does.

    Example:
        >>> dcp.save(state, checkpoint_id=step, storage_writer=StalwartWriter("runs/x"))
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        step: int | None = None,
        options: CheckpointOptions | None = None,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
    ) -> None:
        super().__init__()
        self._root_arg, self.step, self.overwrite = root, step, overwrite
        self.options = options or CheckpointOptions()
        self._storage_options = storage_options
        self._root: Root | None = None
        self._root_url: Any = None
        self._t0 = time.perf_counter()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._t0 = time.perf_counter()
        if self._root is not None:
            self._root.release()  # a save that failed before its commit
        if checkpoint_id is None:
            return
        parent, self.step = parse_checkpoint_id(checkpoint_id)
        root = self._root_arg if self._root_arg is not None else parent
        if root is None:
            raise ConfigError(
                f"checkpoint_id {checkpoint_id!r} names no folder and the writer has no root; "
                "pass StalwartWriter(root) or a checkpoint_id like 'runs/x/step-100'"
            )
        if self._root is not None and root != self._root_url:
            self._root.close()
            self._root = None
        self._root_url = root

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            parse_checkpoint_id(checkpoint_id)
        except (ConfigError, TypeError):
            return False
        return True

    def _open(self) -> Root:
        if self.step is None:
            raise ConfigError("no step to save: pass checkpoint_id to dcp.save, or step=")
        if self._root is None:
            url = self._root_url if self._root_url is not None else self._root_arg
            if url is None:
                raise ConfigError("StalwartWriter has no root: pass one or a checkpoint_id path")
            self._root, self._root_url = Root(url, self.options, self._storage_options), url
        return self._root

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self._open()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.step), save_id=uuid.uuid4().hex)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        root = self._open()
        root.hold()  # the coordinator's lease, before any rank lists steps or writes
        root.check_new_step(self.step, overwrite=self.overwrite)  # before any write
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        root, step = self._open(), self.step
        assert step is not None
        results: list[WriteResult] = []
        items: list[LocalItem] = []
        for wi in plan.items:
            if wi.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(wi)
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                value, pickled = plain_value(raw)
                results.append(
                    WriteResult(wi.index, len(raw), _Stored(value=value, pickled=pickled))
                )
                continue
            td = wi.tensor_data
            assert td is not None
            t = planner.resolve_data(wi)
            assert isinstance(t, torch.Tensor)  # DCP resolves tensor items to tensors
            items.append(
                LocalItem(
                    wi.index.fqn,
                    dtype_name(td.properties.dtype),
                    tuple(td.size),
                    tuple(td.chunk.offsets),
                    tuple(td.chunk.sizes),
                    t,
                )
            )
        shards, stats = root.persist(step, items, root.known())
        results.append(WriteResult(MetadataIndex(""), 0, _Stored(stats=stats)))
        for it in items:
            stored = _Stored(shard=shards[it.key])
            results.append(WriteResult(MetadataIndex(it.fqn, it.offsets), it.nbytes, stored))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        root, step = self._open(), self.step
        assert step is not None
        per_rank: list[Any] = []
        seen: set[Any] = set()
        leaves: dict[str, Any] = {}
        pickled: list[str] = []
        for rank_results in results:
            shards: dict[Any, Any] = {}
            stats = PersistStats()
            for r in rank_results:
                s: _Stored = r.storage_data
                stats = s.stats or stats
                fqn = r.index.fqn
                if s.shard is not None:
                    key = (fqn, tuple(s.shard["offsets"]), tuple(s.shard["sizes"]))
                    if key not in seen:  # a replicated box written twice is kept once
                        seen.add(key)
                        shards[key] = s.shard
                    leaves[fqn] = torch.empty(0)
                elif fqn:
                    leaves[fqn] = s.value
                    if s.pickled:
                        pickled.append(fqn)
            per_rank.append((shards, stats))
        source = "torch.distributed.checkpoint"
        try:
            root.commit(
                step, metadata, leaves, per_rank, source=source, pickled=pickled, t0=self._t0
            )
        finally:
            root.release()

    def close(self) -> None:
        """Release the writer's threads (it may be used again afterwards)."""
        if self._root is not None:
            self._root.close()
            self._root = None


@dataclass
class _Loaded:
    manifest: Manifest
    values: dict[str, Any] = field(default_factory=dict)
    pickled: set[str] = field(default_factory=set)


class StalwartReader(StorageReader):
    """A DCP ``StorageReader`` over a stalwart root: ``dcp.load`` of any committed step.

    Works on steps saved by :class:`StalwartWriter` and by ``Checkpointer.save`` alike.
    Every chunk read is verified against its BLAKE3 hash before it lands.

    Args:
        root: the stalwart root; None takes the parent of each ``checkpoint_id``.
        step: the step to load when no ``checkpoint_id`` is passed (None: the newest).
        storage_options: passed to fsspec for remote roots.
        trust_pickle: allow loading values stored as pickles (they can run code).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        step: int | None = None,
        storage_options: dict[str, Any] | None = None,
        trust_pickle: bool = False,
    ) -> None:
        super().__init__()
        self._root_given = self._root_arg = root
        self.step, self.trust_pickle = step, trust_pickle
        self._storage_options = storage_options
        self._root: Root | None = None
        self._loaded: _Loaded | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._loaded = None
        if checkpoint_id is None:
            return
        parent, self.step = parse_checkpoint_id(checkpoint_id)
        root = self._root_given if self._root_given is not None else parent
        if root != self._root_arg and self._root is not None:  # another root: reopen
            self._root.close()
            self._root = None
        self._root_arg = root

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return StalwartWriter.validate_checkpoint_id(checkpoint_id)

    def _open(self) -> _Loaded:
        if self._loaded is not None:
            return self._loaded
        if self._root is None:
            if self._root_arg is None:
                raise ConfigError("StalwartReader has no root: pass one or a checkpoint_id path")
            with Checkpointer(self._root_arg, storage_options=self._storage_options) as ck:
                if not ck.steps():  # (before Root, which would create a missing root)
                    raise CheckpointNotFoundError(
                        f"no committed checkpoint under {self._root_arg}; check the path, or "
                        "save one first"
                    )
            self._root = Root(self._root_arg, CheckpointOptions(), self._storage_options)
        step = self.step if self.step is not None else self._root.ckpt.latest_step()
        assert step is not None
        m = self._root.ckpt.manifest(step)
        tree = unflatten(strip_numpy(m.skeleton), lambda fqn: torch.empty(0))
        loaded = _Loaded(m, pickled=set(json.loads(m.metadata.get(PICKLED_KEY, "[]"))))
        for path, v in dcp_leaves(tree):
            if not isinstance(v, torch.Tensor) and not flatten(v).leaves:
                loaded.values[fqn_of(path)] = v  # (a tuple holding tensors is not offered)
        self._loaded = loaded
        return loaded

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        loaded = self._open()
        sdm: dict[str, Any] = {fqn: BytesStorageMetadata() for fqn in loaded.values}
        for fqn, e in loaded.manifest.tensors.items():
            chunks = [
                ChunkStorageMetadata(torch.Size(s.offsets), torch.Size(s.sizes)) for s in e.shards
            ]
            props = TensorProperties(dtype=dtype_from_name(e.dtype))
            sdm[fqn] = TensorStorageMetadata(props, torch.Size(e.shape), chunks)
        return Metadata(sdm, storage_meta=StorageMeta(checkpoint_id=str(loaded.manifest.step)))

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._open()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _value_bytes(self, fqn: str) -> io.BytesIO:
        loaded = self._open()
        value = loaded.values[fqn]
        if fqn in loaded.pickled:
            if not self.trust_pickle:
                raise ConfigError(f"value {fqn!r} is stored as a pickle: {_TRUST_HINT}")
            return io.BytesIO(value)
        torch.save(value, out := io.BytesIO())
        out.seek(0)
        return out

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        loaded = self._open()
        assert self._root is not None
        where = f"checkpoint {self._root.store.url} step {loaded.manifest.step}"
        batch: list[tuple[ReadItem, torch.Tensor, Box]] = []
        held = 0
        for ri in plan.items:
            if ri.type == LoadItemType.BYTE_IO:
                planner.load_bytes(ri, self._value_bytes(ri.storage_index.fqn))
                continue
            fqn = ri.storage_index.fqn
            entry = loaded.manifest.tensors[fqn]
            offsets = tuple(
                int(a) + int(b)
                for a, b in zip(ri.storage_index.offset or (), ri.storage_offsets, strict=True)
            )
            target = planner.resolve_tensor(ri).detach()
            dtype, lengths = dtype_from_name(entry.dtype), tuple(int(n) for n in ri.lengths)
            direct = target.is_cpu and target.is_contiguous() and target.dtype == dtype
            dest = target if direct else torch.empty(lengths, dtype=dtype)
            batch.append((ri, target, Box(entry, fqn, offsets, dest)))
            held += 0 if direct else dest.numel() * dest.element_size()
            if held >= READ_BATCH_BYTES:
                self._read(batch, planner, where)
                batch, held = [], 0
        self._read(batch, planner, where)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read(self, batch: list[Any], planner: LoadPlanner, where: str) -> None:
        assert self._root is not None
        read_boxes(self._root.store, [b for _, _, b in batch], pool=self._root.pool, where=where)
        with torch.no_grad():
            for ri, target, box in batch:
                if box.dest is not target:
                    target.copy_(box.dest)
                planner.commit_tensor(ri, target)

    def close(self) -> None:
        """Release the reader's threads."""
        if self._root is not None:
            self._root.close()
            self._root = None


def __getattr__(name: str) -> Any:
    # export_dcp and import_dcp live in dcp_transfer (this module's size); same namespace.
    if name in ("export_dcp", "import_dcp"):
        from stalwart.integrations import dcp_transfer

        return getattr(dcp_transfer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
