"""Element sums of the KPI search's cuboids: each leaf's element id in a cuboid, and the sums of
the per-leaf scores over each element, kept current as found causes remove leaves."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from stalwart.diagnose.options import EngineTuning

__all__ = ["ElementSums", "Ids", "cell_ids", "element_ids", "weights"]

Ids = Callable[[], np.ndarray]
"""A cuboid's element id per live leaf, computed when first asked for (most cuboids' sums are
read without them)."""


def cell_ids(codes: np.ndarray, cols: tuple[int, ...], cards: tuple[int, ...]) -> np.ndarray:
    """Each leaf's element in a cuboid as its cell's index in the cuboid's full grid."""
    key = codes[:, cols[0]].astype(np.int64)
    for c in cols[1:]:
        key *= cards[c]
        key += codes[:, c]
    return key


def element_ids(
    codes: np.ndarray, cols: tuple[int, ...], cards: tuple[int, ...]
) -> tuple[np.ndarray, int]:
    """Each leaf's element in a cuboid, as dense-ish ids, and how many ids there are."""
    key = cell_ids(codes, cols, cards)
    size = math.prod(cards[c] for c in cols)
    if size <= 4 * len(codes) + 1024:
        return key, size
    uniq, inv = np.unique(key, return_inverse=True)
    return inv.ravel(), len(uniq)


def weights(st: Any) -> tuple[np.ndarray, ...]:
    """The per-leaf scores summed per element: explanatory power, abnormal and all weight,
    moved (+1/-1), its absolute value, and whether the leaf lies beyond the noise cut."""
    ab = (st.w_abnormal > 0).astype(np.float64)
    return st.ep, st.w_abnormal, st.w_all, st.moved, np.abs(st.moved), ab


class ElementSums:
    """Each cuboid's element sums over the live leaves, kept current by subtracting the leaves
    a found cause removes: a cuboid is summed once per search, not once per round (skipped
    when the element ids of every cuboid would not fit in ``tuning.kpi_cache_ids``).

    Beyond that, when the cube is dense (every combination of values a leaf, as in RiskLoc's
    recipes: at most ``tuning.kpi_dense_cells`` cells a leaf), cuboids are summed together:
    each score is counted once into the full cube's cells and every cuboid is a sum over the
    cube's other axes. All layers of up to ``d - 2`` attributes (small: the cube over two
    missing attributes at most) are summed in one pass per score when the round first asks and
    kept until leaves are removed; the two largest layers one at a time, when asked.
    """

    def __init__(self, first: Any, cards: tuple[int, ...], tuning: EngineTuning) -> None:
        self.codes, self.cards = first.codes, cards
        """Every leaf's codes (the search's first state's, which later states shrink)."""
        n = len(first.codes)
        self.on = n * (2 ** len(cards) - 1) <= tuning.kpi_cache_ids
        self.dense = not self.on and math.prod(cards) <= tuning.kpi_dense_cells * n + 1024
        self.ids: dict[tuple[int, ...], tuple[np.ndarray, int]] = {}
        self.sums: dict[tuple[int, ...], list[np.ndarray]] = {}

    def get(self, st: Any, cols: tuple[int, ...]) -> tuple[Ids, int, list[np.ndarray]]:
        """The live leaves' element ids in ``cols`` (when called), how many ids, and the sums."""
        if self.dense:
            if cols not in self.sums:
                d = len(self.cards)
                if len(cols) <= d - 2:  # every small layer at once, kept for the round
                    self.sums.update(self._layers(st, range(1, d - 1)))
                else:  # a large layer alone, replacing the other large one
                    self.sums = {c: v for c, v in self.sums.items() if len(c) <= d - 2}
                    self.sums.update(self._layers(st, (len(cols),)))
            n = math.prod(self.cards[c] for c in cols)
            codes = st.codes
            return functools.cache(lambda: cell_ids(codes, cols, self.cards)), n, self.sums[cols]
        if not self.on:
            ids, n = element_ids(st.codes, cols, self.cards)
            sums = [np.bincount(ids, weights=w, minlength=n) for w in weights(st)]
            return (lambda: ids), n, sums
        if cols not in self.ids:
            full, n = element_ids(self.codes, cols, self.cards)
            self.ids[cols] = (full, n)
            live = full[st.index]
            self.sums[cols] = [np.bincount(live, weights=w, minlength=n) for w in weights(st)]
        full, n = self.ids[cols]
        index = st.index
        return functools.cache(lambda: full[index]), n, self.sums[cols]  # once, on first use

    def element_codes(self, st: Any, cols: tuple[int, ...], ids: Ids, e: int) -> tuple[int, ...]:
        """The value codes of element ``e`` of cuboid ``cols`` (from its id when it is the
        element's cell, without a pass over the leaves)."""
        if self.dense:
            return tuple(int(v) for v in np.unravel_index(e, [self.cards[c] for c in cols]))
        row = st.codes[int(np.argmax(ids() == e))]
        return tuple(int(row[c]) for c in cols)

    def _layers(self, st: Any, layers: Any) -> dict[tuple[int, ...], list[np.ndarray]]:
        """Every cuboid of ``layers``: its sums over the live leaves, from the full cube's cell
        sums, one score at a time: the cube is counted once per score (one pass over the
        leaves) and each cuboid is summed from its smallest parent (itself plus the missing
        attribute of fewest values), kept while this score's cuboids are summed."""
        full = tuple(range(len(self.cards)))
        cell = cell_ids(st.codes, full, self.cards)
        size = math.prod(self.cards)
        out: dict[tuple[int, ...], list[np.ndarray]] = {}
        for w in weights(st):
            memo = {full: np.bincount(cell, weights=w, minlength=size).reshape(self.cards)}
            for layer in layers:
                for cols in itertools.combinations(full, layer):
                    out.setdefault(cols, []).append(self._marginal(memo, cols).ravel())
            del memo
        return out

    def _marginal(self, memo: dict[tuple[int, ...], np.ndarray], cols: tuple[int, ...]) -> Any:
        if cols not in memo:
            cards = self.cards
            add = min((a for a in range(len(cards)) if a not in cols), key=lambda a: cards[a])
            parent = tuple(sorted((*cols, add)))
            memo[cols] = self._marginal(memo, parent).sum(axis=parent.index(add))
        return memo[cols]

    def remove(self, st: Any, mask: np.ndarray) -> None:
        """Take the live leaves in ``mask`` out of every cached cuboid's sums."""
        if self.dense:
            self.sums = {}
            return
        gone = st.keep(mask)
        for cols, (full, n) in self.ids.items():
            ids = full[gone.index]
            for total, w in zip(self.sums[cols], weights(gone), strict=True):
                total -= np.bincount(ids, weights=w, minlength=n)
