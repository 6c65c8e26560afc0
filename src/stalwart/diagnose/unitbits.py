"""Plain events (total mass 1, failure mass 0 or 1) as bitsets: one per item, built on first
use, so an item-set's masses are popcounts of ANDed bitsets."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["UnitBits"]

_PAIR_CACHE_BYTES = 1 << 26


class UnitBits:
    """The unit rows of the aggregate (total mass 1, failure mass 0 or 1: plain events) as one
    bitset per item, built on first use; ``rest`` indexes the other rows.

    An item-set's masses over the unit rows are popcounts of the AND of its items' bitsets (and of
    the failure bitset): about 16,000 64-bit words per million rows, microseconds per item-set.
    """

    def __init__(self, cols: dict[int, np.ndarray], t: np.ndarray, r: np.ndarray | None) -> None:
        self.cols = cols
        if r is None:  # plain events: ``t`` holds their failure flags
            self.rest, self.unit = np.zeros(0, np.intp), None
        else:
            unit = (r == 1.0) & ((t == 0.0) | (t == 1.0))
            self.rest = np.flatnonzero(~unit)
            self.unit = None if len(self.rest) == 0 else self._pack(unit)
        self.fail = self._pack(t == 1)
        self._items: dict[tuple[int, int], np.ndarray] = {}

    def _pack(self, m: np.ndarray) -> np.ndarray:
        packed = np.packbits(m.view(np.uint8), bitorder="little")
        pad = -len(packed) % 8
        if pad:
            packed = np.concatenate([packed, np.zeros(pad, np.uint8)])
        return packed.view(np.uint64)

    def item(self, c: int, code: int) -> np.ndarray:
        key = (c, code)
        got = self._items.get(key)
        if got is None:
            got = self._pack(self.cols[c] == code)
            if self.unit is not None:
                got &= self.unit
            self._items[key] = got
        return got

    def count(
        self,
        itemsets: Sequence[tuple[tuple[int, int], ...]],
        mask: np.ndarray | None,
        target: bool,
        out_t: np.ndarray,
        out_r: np.ndarray,
    ) -> None:
        """Add each coded item-set's unit-row masses (within ``mask``) to ``out_t``/``out_r``."""
        within = None if mask is None else self._pack(np.asarray(mask, dtype=bool))
        # ANDed pairs are reused by the triples that extend them, within a bounded budget
        pairs: dict[tuple[tuple[int, int], ...], np.ndarray] = {}
        max_pairs = _PAIR_CACHE_BYTES // max(self.fail.nbytes, 1)
        for i, s in enumerate(itemsets):
            if len(s) > 2 and s[:2] in pairs:
                acc = pairs[s[:2]] & self.item(*s[2])
                rest = s[3:]
            else:
                acc = self.item(*s[0]).copy()
                for it in s[1:2]:
                    acc &= self.item(*it)
                if len(s) >= 2 and len(pairs) < max_pairs:
                    pairs[s[:2]] = acc.copy()
                rest = s[2:]
            for it in rest:
                acc &= self.item(*it)
            if within is not None:
                acc &= within
            out_r[i] += int(np.bitwise_count(acc).sum())
            if target:
                out_t[i] += int(np.bitwise_count(acc & self.fail).sum())
