"""Plan a save: which rank writes which box of which tensor.

Every rank knows, without moving tensor data, the global shape of each of its tensors and
the box (offsets, sizes) it holds: a plain tensor holds the whole tensor (it is taken to be
replicated, as in DCP), a DTensor holds the box its placements give it. One small
all-gather of these descriptions lets every rank compute the same global plan: each distinct
box is written exactly once in the whole job, by the holder with the fewest bytes assigned
so far (largest boxes first), so replicated tensors spread their writes across ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.errors import DistributedError
from stalwart.tree import FlatTree, dtype_name

__all__ = ["BoxKey", "LocalItem", "GlobalPlan", "local_box", "local_items", "plan_writes"]

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
    """

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: torch.Tensor
    dtensor: bool = False

    @property
    def key(self) -> BoxKey:
        return (self.fqn, self.offsets, self.sizes)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def describe(self) -> tuple[Any, ...]:
        """The picklable description exchanged between ranks."""
        return (self.fqn, self.dtype, self.shape, self.offsets, self.sizes, self.nbytes)


def local_items(flat: FlatTree) -> list[LocalItem]:
    """Describe every tensor box of ``flat`` that this rank holds (empty boxes skipped)."""
    items = []
    for leaf in flat.leaves.values():
        t = leaf.tensor
        offsets, sizes, local = local_box(t)
        items.append(
            LocalItem(
                fqn=leaf.fqn,
                dtype=dtype_name(t.dtype),
                shape=tuple(t.shape),
                offsets=offsets,
                sizes=sizes,
                tensor=local,
                dtensor=is_dtensor(t),
            )
        )
    return items


@dataclass
class GlobalPlan:
    """The plan every rank computes identically.

    Attributes:
        tensors: ``fqn -> (dtype, global shape)`` for every tensor of the job.
        writes: boxes this rank writes.
    """

    tensors: dict[str, tuple[str, tuple[int, ...]]]
    writes: list[LocalItem]


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
    for r, described in enumerate(all_described):
        for fqn, dtype, shape, offsets, sizes, n in described:
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
    return GlobalPlan(tensors=tensors, writes=[it for it in items if it.key in mine])


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
