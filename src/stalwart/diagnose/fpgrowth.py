"""Weighted FP-Growth: frequent item-sets of weighted transactions, up to a maximum length.

Han, Pei and Yin's FP-Growth, with a weight per transaction (the failure mass of one aggregated
group) instead of a count of one. Items are integers; the tree is kept in flat lists (parent,
item, weight per node) with a header list of nodes per item. Mining walks items from the least
frequent up, collects the item's conditional pattern base (the paths above its nodes, weighted
by the node), and either counts the base's items directly (when one more item reaches
``max_len``, the common case) or builds the conditional tree and recurses.

The support of an item-set is the summed weight of the transactions that contain it; an item-set
is frequent when its support is at least ``min_weight``.

For ``max_len <= 3`` (the default of the analysis) the tree is built and read with NumPy instead:
transactions sorted lexicographically give the tree's nodes as the distinct prefixes, and the
pattern-base counts of every item (pairs) and of every pair (triples) come from one vectorised
walk over each node's ancestors, weighted by the node. Same tree, same supports, no Python loop
per node.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from stalwart.diagnose.options import EngineTuning

__all__ = ["fpgrowth", "fpgrowth_rows"]


class _Tree:
    __slots__ = ("children", "header", "item", "parent", "weight")

    def __init__(self) -> None:
        self.parent: list[int] = [-1]
        self.item: list[int] = [-1]
        self.weight: list[float] = [0.0]
        self.children: dict[tuple[int, int], int] = {}
        self.header: dict[int, list[int]] = defaultdict(list)

    def insert(self, path: Sequence[int], w: float) -> None:
        node = 0
        children, parent, item, weight = self.children, self.parent, self.item, self.weight
        for it in path:
            key = (node, it)
            child = children.get(key)
            if child is None:
                child = len(parent)
                children[key] = child
                parent.append(node)
                item.append(it)
                weight.append(0.0)
                self.header[it].append(child)
            weight[child] += w
            node = child

    def base(self, it: int) -> list[tuple[list[int], float]]:
        """The conditional pattern base of ``it``: (path above each of its nodes, node weight)."""
        parent, item, weight = self.parent, self.item, self.weight
        out = []
        for node in self.header[it]:
            path = []
            p = parent[node]
            while p > 0:
                path.append(item[p])
                p = parent[p]
            if path:
                path.reverse()
                out.append((path, weight[node]))
        return out


def _build(paths: Iterable[tuple[Sequence[int], float]], keep: dict[int, float]) -> _Tree:
    tree = _Tree()
    for path, w in paths:
        # Items are ranked so that a smaller integer is more frequent at the top level; within a
        # conditional tree the same order is kept, which is all FP-Growth needs.
        p = [i for i in path if i in keep]
        if p:
            tree.insert(p, w)
    return tree


def _mine(
    tree: _Tree,
    suffix: tuple[int, ...],
    min_weight: float,
    max_len: int,
    out: dict[tuple[int, ...], float],
) -> None:
    for it in sorted(tree.header, reverse=True):
        support = sum(tree.weight[n] for n in tree.header[it])
        if support < min_weight:
            continue
        found = (it, *suffix)
        out[found] = support
        if len(found) >= max_len:
            continue
        base = tree.base(it)
        counts: dict[int, float] = defaultdict(float)
        for path, w in base:
            for i in path:
                counts[i] += w
        frequent = {i: c for i, c in counts.items() if c >= min_weight}
        if not frequent:
            continue
        if len(found) + 1 >= max_len:
            for i, c in frequent.items():
                out[(i, *found)] = c
            continue
        _mine(_build(base, frequent), found, min_weight, max_len, out)


def fpgrowth(
    transactions: Sequence[Sequence[int]],
    weights: Sequence[float],
    *,
    min_weight: float,
    max_len: int,
) -> dict[tuple[int, ...], float]:
    """Every item-set of at most ``max_len`` items whose supporting weight is >= ``min_weight``.

    Args:
        transactions: item lists (each item at most once per transaction).
        weights: one non-negative weight per transaction.
        min_weight: the smallest total weight of a frequent item-set (> 0).
        max_len: the longest item-set reported (>= 1).

    Returns:
        item-set (items sorted ascending) -> supporting weight.
    """
    if len(transactions) != len(weights):
        raise ValueError("one weight per transaction")
    counts: dict[int, float] = defaultdict(float)
    for t, w in zip(transactions, weights, strict=False):
        for i in t:
            counts[i] += w
    order = sorted((i for i, c in counts.items() if c >= min_weight), key=lambda i: (-counts[i], i))
    rank = {i: k for k, i in enumerate(order)}
    merged: dict[tuple[int, ...], float] = defaultdict(float)
    for t, w in zip(transactions, weights, strict=False):
        path = tuple(sorted(rank[i] for i in t if i in rank))
        if path and w > 0:
            merged[path] += w
    ranked: dict[tuple[int, ...], float] = {}
    if max_len <= 3:
        ranked = _mine_flat(merged, len(order), min_weight, max_len)
    else:
        tree = _build(merged.items(), {k: 1.0 for k in range(len(order))})
        _mine(tree, (), min_weight, max_len, ranked)
    return {tuple(sorted(order[k] for k in s)): w for s, w in ranked.items()}


def fpgrowth_rows(
    items: np.ndarray,
    weights: np.ndarray,
    *,
    min_weight: float,
    max_len: int,
    tuning: EngineTuning | None = None,
) -> dict[tuple[int, ...], float]:
    """``fpgrowth`` for transactions given as a matrix, without a Python loop per transaction.

    Memory stays a few bytes per matrix cell: items are counted and ranked column by column into
    16-bit ranks (32-bit past 32,767 frequent items), never as 64-bit temporaries of the matrix.

    Args:
        items: transactions x slots, int: the items of each transaction, -1 in empty slots
            (each item at most once per transaction).
        weights: one non-negative weight per transaction.
        min_weight: the smallest total weight of a frequent item-set (> 0).
        max_len: the longest item-set reported (>= 1).
        tuning: the chunk and buffer sizes of the walk over the tree (``node_chunk``,
            ``triple_buffer``, ``dense_triples``); they bound memory, never change the result.

    Returns:
        item-set (items sorted ascending) -> supporting weight, as ``fpgrowth`` returns.
    """
    items = np.asarray(items)
    if not np.issubdtype(items.dtype, np.integer):
        items = items.astype(np.int64)
    w = np.asarray(weights, dtype=np.float64)
    if items.ndim != 2 or len(items) != len(w):
        raise ValueError("one weight per transaction (row of items)")
    if max_len > 3:
        tx = [[i for i in row if i >= 0] for row in items.tolist()]
        return fpgrowth(tx, w.tolist(), min_weight=min_weight, max_len=max_len)
    n_items = max(int(items.max()) + 1, 0) if items.size else 0
    counts = np.zeros(n_items)
    for j in range(items.shape[1]):
        col = items[:, j]
        m = col >= 0
        counts += np.bincount(col[m], weights=w[m], minlength=n_items)
    frequent = np.flatnonzero(counts >= min_weight)
    order = frequent[np.lexsort((frequent, -counts[frequent]))]  # most frequent first
    k = len(order)
    # slot n_items (also what -1, an empty slot, indexes): ranked last, as k
    rank = np.full(n_items + 1, k, dtype=np.int16 if k < 2**15 - 1 else np.int32)
    rank[order] = np.arange(k)
    ranked = np.empty(items.shape, dtype=rank.dtype)
    for j in range(items.shape[1]):
        ranked[:, j] = rank[items[:, j]]
    ranked.sort(axis=1)
    depth = int((ranked < k).sum(axis=1).max()) if len(ranked) else 0
    keep = (w > 0) & (ranked[:, 0] < k) if depth else np.zeros(len(w), dtype=bool)
    found = _mine_flat_rows(ranked[keep, :depth], w[keep], k, min_weight, max_len, tuning)
    return {tuple(sorted(int(order[j]) for j in s)): v for s, v in found.items()}


def _mine_flat(
    merged: dict[tuple[int, ...], float], n_items: int, min_weight: float, max_len: int
) -> dict[tuple[int, ...], float]:
    """Frequent sets of up to 3 items from the FP-tree held in arrays."""
    if not merged:
        return {}
    k = n_items
    depth = max(len(p) for p in merged)
    rows = np.full((len(merged), depth), k, dtype=np.int64)  # k pads: after every item
    for i, path in enumerate(merged):
        rows[i, : len(path)] = path
    w = np.fromiter(merged.values(), dtype=np.float64, count=len(merged))
    return _mine_flat_rows(rows, w, k, min_weight, max_len)


def _mine_flat_rows(
    rows: np.ndarray,
    w: np.ndarray,
    k: int,
    min_weight: float,
    max_len: int,
    tuning: EngineTuning | None = None,
) -> dict[tuple[int, ...], float]:
    """``_mine_flat`` on paths as rows of ranks sorted ascending, padded with ``k``; identical
    paths may repeat (they become one node chain)."""
    out: dict[tuple[int, ...], float] = {}
    if len(rows) == 0 or rows.shape[1] == 0:
        return out
    tuning = tuning or EngineTuning()
    tree = _FlatTree(rows, w, k)
    single = np.bincount(tree.item, weights=tree.weight, minlength=k)
    for i in np.flatnonzero(single >= min_weight).tolist():
        out[(i,)] = float(single[i])
    if max_len < 2:
        return out
    pair = np.zeros(k * k)
    for item, weight, anc in tree.chunks(tuning.node_chunk):
        for d in range(anc.shape[1]):
            a = anc[:, d]
            m = a >= 0
            pair += np.bincount(item[m] * k + a[m], weights=weight[m], minlength=k * k)
    frequent_pair = pair >= min_weight
    for key in np.flatnonzero(frequent_pair).tolist():
        out[(key % k, key // k)] = float(pair[key])
    if max_len < 3 or not frequent_pair.any():
        return out
    # every (node, ancestor, older ancestor) triple whose pairs are frequent, weighted by the
    # node, summed in bounded buffers
    sums = _TripleSums(k, dense_limit=tuning.dense_triples, buffer=tuning.triple_buffer)
    keep = single >= min_weight
    for item, weight, anc in tree.chunks(tuning.node_chunk):
        for q in range(anc.shape[1]):
            y = anc[:, q]
            m = (y >= 0) & frequent_pair[np.where(y >= 0, item * k + y, 0)]
            if not m.any():
                continue
            xs, ys, ws = item[m], y[m], weight[m]
            for lo in range(q):
                z = anc[m, lo]
                mm = (
                    (z >= 0)
                    & frequent_pair[np.where(z >= 0, xs * k + z, 0)]
                    & keep[np.maximum(z, 0)]
                )
                if mm.any():
                    sums.add((xs[mm] * k + ys[mm]) * k + z[mm], ws[mm])
    uk, totals = sums.result()
    hit = totals >= min_weight
    for key, val in zip(uk[hit].tolist(), totals[hit].tolist(), strict=True):
        out[(key % k, (key // k) % k, key // (k * k))] = val
    return out


class _FlatTree:
    """The FP-tree of sorted, padded rank paths, as flat arrays: a node wherever a prefix
    changes (paths sorted lexicographically), with its item, weight, parent and depth.

    The ancestors of the nodes (nodes x depth, the walk's largest array) are produced in chunks
    of ``node_chunk`` nodes, so memory stays bounded whatever the number of failing groups.
    """

    def __init__(self, rows: np.ndarray, w: np.ndarray, k: int) -> None:
        depth = rows.shape[1]
        order = np.lexsort(rows.T[::-1])
        rows, w = rows[order], w[order]
        index = np.int32 if len(rows) * depth < 2**31 else np.int64
        items, weights, parents, depths = [], [], [], []
        parent = np.full(len(rows), -1, dtype=index)
        changed = np.zeros(len(rows), dtype=bool)
        changed[0] = True
        next_id = 0
        for d in range(depth):
            col = rows[:, d]
            changed[1:] |= col[1:] != col[:-1]
            present = col < k
            start = changed & present
            ids = (np.cumsum(start) - 1 + next_id).astype(index)
            n_new = int(start.sum())
            items.append(col[start])
            weights.append(np.bincount(ids[present] - next_id, weights=w[present], minlength=n_new))
            parents.append(parent[start])
            depths.append(np.full(n_new, d, dtype=np.int16))
            parent = np.where(present, ids, parent)
            next_id += n_new
        self.item = np.concatenate(items)
        self.weight = np.concatenate(weights)
        self.parent = np.concatenate(parents)
        self.depth = np.concatenate(depths)
        self.max_depth = depth

    def chunks(self, node_chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(items as int64, weights, ancestors' items by depth, -1 below the node's own depth)
        for each chunk of ``node_chunk`` nodes."""
        for lo in range(0, len(self.item), node_chunk):
            hi = min(lo + node_chunk, len(self.item))
            anc = np.full((hi - lo, self.max_depth), -1, dtype=self.item.dtype)
            cur = self.parent[lo:hi].astype(np.int64)
            for _ in range(self.max_depth):
                ok = cur >= 0
                if not ok.any():
                    break
                anc[ok, self.depth[cur[ok]]] = self.item[cur[ok]]
                cur = np.where(ok, self.parent[np.maximum(cur, 0)], -1)
            yield self.item[lo:hi].astype(np.int64), self.weight[lo:hi], anc


class _TripleSums:
    """Summed weights of triple keys, added in pieces and reduced every ``buffer`` entries: into
    a dense array of k^3 sums when that is at most ``dense_limit``, else by sorting the keys."""

    def __init__(self, k: int, *, dense_limit: int, buffer: int) -> None:
        self.bins = k**3
        self.dense = np.zeros(self.bins) if self.bins <= dense_limit else None
        self.buffer = buffer
        self.keys: list[np.ndarray] = []
        self.weights: list[np.ndarray] = []
        self.buffered = 0

    def add(self, keys: np.ndarray, weights: np.ndarray) -> None:
        self.keys.append(keys)
        self.weights.append(weights)
        self.buffered += len(keys)
        if self.buffered >= self.buffer:
            self._reduce()

    def _reduce(self) -> None:
        if not self.keys:
            return
        keys, ws = np.concatenate(self.keys), np.concatenate(self.weights)
        if self.dense is not None:
            self.dense += np.bincount(keys, weights=ws, minlength=self.bins)
            self.keys, self.weights, self.buffered = [], [], 0
            return
        uk, inv = np.unique(keys, return_inverse=True)
        self.keys, self.weights, self.buffered = [uk], [np.bincount(inv, weights=ws)], len(uk)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct keys and their summed weights."""
        self._reduce()
        if self.dense is not None:
            return np.arange(self.bins), self.dense
        if not self.keys:
            return np.zeros(0, np.int64), np.zeros(0)
        return self.keys[0], self.weights[0]
