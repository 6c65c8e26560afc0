"""Mining the failure groups: the frequent single items (the values a finding can hold, so the
values the rows are coded by), FP-Growth over the groups, and the implications between levels
of a hierarchy learnt from them."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from stalwart.diagnose.fpgrowth import fpgrowth_rows
from stalwart.diagnose.options import DiagnoseOptions

__all__ = ["closure_fn", "coded_values", "frequent_items", "mine_groups", "support_floor"]

Itemset = tuple[tuple[int, str], ...]

_SUPPORT_TOLERANCE = 1e-9  # relative; far above float rounding, far below any real difference


def support_floor(total: float, min_support: float) -> float:
    """The smallest failure mass of a frequent item-set: ``min_support`` of ``total``, less a
    relative 1e-9, so that an item-set exactly at the share is kept whatever the rounding
    (7 failures of 50 at 0.14: 50 * 0.14 is 7.000000000000001), as mlxtend keeps it. Every
    frequency test compares with this one number: the single items, FP-Growth (both of its
    forms) and the folding of rare values in cleaning."""
    return total * min_support * (1.0 - _SUPPORT_TOLERANCE)


def frequent_items(codes: np.ndarray, t: np.ndarray, min_weight: float) -> list[np.ndarray]:
    """Per column, which codes are frequent among the failures (failure mass >= min_weight)."""
    return [np.bincount(codes[:, c], weights=t) >= min_weight for c in range(codes.shape[1])]


def coded_values(keepers: list[np.ndarray], values: list[list[str]]) -> dict[int, list[str]]:
    """The values that can occur in a finding, per column, sorted: exactly the frequent single
    items (every frequent item is a frequent item-set of its own)."""
    return {
        c: sorted(values[c][i] for i in np.flatnonzero(k).tolist())
        for c, k in enumerate(keepers)
        if k.any()
    }


def mine_groups(
    codes: np.ndarray,
    t: np.ndarray,
    keepers: list[np.ndarray],
    min_weight: float,
    opts: DiagnoseOptions,
    columns: tuple[str, ...],
) -> dict[tuple[tuple[int, int], ...], float]:
    """Frequent item-sets of the failure groups, as (column, code) pairs, without item-sets that
    name two levels of one hierarchy."""
    n_cols = codes.shape[1]
    offsets = np.zeros(n_cols + 1, dtype=np.int64)
    for c in range(n_cols):
        offsets[c + 1] = offsets[c] + len(keepers[c])
    items = codes.astype(np.int64) + offsets[:-1]
    frequent = np.zeros((len(codes), n_cols), dtype=bool)
    for c in range(n_cols):
        frequent[:, c] = keepers[c][codes[:, c]]
    items = np.where(frequent, items, -1)
    found = fpgrowth_rows(items, t, min_weight=min_weight, max_len=opts.max_len, tuning=opts.tuning)
    col_of = np.searchsorted(offsets, np.arange(offsets[-1]), side="right") - 1
    groups = [set(columns.index(c) for c in h if c in columns) for h in opts.hierarchies]
    out = {}
    for s, w in found.items():
        pairs = tuple((int(col_of[i]), int(i - offsets[col_of[i]])) for i in s)
        cols = {c for c, _ in pairs}
        if any(len(cols & g) > 1 for g in groups):
            continue  # two levels of one hierarchy: the finer one already says it
        out[pairs] = w
    return out


def closure_fn(
    codes: np.ndarray,
    values: list[list[str]],
    columns: tuple[str, ...],
    hierarchies: tuple[tuple[str, ...], ...],
) -> Callable[[Itemset], frozenset[tuple[int, str]]]:
    """Item -> the coarser items it implies along ``hierarchies`` (learnt from the failure
    groups; levels not among ``columns``, dropped by cleaning, are skipped)."""
    implies: dict[tuple[int, str], set[tuple[int, str]]] = {}
    for names in hierarchies:
        h = [columns.index(c) for c in names if c in columns]
        for j in range(1, len(h)):
            child, parent = h[j], h[j - 1]
            pairs = np.unique(codes[:, [child, parent]], axis=0)
            kids, n = np.unique(pairs[:, 0], return_counts=True)
            single = set(kids[n == 1].tolist())
            for k, p in pairs.tolist():
                if k in single:
                    implies.setdefault((child, values[child][k]), set()).add(
                        (parent, values[parent][p])
                    )

    def closure(items: Itemset) -> frozenset[tuple[int, str]]:
        out = set(items)
        todo = list(items)
        while todo:
            for up in implies.get(todo.pop(), ()):
                if up not in out:
                    out.add(up)
                    todo.append(up)
        return frozenset(out)

    return closure
