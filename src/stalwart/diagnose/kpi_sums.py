"""Element sums of the KPI search's cuboids: each leaf's element id in a cuboid, and the sums of
the per-leaf scores over each element, kept current as found causes remove leaves."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ElementSums", "element_ids", "weights"]

_CACHE_IDS = 10_000_000
"""Most element ids (leaves x cuboids) held for the whole search; beyond it, recount each round."""


def element_ids(
    codes: np.ndarray, cols: tuple[int, ...], cards: tuple[int, ...]
) -> tuple[np.ndarray, int]:
    """Each leaf's element in a cuboid, as dense-ish ids, and how many ids there are."""
    key = codes[:, cols[0]].astype(np.int64)
    size = cards[cols[0]]
    for c in cols[1:]:
        key *= cards[c]
        key += codes[:, c]
        size *= cards[c]
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
    when the element ids of every cuboid would not fit in ``_CACHE_IDS``)."""

    def __init__(self, first: Any, cards: tuple[int, ...]) -> None:
        self.codes, self.cards = first.codes, cards
        """Every leaf's codes (the search's first state's, which later states shrink)."""
        self.on = len(first.codes) * (2 ** len(cards) - 1) <= _CACHE_IDS
        self.ids: dict[tuple[int, ...], tuple[np.ndarray, int]] = {}
        self.sums: dict[tuple[int, ...], list[np.ndarray]] = {}

    def get(self, st: Any, cols: tuple[int, ...]) -> tuple[np.ndarray, int, list[np.ndarray]]:
        """The live leaves' element ids in ``cols``, how many ids, and the sums."""
        if not self.on:
            ids, n = element_ids(st.codes, cols, self.cards)
            return ids, n, [np.bincount(ids, weights=w, minlength=n) for w in weights(st)]
        if cols not in self.ids:
            full, n = element_ids(self.codes, cols, self.cards)
            self.ids[cols] = (full, n)
            live = full[st.index]
            self.sums[cols] = [np.bincount(live, weights=w, minlength=n) for w in weights(st)]
        full, n = self.ids[cols]
        return full[st.index], n, self.sums[cols]

    def remove(self, st: Any, mask: np.ndarray) -> None:
        """Take the live leaves in ``mask`` out of every cached cuboid's sums."""
        gone = st.keep(mask)
        for cols, (full, n) in self.ids.items():
            ids = full[gone.index]
            for total, w in zip(self.sums[cols], weights(gone), strict=True):
                total -= np.bincount(ids, weights=w, minlength=n)
