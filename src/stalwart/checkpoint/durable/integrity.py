"""Structural checks of a parsed manifest: what it may ask for, and that it tiles exactly.

A manifest is untrusted input: a bit flip, a truncated copy or a hostile author can make it
ask for nonsense. ``Manifest.from_bytes`` runs these checks before anything is allocated or
read, and both ``load`` and ``verify`` go through it, so they agree on every manifest:

- the skeleton is well formed and at most :data:`MAX_TREE_DEPTH` levels deep, and every
  tensor leaf names the entry of its own path (the path's keys joined with ``.``, as the
  writer names tensors), so a leaf can never load another tensor's bytes;
- every shard's chunks hold exactly its box's bytes (so no byte of it is left unread);
- every tensor's shards cover it exactly once (no gap, no overlap), whatever the world size;
- every chunk lies inside its pack, where the store can say how long the pack is
  (:func:`pack_problems`, run by the readers since it needs the store).
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import reprlib
import sys
from typing import Any

import numpy as np

from stalwart.errors import CorruptCheckpointError, StorageError
from stalwart.storage.base import Storage
from stalwart.tree import dtype_from_name

__all__ = [
    "MAX_TREE_DEPTH",
    "brief",
    "check_skeleton",
    "pack_problems",
    "tiling_problems",
]

log = logging.getLogger(__name__)

MAX_TREE_DEPTH = 128
"""Deepest state tree a manifest may describe (a model's state dict is about 10 deep)."""

_MAX_GRID_CELLS = 1 << 22  # the exact-cover check's grid; beyond it, pairwise box tests
_FEW_BOXES = 16  # up to this many shards, pairwise beats numpy (4-rank parse: 4.9 -> 2.6 ms)
_INT_RE = re.compile(r"-?[0-9]+")
_FLOAT_WORDS = ("nan", "inf", "-inf")
_NO_NUMPY = ("bfloat16", "float8_e4m3fn", "float8_e5m2")  # dtypes numpy cannot hold
_KEY_TYPES: dict[str, tuple[type, ...]] = {"s": (str,), "i": (int,), "b": (bool,)}


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 160, 80


def brief(value: Any) -> str:
    """A short, always-printable rendering of an untrusted value for an error message."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<a {value.bit_length()}-bit integer>"
    try:
        return _REPR.repr(value)
    except (ValueError, RecursionError):
        return f"<{type(value).__name__}>"


MAX_INT = 1 << 62
"""Largest integer a manifest may hold anywhere (sizes, offsets, lengths)."""


def uint(value: Any, what: str, limit: int = MAX_INT) -> int:
    """``value`` if it is a JSON integer in ``[0, limit]`` (not a bool), else corruption."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
        raise CorruptCheckpointError(f"{what} must be an int in [0, {limit}], not {brief(value)}")
    return value


def _numel(sizes: tuple[int, ...] | list[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def check_skeleton(skeleton: Any, tensors: dict[str, Any]) -> None:
    """Check the skeleton's every node, iteratively (a deep one cannot exhaust the stack).

    Args:
        skeleton: the parsed skeleton.
        tensors: the manifest's tensor entries by name.

    Raises:
        CorruptCheckpointError: a malformed node, a tree deeper than :data:`MAX_TREE_DEPTH`,
            or a tensor leaf naming a tensor the manifest has no entry for, or the entry of
            another path than its own.
    """
    stack: list[tuple[Any, int, tuple[str, ...]]] = [(skeleton, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if depth > MAX_TREE_DEPTH:
            raise CorruptCheckpointError(
                f"skeleton is more than {MAX_TREE_DEPTH} levels deep; stalwart never writes "
                "such a tree, so the manifest is damaged"
            )
        if not isinstance(node, dict) or not isinstance(node.get("k"), str):
            raise CorruptCheckpointError(f"malformed skeleton node {brief(node)}")
        kind, v = node["k"], node.get("v")
        if kind == "dict":
            if not isinstance(v, list):
                raise CorruptCheckpointError(f"skeleton dict node holds {brief(v)}, not a list")
            for item in v:
                if not (isinstance(item, list) and len(item) == 2):
                    raise CorruptCheckpointError(f"malformed skeleton dict item {brief(item)}")
                _check_key(item[0])
                stack.append((item[1], depth + 1, (*path, str(item[0][1]))))
        elif kind in ("list", "tuple"):
            if not isinstance(v, list):
                raise CorruptCheckpointError(f"skeleton {kind} node holds {brief(v)}")
            stack.extend((child, depth + 1, (*path, str(i))) for i, child in enumerate(v))
        elif kind == "stateful":
            stack.append((v, depth + 1, path))
        elif kind == "tensor":
            if not isinstance(v, str) or v not in tensors:
                raise CorruptCheckpointError(
                    f"skeleton names tensor {brief(v)}, which has no entry"
                )
            if v != ".".join(path):
                raise CorruptCheckpointError(
                    f"the skeleton leaf at {brief('.'.join(path))} names the entry of tensor "
                    f"{brief(v)}: it would load another tensor's bytes (damaged manifest)"
                )
            numpy = node.get("numpy", False)
            if not isinstance(numpy, bool) or (numpy and tensors[v].dtype in _NO_NUMPY):
                raise CorruptCheckpointError(f"malformed tensor node {brief(node)}")
        elif not _scalar_ok(kind, v):
            raise CorruptCheckpointError(f"malformed skeleton {brief(kind)} node {brief(node)}")


def _check_key(enc: Any) -> None:
    ok = isinstance(enc, list) and len(enc) == 2 and enc[0] in ("s", "i", "b", "n")
    if ok and enc[0] == "n":
        ok = enc[1] is None
    elif ok:
        ok = isinstance(enc[1], _KEY_TYPES[enc[0]]) and (
            enc[0] == "b" or not isinstance(enc[1], bool)
        )
    if not ok:
        raise CorruptCheckpointError(f"malformed dict key {brief(enc)} in the skeleton")


def _scalar_ok(kind: str, v: Any) -> bool:
    """Whether ``v`` is a well-formed value of the scalar skeleton node ``kind``."""
    if kind == "none":
        return True
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "str":
        return isinstance(v, str)
    if kind == "int":
        limit = sys.get_int_max_str_digits() or 4300
        return isinstance(v, str) and len(v) <= limit and _INT_RE.fullmatch(v) is not None
    if kind == "float":
        if isinstance(v, str):
            return v in _FLOAT_WORDS
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return False
        try:
            float(v)
        except OverflowError:
            return False
        return True
    if kind == "bytes":
        try:
            base64.b64decode(v, validate=True)
        except (binascii.Error, TypeError, ValueError):
            return False
        return True
    if kind == "dtype":
        try:
            dtype_from_name(v)
        except CorruptCheckpointError:
            return False
        return True
    return False


def tiling_problems(fqn: str, e: Any) -> list[str]:
    """What is wrong with how ``e``'s shards and chunks hold the tensor (empty when exact).

    ``e`` is a ``TensorEntry`` whose shards already lie inside its shape. A shard's chunks
    must hold exactly its box's bytes; the shards must cover every element exactly once.
    """
    problems: list[str] = []
    esize = dtype_from_name(e.dtype).itemsize
    for s in e.shards:
        want = _numel(s.sizes) * esize
        if s.nbytes != want:
            problems.append(
                f"tensor {fqn!r}: shard at offsets {list(s.offsets)} sizes {list(s.sizes)} "
                f"has chunks of {s.nbytes} bytes, its box needs {want}"
            )
    numel = _numel(e.shape)
    covered = sum(_numel(s.sizes) for s in e.shards)
    if covered != numel:
        problems.append(
            f"tensor {fqn!r}: shards cover {covered} of {numel} elements of shape "
            f"{list(e.shape)} (counting overlaps twice); the checkpoint is incomplete"
        )
        return problems
    boxes = [(s.offsets, s.sizes) for s in e.shards if _numel(s.sizes)]
    pair = _overlap(e.shape, boxes)
    if pair is not None:
        a, b = pair
        problems.append(
            f"tensor {fqn!r}: shards at offsets {list(a[0])} sizes {list(a[1])} and offsets "
            f"{list(b[0])} sizes {list(b[1])} overlap (and so leave a gap)"
        )
    return problems


Box = tuple[tuple[int, ...], tuple[int, ...]]


def _overlap(shape: tuple[int, ...], boxes: list[Box]) -> tuple[Box, Box] | None:
    """Two overlapping boxes, or None. Boxes lie inside ``shape`` and are non-empty.

    A few boxes (a tensor sharded over a few ranks) are tested pair by pair. Past that, it
    cuts every dimension at every box edge; each box is then a block of grid cells, and no
    two boxes overlap iff no cell is counted twice. In the layouts DTensor shardings produce
    (``Shard(0)``, ``Shard(1)``, 2-D meshes) every box is a single cell, which numpy checks
    for a thousand boxes in well under a millisecond.
    """
    if len(boxes) < 2:
        return None
    if len(boxes) <= _FEW_BOXES:  # a rank's share of a few ranks: 120 tests at the most
        return _pairwise(boxes)
    o = np.array([b[0] for b in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
    e = o + np.array([b[1] for b in boxes], dtype=np.int64).reshape(o.shape)
    cuts = [np.unique(np.concatenate(([0, d], o[:, i], e[:, i]))) for i, d in enumerate(shape)]
    lo = np.stack([np.searchsorted(c, o[:, i]) for i, c in enumerate(cuts)], axis=1)
    hi = np.stack([np.searchsorted(c, e[:, i]) for i, c in enumerate(cuts)], axis=1)
    if (hi - lo == 1).all():  # one cell per box: an overlap is two boxes on one cell
        _, first, counts = np.unique(lo, axis=0, return_index=True, return_counts=True)
        if (counts == 1).all():
            return None
        twice = lo[first[np.argmax(counts > 1)]]
        a, b = np.flatnonzero((lo == twice).all(axis=1))[:2]
        return boxes[a], boxes[b]
    if _numel([len(c) - 1 for c in cuts]) <= _MAX_GRID_CELLS:
        count = np.zeros([len(c) - 1 for c in cuts], dtype=np.int32)
        for k, box in enumerate(boxes):
            block = tuple(slice(a, b) for a, b in zip(lo[k], hi[k], strict=True))
            if (count[block] > 0).any():
                return _pair_with(boxes, box)
            count[block] += 1
        return None
    return _pairwise(boxes)  # an exotic layout


def _pairwise(boxes: list[Box]) -> tuple[Box, Box] | None:
    for k, a in enumerate(boxes):
        for b in boxes[k + 1 :]:
            if _intersect(a, b):
                return a, b
    return None


def _intersect(a: Box, b: Box) -> bool:
    return all(
        max(oa, ob) < min(oa + za, ob + zb)
        for oa, za, ob, zb in zip(a[0], a[1], b[0], b[1], strict=True)
    )


def _pair_with(boxes: list[Box], box: Box) -> tuple[Box, Box]:
    other = next(b for b in boxes if b is not box and _intersect(b, box))
    return other, box


def pack_problems(m: Any, store: Storage) -> dict[Any, str]:
    """Chunks of ``m`` that reach past the end of their pack, with the reason.

    Lists each folder that holds packs once. Packs missing from the listing are left to the
    read (which reports them missing); a store that refuses to list skips the check, so
    that no chunk is read, and no buffer allocated, for a length a pack cannot hold.
    """
    folders = {c.pack.rpartition("/")[0] for c in m.chunks()}
    sizes: dict[str, int] = {}
    try:
        for folder in sorted(folders):
            sizes.update((i.key, i.size) for i in store.list(f"{folder}/" if folder else ""))
    except StorageError as e:
        log.info("pack sizes unknown (the store refused to list: %s); reads check them", e)
        return {}
    bad: dict[Any, str] = {}
    for c in m.chunks():
        size = sizes.get(c.pack)
        if size is not None and c.offset + c.length > size:
            bad[c] = (
                f"stored bytes [{c.offset}, {c.offset + c.length}) lie outside {c.pack}, "
                f"which holds {size} bytes (truncated pack or damaged manifest)"
            )
    return bad
