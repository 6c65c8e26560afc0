"""What the DCP adapters share: step ids, DCP's tree paths, and a stalwart root to write.

DCP names a state dict's leaves by their key paths joined with ``.``, descending into
mappings always and into lists only when they hold tensors or mappings (every other value,
tuples included, is one leaf); :func:`dcp_leaves` walks a tree by the same rule and
:func:`nest` rebuilds a tree from DCP's paths, so a step written through DCP reads back,
through stalwart, as the nested tree that was saved. :class:`Root` persists boxes and
commits manifests with the durable engine's own functions (one format, one set of checks).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import Metadata, TensorStorageMetadata

from stalwart.checkpoint.durable.checkpointer import Checkpointer
from stalwart.checkpoint.durable.commit import build_manifest, refuse_replacing
from stalwart.checkpoint.durable.gc import apply_retention
from stalwart.checkpoint.durable.lease import Lease
from stalwart.checkpoint.durable.manifest import ChunkRef, Manifest, manifest_key
from stalwart.checkpoint.durable.persist import ChunkSink, PersistStats, persist_boxes
from stalwart.checkpoint.durable.plan import LocalItem
from stalwart.checkpoint.options import CheckpointOptions
from stalwart.errors import ConfigError
from stalwart.storage import open_storage
from stalwart.tree import dtype_name, flatten

__all__ = [
    "PICKLED_KEY",
    "READ_BATCH_BYTES",
    "Root",
    "dcp_leaves",
    "dcp_tensors",
    "fqn_of",
    "nest",
    "parse_checkpoint_id",
    "plain_value",
    "strip_numpy",
]

PICKLED_KEY = "dcp.pickled"
"""Manifest metadata: JSON list of the values stored as pickles (loading them needs trust)."""
READ_BATCH_BYTES = 256 << 20
"""Tensor bytes read per batch when loading or importing (bounds the temporaries held)."""
_ID_RE = re.compile(r"(\d+)$")


def parse_checkpoint_id(checkpoint_id: Any) -> tuple[str | None, int]:
    """``(root or None, step)`` named by a DCP ``checkpoint_id``.

    Raises:
        ConfigError: the id neither is an int nor ends in digits.
    """
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        return None, checkpoint_id
    s = os.fspath(checkpoint_id).rstrip("/")
    parent, _, name = s.rpartition("/")
    m = _ID_RE.search(name)
    if m is None:
        raise ConfigError(
            f"checkpoint_id {checkpoint_id!r} names no step: stalwart keeps one step per "
            "checkpoint, so pass an int or a name that ends in the step ('step-100')"
        )
    return (parent or None), int(m.group(1))


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Root:
    """One stalwart root opened for DCP: committed chunks, new packs, manifests."""

    def __init__(
        self, root: Any, options: CheckpointOptions, storage_options: dict[str, Any] | None
    ) -> None:
        self.options = options
        self.store = open_storage(root, storage_options=storage_options, create=True)
        self.ckpt = Checkpointer(self.store, options)
        self.pool = ThreadPoolExecutor(options.io_threads, thread_name_prefix="stalwart-dcp")
        self.fast_index: dict[Any, Any] = {}
        self._held: contextlib.ExitStack | None = None

    def hold(self) -> None:
        """Lease the committed steps and their packs until :meth:`release` (a save in flight).

        Taken by the one process that plans the save (DCP's coordinator), before any rank lists
        the steps it deduplicates against: retention keeps the leased steps, gc keeps the leased
        packs and every pack written after the lease was taken (the ranks' new packs), until
        the manifest is written. A save that dies leaves a lease that ends with its process (on
        this host) or after ``lease_s``.
        """
        if self._held is not None:
            return
        lease_s, held = self.options.lease_s, contextlib.ExitStack()
        steps = self.ckpt.steps()
        held.enter_context(Lease(self.store, steps=steps, packs=(), lease_s=lease_s))
        packs = {c.pack for c in self.known().values()}  # read under the first lease
        held.enter_context(Lease(self.store, steps=steps, packs=packs, lease_s=lease_s))
        self._held = held

    def release(self) -> None:
        """End the lease :meth:`hold` took (once the step is committed, or the save failed)."""
        held, self._held = self._held, None
        if held is not None:
            held.close()

    def known(self) -> dict[str, ChunkRef]:
        """Every chunk of every committed step, by hash (what a save may reference)."""
        known: dict[str, ChunkRef] = {}
        for s in self.ckpt.steps():
            for c in self.ckpt.manifest(s).chunks():
                known.setdefault(c.hash, c)
        return known

    def persist(
        self, step: int, items: list[LocalItem], known: dict[str, ChunkRef]
    ) -> tuple[dict[Any, Any], PersistStats]:
        """Write ``items`` as chunks (new ones into one new pack); shard entries as JSON."""
        pack = f"packs/step-{step:020d}-rank{_rank():05d}-{uuid.uuid4().hex[:12]}.pack"
        sink = ChunkSink(self.store, known, self.options, self.pool, previous=self.fast_index)
        shards, stats = persist_boxes(sink, items, pack)
        self.fast_index, stats.fast_index = stats.fast_index, {}
        return {k: s.to_json() for k, s in shards.items()}, stats

    def check_new_step(self, step: int | None, *, overwrite: bool) -> None:
        """Refuse to replace a committed ``step`` unless ``overwrite`` (one process decides).

        Raises:
            StepExistsError: ``step`` is committed and ``overwrite`` is False.
        """
        if not overwrite and step is not None:
            fix = "pass StalwartWriter(..., overwrite=True) or import_dcp(..., overwrite=True)"
            refuse_replacing(step, self.ckpt.steps(), self.store.url, fix=fix)

    def commit(
        self,
        step: int,
        md: Metadata,
        leaves: dict[str, Any],
        results: list[Any],
        *,
        source: str,
        pickled: list[str],
        t0: float,
    ) -> Manifest:
        """Write the manifest of ``step`` (the commit), end the lease, then apply retention.

        ``leaves`` (DCP's name -> value, a placeholder for each tensor ``md`` names) nest along
        the paths in ``md.planner_data``, or stay flat under DCP's names when those paths do
        not name exactly those tensors (an unusual planner). The manifest's metadata says
        where the step came from (``source``) and which values are ``pickled``.
        """
        tensors = dcp_tensors(md)
        paths = md.planner_data if isinstance(md.planner_data, dict) else {}
        tree = nest({tuple(paths.get(f, (f,))): v for f, v in leaves.items()})
        if {fqn_of(p) for p, v in dcp_leaves(tree) if isinstance(v, torch.Tensor)} != set(tensors):
            tree = dict(leaves)
        meta = {"stalwart.source": source}
        if pickled:
            meta[PICKLED_KEY] = json.dumps(sorted(pickled))
        skeleton = flatten(tree).skeleton
        m = build_manifest(step, tensors, skeleton, results, len(results), meta, t0)
        self.store.write(manifest_key(step), [m.to_bytes()])
        self.release()  # committed; retention must not see this save's lease on the old steps
        apply_retention(self.store, self.options.keep, self.ckpt.steps(), self.ckpt.manifest)
        return m

    def close(self) -> None:
        self.release()
        self.pool.shutdown(wait=True)
        self.ckpt.close()


def dcp_tensors(md: Metadata) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor DCP's metadata ``md`` names: ``fqn -> (stalwart dtype name, shape)``."""
    return {
        fqn: (dtype_name(m.properties.dtype), tuple(m.size))
        for fqn, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }


def plain_value(data: bytes) -> tuple[Any, bool]:
    """``(value, False)`` when the pickle holds plain data, else ``(data, True)``."""
    try:
        value = torch.load(io.BytesIO(data), weights_only=True)
        if not flatten(value).leaves:  # tensors inside a value: keep DCP's pickle
            return value, False
    except Exception:  # weights_only refuses it, or the format cannot hold it
        pass
    return data, True


def nest(leaves: Mapping[tuple[Any, ...], Any]) -> Any:
    """A tree from ``path -> leaf``; int path items become list indices (DCP's paths)."""
    root: dict[Any, Any] = {}
    for path, leaf in leaves.items():
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf

    def lists(node: Any) -> Any:
        if not isinstance(node, dict) or not node:
            return node
        out = {k: lists(v) for k, v in node.items()}
        if all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
            return [out[i] for i in range(len(out))]
        return out

    return lists(root)


def dcp_leaves(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """The leaves DCP's ``traverse_state_dict`` visits: mappings always, lists holding
    tensors, mappings or such lists; every other value (tuples too) is one leaf."""

    def terminal(v: Any) -> bool:
        if isinstance(v, Mapping):
            return False
        if not isinstance(v, list):
            return True
        return not any(
            isinstance(e, torch.Tensor) or (isinstance(e, (Mapping, list)) and not terminal(e))
            for e in v
        )

    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from dcp_leaves(v, (*path, str(k)))
    elif path and terminal(tree):
        yield path, tree
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from dcp_leaves(v, (*path, i))


def fqn_of(path: tuple[Any, ...]) -> str:
    return ".".join(map(str, path))


def strip_numpy(node: Any) -> Any:
    """``skeleton`` without numpy markers (placeholders stay tensors)."""
    if isinstance(node, dict):
        return {k: strip_numpy(v) for k, v in node.items() if k != "numpy"}
    if isinstance(node, list):
        return [strip_numpy(v) for v in node]
    return node
