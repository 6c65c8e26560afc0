"""Plan a save: which rank writes which box of which tensor.

Every rank knows, without moving tensor data, the global shape of each of its tensors and
the box (offsets, sizes) it holds: a plain tensor holds the whole tensor (it is taken to be
replicated, as in DCP), a DTensor holds the box its placements give it. One small
all-gather of these descriptions lets every rank compute the same global plan: each distinct
box is written exactly once in the whole job, by the holder with the fewest bytes assigned
so far (largest boxes first), so replicated tensors spread their writes across ranks.

Tensors are captured as their values: a conjugated or negated view (``t.conj()``, whose
conjugation is a lazy bit) is resolved to plain values first. Leaves that share memory
(``{"a": w, "b": w, "row": w[1]}``) are each stored whole (readers that ignore aliasing get
equal values), and :func:`find_aliases` records how they overlap so that a load without a
target can share memory again (the manifest's ``aliases``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from stalwart.checkpoint.capture import storage_key
from stalwart.checkpoint.durable.manifest import TensorAlias
from stalwart.errors import DistributedError
from stalwart.tree import FlatTree, dtype_name

__all__ = [
    "BoxKey",
    "GlobalPlan",
    "LocalItem",
    "find_aliases",
    "local_box",
    "local_items",
    "plan_writes",
]

BoxKey = tuple[str, tuple[int, ...], tuple[int, ...]]
"""(fqn, offsets, sizes): the identity of a shard in the whole job."""


def is_dtensor(t: torch.Tensor) -> bool:
    """True for ``torch.distributed.tensor.DTensor`` (without importing it eagerly)."""
    return type(t).__name__ == "DTensor" and hasattr(t, "device_mesh")


def local_box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """Return ``(offsets, sizes, local_tensor)`` of the part of ``t`` this rank holds."""
    if is_dtensor(t):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        dt: Any = t
        sizes, offsets = compute_local_shape_and_global_offset(
            dt.shape, dt.device_mesh, dt.placements
        )
        local = dt.to_local()
        if tuple(local.shape) != tuple(sizes):
            raise DistributedError(
                f"DTensor local shape {tuple(local.shape)} differs from the shape "
                f"{tuple(sizes)} its placements {dt.placements} imply"
            )
        return tuple(int(o) for o in offsets), tuple(int(s) for s in sizes), local
    return (0,) * t.dim(), tuple(t.shape), t


@dataclass
class LocalItem:
    """A box of a tensor that this rank holds.

    Attributes:
        fqn: the tensor's fully qualified name.
        dtype: format dtype name.
        shape: the tensor's global shape.
        offsets: the box's start in the global tensor.
        sizes: the box's extent.
        tensor: the local data of the box (any device, any strides).
        dtensor: the state held a DTensor (the box is its local shard).
        alias: the leaf shares memory with another leaf, and this is how (or None).
    """

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: torch.Tensor
    dtensor: bool = False
    alias: TensorAlias | None = None

    @property
    def key(self) -> BoxKey:
        return (self.fqn, self.offsets, self.sizes)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def describe(self) -> tuple[Any, ...]:
        """The picklable description exchanged between ranks."""
        return (self.fqn, self.dtype, self.shape, self.offsets, self.sizes, self.nbytes, self.alias)


def find_aliases(leaves: dict[str, torch.Tensor]) -> dict[str, TensorAlias]:
    """Which leaves are views of another leaf's memory, and how.

    Leaves are grouped by the memory they live in (and dtype); in each group the largest
    contiguous leaf (the first in tree order among equals) is the base, and every other
    leaf whose elements all lie inside the base's is recorded as an :class:`TensorAlias` of it.
    DTensors, empty tensors, conjugated or negated views are never aliased.
    """
    groups: dict[tuple[int, torch.dtype, str], list[tuple[str, torch.Tensor]]] = {}
    for fqn, t in leaves.items():
        if is_dtensor(t) or t.numel() == 0 or t.is_conj() or t.is_neg():
            continue
        key = (storage_key(t), t.dtype, str(t.device))
        if key[0]:
            groups.setdefault(key, []).append((fqn, t))
    aliases: dict[str, TensorAlias] = {}
    for members in groups.values():
        bases = [(f, t) for f, t in members if t.is_contiguous()]
        if len(members) < 2 or not bases:
            continue
        base_fqn, base = max(bases, key=lambda ft: ft[1].numel())  # first among equals
        lo = base.storage_offset()
        for fqn, t in members:
            start = t.storage_offset() - lo
            last = start + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
            if fqn != base_fqn and start >= 0 and last < base.numel():
                aliases[fqn] = TensorAlias(base_fqn, int(start), tuple(int(s) for s in t.stride()))
    return aliases


def local_items(flat: FlatTree) -> list[LocalItem]:
    """Describe every tensor box of ``flat`` that this rank holds (empty boxes skipped)."""
    aliases = find_aliases({fqn: leaf.tensor for fqn, leaf in flat.leaves.items()})
    items = []
    for leaf in flat.leaves.values():
        t = leaf.tensor
        offsets, sizes, local = local_box(t)
        if local.is_conj() or local.is_neg():  # lazy bits: store the values they stand for
            local = local.resolve_conj().resolve_neg()
        items.append(
            LocalItem(
                fqn=leaf.fqn,
                dtype=dtype_name(t.dtype),
                shape=tuple(t.shape),
                offsets=offsets,
                sizes=sizes,
                tensor=local,
                dtensor=is_dtensor(t),
                alias=aliases.get(leaf.fqn),
            )
        )
    return items


@dataclass
class GlobalPlan:
    """The plan every rank computes identically.

    Attributes:
        tensors: ``fqn -> (dtype, global shape)`` for every tensor of the job.
        writes: boxes this rank writes.
        aliases: leaves that share memory with another leaf, as every rank holding them
            described them (a leaf the ranks disagree on is left out).
    """

    tensors: dict[str, tuple[str, tuple[int, ...]]]
    writes: list[LocalItem]
    aliases: dict[str, TensorAlias] = field(default_factory=dict)


def plan_writes(
    items: list[LocalItem], all_described: Sequence[Sequence[tuple[Any, ...]]], rank: int
) -> GlobalPlan:
    """Assign every distinct box to exactly one holder, balancing bytes across ranks.

    Args:
        items: this rank's boxes.
        all_described: ``LocalItem.describe()`` of every rank's boxes, indexed by rank.
        rank: this rank's index in ``all_described``.

    Raises:
        DistributedError: ranks disagree on a tensor's dtype or global shape.
    """
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    holders: dict[BoxKey, list[int]] = {}
    nbytes: dict[BoxKey, int] = {}
    aliases: dict[str, TensorAlias | None] = {}
    for r, described in enumerate(all_described):
        for fqn, dtype, shape, offsets, sizes, n, alias in described:
            if aliases.setdefault(fqn, alias) != alias:
                aliases[fqn] = None  # ranks disagree: store the leaf, share no memory
            shape, offsets, sizes = tuple(shape), tuple(offsets), tuple(sizes)
            prev = tensors.setdefault(fqn, (dtype, shape))
            if prev != (dtype, shape):
                raise DistributedError(
                    f"tensor {fqn!r} is {prev[0]}{list(prev[1])} on one rank but "
                    f"{dtype}{list(shape)} on rank {r}; every rank must hold the same "
                    "global tensor under the same name"
                )
            if 0 in sizes and len(sizes) > 0:
                continue  # an empty box (uneven sharding) holds no bytes
            key = (fqn, offsets, sizes)
            holders.setdefault(key, []).append(r)
            nbytes[key] = n
    load = [0] * len(all_described)
    mine: set[BoxKey] = set()
    for key in sorted(holders, key=lambda k: (-nbytes[k], k)):
        writer = min(holders[key], key=lambda r: (load[r], r))
        load[writer] += nbytes[key]
        if writer == rank:
            mine.add(key)
    return GlobalPlan(
        tensors=tensors,
        writes=[it for it in items if it.key in mine],
        aliases={f: a for f, a in aliases.items() if a is not None and a.of in tensors},
    )


def merge_skeletons(skeletons: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Union of the ranks' skeletons: dict nodes merge by key, rank order decides the rest.

    Ranks usually hold the same tree; per-rank entries (for example RNG states keyed by
    rank) only exist on their own rank, and the union keeps all of them.
    """

    def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        if a.get("k") == b.get("k") == "stateful":
            return {"k": "stateful", "v": merge(a["v"], b["v"])}
        if a.get("k") != "dict" or b.get("k") != "dict":
            return a
        items = {repr(k): [k, v] for k, v in a["v"]}
        for k, v in b["v"]:
            rk = repr(k)
            items[rk] = [k, merge(items[rk][1], v)] if rk in items else [k, v]
        return {"k": "dict", "v": list(items.values())}

    result = skeletons[0]
    for other in skeletons[1:]:
        result = merge(result, other)
    return result
