"""Export a stalwart step to a DCP folder, and import a DCP folder as a stalwart step.

Both go through DCP's public API, one tensor (export) or one bounded batch (import) at a
time, so neither holds the whole checkpoint in memory:

* **Export** hands ``dcp.save`` the step's tree with ``meta`` tensors in place of the data
  and a planner whose ``resolve_data`` reads each tensor (verified) only when DCP's
  ``FileSystemWriter`` (``FsspecWriter`` for URLs) writes it.
* **Import** reads ``.metadata`` without running its pickle
  (:func:`stalwart.checkpoint.tools.dcp_import.parse_metadata`), then calls ``dcp.load`` on
  batches of freshly allocated whole tensors (DCP's planner reassembles them from however
  many shards were saved) and persists each batch into the stalwart root as it comes; the
  manifest is committed last. Non-tensor values load with ``torch.load(weights_only=True)``
  unless ``trust_pickle=True``. Any fsspec URL works (DCP's ``FsspecReader``).
"""

from __future__ import annotations

import contextlib
import io
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    BytesStorageMetadata,
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
    Metadata,
)
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem

from stalwart.checkpoint.durable.checkpointer import Checkpointer
from stalwart.checkpoint.durable.persist import PersistStats
from stalwart.checkpoint.durable.plan import LocalItem
from stalwart.checkpoint.options import CheckpointOptions
from stalwart.checkpoint.tools.dcp_import import parse_metadata
from stalwart.errors import ConfigError, CorruptCheckpointError
from stalwart.integrations.dcp_root import (
    READ_BATCH_BYTES,
    Root,
    dcp_leaves,
    dcp_tensors,
    fqn_of,
    plain_value,
    strip_numpy,
)
from stalwart.tree import dtype_from_name, flatten, unflatten

__all__ = ["TransferResult", "export_dcp", "import_dcp"]


@dataclass(frozen=True)
class TransferResult:
    """What an export or import moved.

    Attributes:
        step: the stalwart step.
        tensors: tensors moved.
        values: non-tensor values moved.
        bytes_total: raw tensor bytes moved.
        bytes_written: bytes written to the destination's data (new chunks on import).
        seconds: wall time.
    """

    step: int
    tensors: int
    values: int
    bytes_total: int
    bytes_written: int
    seconds: float


def _is_url(path: Any) -> bool:
    s = os.fspath(path)
    return "://" in s and not s.startswith("file://")


class _StreamingSavePlanner(DefaultSavePlanner):
    """DCP's planner, but each ``meta`` placeholder is read from stalwart when written."""

    def __init__(self, ckpt: Checkpointer, step: int, names: dict[str, str]) -> None:
        super().__init__()
        self._ckpt, self._step, self._names = ckpt, step, names
        self.bytes_read = 0

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = super().lookup_object(index)
        if isinstance(obj, torch.Tensor) and obj.device.type == "meta":
            obj, read = self._ckpt.read_tensor(self._step, self._names[index.fqn])
            self.bytes_read += read
        return obj


