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
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["fpgrowth", "fpgrowth_rows"]

_DENSE_TRIPLES = 1 << 22  # count triples in a dense array up to this many (32 MB)


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
    items: np.ndarray, weights: np.ndarray, *, min_weight: float, max_len: int
) -> dict[tuple[int, ...], float]:
    """``fpgrowth`` for transactions given as a matrix, without a Python loop per transaction.

    Args:
        items: transactions x slots, int: the items of each transaction, -1 in empty slots
            (each item at most once per transaction).
        weights: one non-negative weight per transaction.
        min_weight: the smallest total weight of a frequent item-set (> 0).
        max_len: the longest item-set reported (>= 1).

    Returns:
        item-set (items sorted ascending) -> supporting weight, as ``fpgrowth`` returns.
    """
    items = np.asarray(items, dtype=np.int64)
    w = np.asarray(weights, dtype=np.float64)
    if items.ndim != 2 or len(items) != len(w):
        raise ValueError("one weight per transaction (row of items)")
    if max_len > 3:
        tx = [[i for i in row if i >= 0] for row in items.tolist()]
        return fpgrowth(tx, w.tolist(), min_weight=min_weight, max_len=max_len)
    present = items >= 0
    n_items = int(items.max()) + 1 if present.any() else 0
    counts = np.bincount(
        items[present], weights=np.broadcast_to(w[:, None], items.shape)[present], minlength=n_items
    )
    frequent = np.flatnonzero(counts >= min_weight)
    order = frequent[np.lexsort((frequent, -counts[frequent]))]  # most frequent first
    k = len(order)
    rank = np.full(n_items + 1, k, dtype=np.int64)  # slot n_items: the empty slot, ranked last
    rank[order] = np.arange(k)
    ranked = np.sort(rank[np.where(present, items, n_items)], axis=1)
    depth = int((ranked < k).sum(axis=1).max()) if len(ranked) else 0
    keep = (w > 0) & (ranked[:, 0] < k) if depth else np.zeros(len(w), dtype=bool)
    found = _mine_flat_rows(ranked[keep, :depth], w[keep], k, min_weight, max_len)
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
    rows: np.ndarray, w: np.ndarray, k: int, min_weight: float, max_len: int
) -> dict[tuple[int, ...], float]:
    """``_mine_flat`` on paths as rows of ranks sorted ascending, padded with ``k``; identical
    paths may repeat (they become one node chain)."""
    out: dict[tuple[int, ...], float] = {}
    if len(rows) == 0 or rows.shape[1] == 0:
        return out
    depth = rows.shape[1]
    order = np.lexsort(rows.T[::-1])
    rows, w = rows[order], w[order]
    # node of row i at depth d: a new node wherever the prefix [0..d] changes
    node_item, node_w, node_parent, node_depth = [], [], [], []
    parent = np.full(len(rows), -1, dtype=np.int64)
    changed = np.zeros(len(rows), dtype=bool)
    changed[0] = True
    next_id = 0
    for d in range(depth):
        col = rows[:, d]
        changed = changed | np.concatenate(([True], col[1:] != col[:-1]))
        present = col < k
        start = changed & present
        ids = np.cumsum(start) - 1 + next_id
        n_new = int(start.sum())
        nid = np.where(present, ids, -1)
        node_item.append(col[start])
        node_w.append(np.bincount(ids[present] - next_id, weights=w[present], minlength=n_new))
        node_parent.append(parent[start])
        node_depth.append(np.full(n_new, d))
        parent = np.where(present, nid, parent)
        next_id += n_new
    item = np.concatenate(node_item)
    weight = np.concatenate(node_w)
    par = np.concatenate(node_parent)
    dep = np.concatenate(node_depth)
    single = np.bincount(item, weights=weight, minlength=k)
    for i in np.flatnonzero(single >= min_weight).tolist():
        out[(i,)] = float(single[i])
    if max_len < 2:
        return out
    # ancestors of every node, as items by depth (-1 below the node's own depth)
    # the largest array of the walk (nodes x depth): ranks fit in 16 bits for any realistic k
    anc = np.full((len(item), depth), -1, dtype=np.int16 if k < 2**15 else np.int32)
    cur = par.copy()
    for _ in range(depth):
        ok = cur >= 0
        if not ok.any():
            break
        anc[ok, dep[cur[ok]]] = item[cur[ok]]
        cur = np.where(ok, par[np.maximum(cur, 0)], -1)
    keep = single >= min_weight
    pair = np.zeros(k * k)
    for d in range(depth):
        a = anc[:, d]
        m = a >= 0
        pair += np.bincount(item[m] * k + a[m], weights=weight[m], minlength=k * k)
    frequent_pair = pair >= min_weight
    for key in np.flatnonzero(frequent_pair).tolist():
        out[(key % k, key // k)] = float(pair[key])
    if max_len < 3 or not frequent_pair.any():
        return out
    # every (node, ancestor, older ancestor) triple whose pairs are frequent, weighted by the
    # node; summed in one pass at the end
    keys_parts: list[np.ndarray] = []
    weight_parts: list[np.ndarray] = []
    for q in range(depth):
        y = anc[:, q]
        m = (y >= 0) & frequent_pair[np.where(y >= 0, item * k + y, 0)]
        if not m.any():
            continue
        xs, ys, ws = item[m], y[m], weight[m]
        for lo in range(q):
            z = anc[m, lo]
            mm = (z >= 0) & frequent_pair[np.where(z >= 0, xs * k + z, 0)] & keep[np.maximum(z, 0)]
            if not mm.any():
                continue
            keys_parts.append((xs[mm] * k + ys[mm]) * k + z[mm])
            weight_parts.append(ws[mm])
    if not keys_parts:
        return out
    keys, ws = np.concatenate(keys_parts), np.concatenate(weight_parts)
    if k**3 <= _DENSE_TRIPLES:
        sums = np.bincount(keys, weights=ws, minlength=k**3)
        uk = np.arange(k**3)
    else:
        uk, inv = np.unique(keys, return_inverse=True)
        sums = np.bincount(inv, weights=ws)
    hit = sums >= min_weight
    for key, val in zip(uk[hit].tolist(), sums[hit].tolist(), strict=True):
        out[(key % k, (key // k) % k, key // (k * k))] = val
    return out