def export_dcp(
    root: str | os.PathLike[str] | Checkpointer,
    dest: str | os.PathLike[str],
    *,
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> TransferResult:
    """Write ``step`` (the newest when None) of ``root`` as a DCP checkpoint at ``dest``.

    ``dest`` is a folder or an fsspec URL; ``dcp.load`` (or torchtitan) reads it with
    ``FileSystemReader``/``FsspecReader``. Tuples in the tree become lists (DCP stores a
    tuple as one pickled value). DCP saves a mapping: a step whose top level is a list or a
    bare tensor is exported under the key ``"state"`` (``state.0``, ``state``).

    Raises:
        CheckpointNotFoundError: no such root or step.
        CorruptCheckpointError: a chunk fails its checksum (``dest`` is then incomplete and
            has no ``.metadata``, so DCP does not take it for a checkpoint).
    """
    t0 = time.perf_counter()
    ckpt = root if isinstance(root, Checkpointer) else Checkpointer(root)
    if step is None:
        step = ckpt.latest_step()
        if step is None:
            ckpt.manifest(0)  # raises CheckpointNotFoundError with the root's listing
    assert step is not None
    m = ckpt.manifest(step)

    def meta(fqn: str) -> torch.Tensor:
        e = m.tensors[fqn]
        return torch.empty(e.shape, dtype=dtype_from_name(e.dtype), device="meta")

    tree = _lists(unflatten(strip_numpy(m.skeleton), meta))
    wrapped = not isinstance(tree, dict)
    if wrapped:
        tree = {"state": tree}
    # DCP's name -> stalwart's, which has no "state" (a bare tensor's is "")
    names = {fqn_of(p): n for p, n in _tensor_paths(tree, m.tensors, skip=int(wrapped))}
    planner = _StreamingSavePlanner(ckpt, step, names)
    if _is_url(dest):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer: Any = FsspecWriter(os.fspath(dest), **(storage_options or {}))
    else:
        writer = FileSystemWriter(os.fspath(dest), thread_count=1)
    with _one_process():
        dcp.save(tree, storage_writer=writer, planner=planner, no_dist=True)
    values = sum(1 for _, v in dcp_leaves(tree) if not isinstance(v, torch.Tensor))
    total = sum(e.nbytes for e in m.tensors.values())
    return TransferResult(
        step, len(m.tensors), values, total, planner.bytes_read, time.perf_counter() - t0
    )


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """DCP warns that no_dist means one process; here that is the point, not news."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _lists(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _lists(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_lists(v) for v in tree]
    return tree


def _tensor_paths(
    tree: Any, tensors: dict[str, Any], skip: int = 0
) -> list[tuple[tuple[Any, ...], str]]:
    """``(DCP path, stalwart name)`` of every tensor leaf (both join keys with '.'); the
    stalwart name leaves out the first ``skip`` keys of the path (a wrapper stalwart lacks)."""
    out = []
    for path, v in dcp_leaves(tree):
        if isinstance(v, torch.Tensor):
            name = fqn_of(path[skip:])
            if name not in tensors:
                raise ConfigError(f"tensor at {path!r} has no stalwart name {name!r}")
            out.append((path, name))
    return out


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but non-tensor values load weights-only unless trusted."""

    def __init__(self, trust_pickle: bool) -> None:
        super().__init__()
        self.trust_pickle = trust_pickle
        self.raw: dict[str, bytes] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        data = value.read()
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(io.BytesIO(data), weights_only=not self.trust_pickle)
        except Exception as e:
            raise ConfigError(
                f"DCP value {fqn!r} is a pickle that torch.load(weights_only=True) refuses "
                f"({type(e).__name__}); if you trust the source, pass trust_pickle=True "
                "(CLI: --trust-pickle)"
            ) from None
        self.raw[fqn] = data
        self.state_dict[fqn] = obj


def _reader(source: Any, md: Metadata, storage_options: dict[str, Any] | None) -> Any:
    """DCP's reader for ``source``, handed the metadata read safely beforehand."""
    if _is_url(source):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        base: Any = FsspecReader
        args: tuple[Any, ...] = (os.fspath(source),)
        kwargs = dict(storage_options or {})
    else:
        base, args, kwargs = FileSystemReader, (os.fspath(source),), {}

    class _Reader(base):
        def read_metadata(self, *a: Any, **k: Any) -> Metadata:
            return md

    return _Reader(*args, **kwargs)


def _read_metadata_bytes(source: Any, storage_options: dict[str, Any] | None) -> bytes:
    where = f"{os.fspath(source).rstrip('/')}/.metadata"
    try:
        if _is_url(source):
            import fsspec

            with fsspec.open(where, "rb", **(storage_options or {})) as f:
                return f.read()
        with open(where, "rb") as f:
            return f.read()
    except OSError as e:
        raise CorruptCheckpointError(
            f"{where} cannot be read ({type(e).__name__}: {e}); is {source} a DCP checkpoint "
            "folder (dcp.save writes .metadata last)?"
        ) from e


def import_dcp(
    source: str | os.PathLike[str],
    root: str | os.PathLike[str],
    step: int,
    *,
    trust_pickle: bool = False,
    options: CheckpointOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    batch_bytes: int = READ_BATCH_BYTES,
    overwrite: bool = False,
) -> TransferResult:
    """Import the DCP checkpoint at ``source`` (folder or fsspec URL) as ``step`` of ``root``.

    Tensors are read in batches of at most ``batch_bytes`` (a larger tensor alone), each
    persisted (chunked, deduplicated against the root) before the next is read.

    Args:
        source: the DCP folder or fsspec URL (``s3://bucket/ckpt/step-100``).
        root: the stalwart root to save into.
        step: the step to save it as (a committed one: StepExistsError, unless ``overwrite``).
        trust_pickle: let the source's pickles run unrestricted (only for trusted sources).
        options: chunking, compression and retention of the root.
        storage_options: fsspec options, for the source URL and a remote root alike.
        batch_bytes: tensor bytes held in memory at a time.
        overwrite: replace a committed ``step`` (atomically).

    Raises:
        ConfigError: the source needs pickle and ``trust_pickle`` is False.
        CorruptCheckpointError: the source is incomplete or damaged.
    """
    t0 = time.perf_counter()
    raw = _read_metadata_bytes(source, storage_options)
    md = parse_metadata(raw, source, trust_pickle=trust_pickle)
    reader = _reader(source, md, storage_options)
    dest = Root(root, options or CheckpointOptions(), storage_options)
    try:
        dest.hold()  # released by close(), after the commit
        dest.check_new_step(step, overwrite=overwrite)  # before anything is read or written
        known = dest.known()
        tensors = dcp_tensors(md)
        shards: dict[Any, Any] = {}
        written = total = 0
        batch: dict[str, torch.Tensor] = {}
        for i, (fqn, (dtype, shape)) in enumerate(tensors.items()):
            batch[fqn] = torch.empty(shape, dtype=dtype_from_name(dtype))
            held = sum(t.numel() * t.element_size() for t in batch.values())
            if held < batch_bytes and i + 1 < len(tensors):
                continue
            _load(batch, reader, _SafeLoadPlanner(trust_pickle))
            items = [
                LocalItem(f, tensors[f][0], tensors[f][1], (0,) * t.dim(), tensors[f][1], t)
                for f, t in batch.items()
            ]
            new, stats = dest.persist(step, items, known)
            shards.update(new)
            for s in new.values():
                for c in s["chunks"]:
                    known.setdefault(c[0], _chunk(c))
            written, total, batch = written + stats.bytes_written, total + stats.bytes_total, {}
        values, pickled = _load_values(md, reader, trust_pickle)
        leaves: dict[str, Any] = {f: torch.empty(0) for f in tensors} | values
        results = [(shards, PersistStats(total, written))]
        origin = f"dcp import of {os.fspath(source)}"
        dest.commit(step, md, leaves, results, source=origin, pickled=pickled, t0=t0)
    finally:
        dest.close()
    return TransferResult(step, len(tensors), len(values), total, written, time.perf_counter() - t0)


def _chunk(c: list[Any]) -> Any:
    from stalwart.checkpoint.durable.manifest import ChunkRef

    return ChunkRef.from_json(c)


def _load(sd: dict[str, Any], reader: Any, planner: Any) -> None:
    try:
        with _one_process():
            dcp.load(sd, storage_reader=reader, planner=planner, no_dist=True)
    except ConfigError:
        raise
    except BaseException as e:  # CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        cause = next((c for c in _causes(e) if isinstance(c, ConfigError)), None)
        if cause is not None:
            raise cause from None
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        last = (lines[-1] if lines else type(e).__name__)[:500]
        raise CorruptCheckpointError(
            f"the DCP checkpoint could not be read ({last}); "
            "it may be incomplete or damaged — copy or save it again"
        ) from e


def _causes(e: BaseException) -> list[BaseException]:
    failures = getattr(e, "failures", None) or {}  # rank -> (exception, stack summary)
    found = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return [*found, *([e.__cause__] if e.__cause__ else [])]


def _load_values(md: Metadata, reader: Any, trust_pickle: bool) -> tuple[dict[str, Any], list[str]]:
    """Every non-tensor value: plain ones as values, others as their pickle (marked)."""
    sd: dict[str, Any] = {
        f: None for f, m in md.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)
    }
    if not sd:
        return {}, []
    planner = _SafeLoadPlanner(trust_pickle)
    _load(sd, reader, planner)
    values: dict[str, Any] = {}
    pickled: list[str] = []
    for fqn in sd:
        value, is_pickle = plain_value(planner.raw[fqn])
        values[fqn] = value
        if is_pickle:
            pickled.append(fqn)
    flatten(values)  # fail here, not at commit, on a value the format cannot hold
    return values, pickled
