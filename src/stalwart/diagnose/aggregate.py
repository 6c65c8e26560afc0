"""Pre-aggregation in DuckDB and counting of item-sets over the aggregate.

The source is grouped by every cleaned attribute column into a temporary table holding, per
distinct combination, its failure mass ``t`` and its total mass ``r`` (rows, or weights). DuckDB
spills that GROUP BY to its temporary directory when it outgrows ``memory_limit``. The failure
groups (``t > 0``) are fetched for mining; the reference masses of candidate item-sets are then
counted in one streamed pass per round over the aggregate: each column is mapped to a small code
(0 for values no candidate uses, 1..k otherwise) and each cuboid (set of columns) is counted with
one ``bincount`` over its packed code, so the cost is one vector pass per cuboid, not per
item-set. The codes are cached in memory when they fit in ``cache_bytes``.
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stalwart.diagnose.clean import OTHER_VALUE, CleanPlan
from stalwart.diagnose.source import Source

__all__ = ["Aggregate", "FailureGroups", "ItemCounter", "Itemset", "aggregate", "failure_groups"]

log = logging.getLogger(__name__)

Itemset = tuple[tuple[int, str], ...]
"""An item-set: (column index, value) pairs sorted by column index."""

_BATCH_ROWS = 1 << 20
_DENSE_BINS = 1 << 22


@dataclass
class FailureGroups:
    """The failing rows grouped by every cleaned attribute: what FP-Growth mines."""

    columns: tuple[str, ...]
    codes: np.ndarray
    """groups x columns, int32: index into ``values[column]``."""
    values: list[list[str]]
    target: np.ndarray
    """failure mass per group"""

    def examples(self, items: Itemset, limit: int) -> list[dict[str, str]]:
        """Up to ``limit`` failing groups holding ``items``, most failures first."""
        m = np.ones(len(self.target), dtype=bool)
        for c, v in items:
            try:
                m &= self.codes[:, c] == self.values[c].index(v)
            except ValueError:
                return []
        rows = np.flatnonzero(m)
        rows = rows[np.argsort(-self.target[rows], kind="stable")][:limit]
        out = []
        for i in rows.tolist():
            ex = {n: self.values[c][self.codes[i, c]] for c, n in enumerate(self.columns)}
            ex["failures"] = _num(float(self.target[i]))
            out.append(ex)
        return out


@dataclass
class Aggregate:
    """The pre-aggregated table: one row per distinct combination of the attribute values that
    can matter (each column coded 1..k for its values frequent among failures, 0 for the
    rest), with its failure mass ``t`` and total mass ``r``."""

    src: Source
    table: str
    values: dict[int, list[str]]
    total_target: float
    total_reference: float
    groups: int


def _num(v: float) -> str:
    return str(int(v)) if v == int(v) else f"{v:.4g}"


def failure_groups(src: Source, plan: CleanPlan, *, target_sql: str) -> FailureGroups:
    """GROUP BY every cleaned attribute over the failing rows only."""
    sel = ", ".join(f"{e} AS a{i}" for i, e in enumerate(plan.exprs))
    table = src.sql(
        f"SELECT {sel}, sum({target_sql})::DOUBLE AS t FROM {{src}} "
        f"WHERE ({target_sql}) > 0 GROUP BY ALL"
    ).to_arrow_table()
    codes = np.empty((table.num_rows, len(plan.columns)), dtype=np.int32)
    values: list[list[str]] = []
    for i in range(len(plan.columns)):
        enc = pc.dictionary_encode(table.column(i)).combine_chunks()
        codes[:, i] = enc.indices.to_numpy(zero_copy_only=False)
        values.append([str(v) for v in enc.dictionary.to_pylist()])
    t = table.column(len(plan.columns)).to_numpy().astype(np.float64)
    return FailureGroups(plan.columns, codes, values, t)


def aggregate(
    src: Source,
    plan: CleanPlan,
    values: dict[int, list[str]],
    *,
    target_sql: str,
    reference_sql: str,
) -> Aggregate:
    """GROUP BY every attribute (coded by ``values``: the values frequent among failures, the
    rest folded to 0), summing the failure and the total mass; DuckDB spills it to disk when
    it outgrows the memory limit."""
    table = "stalwart_agg_" + uuid.uuid4().hex[:8]
    exprs = []
    for c, vs in sorted(values.items()):
        lits = ", ".join("'" + v.replace("'", "''") + "'" for v in vs)
        # a value that is kept is its own unfolded value, so folding can be skipped unless
        # 'other' itself is one of the values that matter
        expr = plan.exprs[c] if OTHER_VALUE in vs else plan.unfolded[c]
        exprs.append(f"coalesce(list_position([{lits}], {expr}), 0)::USMALLINT AS k{c}")
    sel = ", ".join(exprs) + ", " if exprs else ""
    src.con.execute(
        f"CREATE TEMP TABLE {table} AS SELECT {sel}sum({target_sql})::DOUBLE AS t, "
        f"sum({reference_sql})::DOUBLE AS r FROM {src.name} GROUP BY ALL"
    )
    tot = src.con.sql(
        f"SELECT coalesce(sum(t), 0), coalesce(sum(r), 0), count(*) FROM {table}"
    ).fetchall()[0]
    log.info("aggregated into %d groups", tot[2])
    return Aggregate(
        src, table, dict(sorted(values.items())), float(tot[0]), float(tot[1]), int(tot[2])
    )


class ItemCounter:
    """Counts failure and total masses of item-sets over the aggregate, optionally on a subset
    of its groups (``mask``, aligned with the table's scan order)."""

    def __init__(
        self, agg: Aggregate, *, cache_bytes: int = 1 << 30, sample_size: int = 1 << 16
    ) -> None:
        self.agg = agg
        self.cache_bytes = cache_bytes
        self._cache: tuple[dict[int, np.ndarray], np.ndarray, np.ndarray] | None = None
        self._sample: tuple[dict[int, np.ndarray], np.ndarray] | None = None
        self.sample_size = sample_size
        self._values: dict[int, list[str]] = {}

    def prepare(self) -> None:
        """Cache the coded aggregate in memory when it fits in ``cache_bytes``."""
        self._values = self.agg.values
        self._code = {c: {v: k + 1 for k, v in enumerate(vs)} for c, vs in self._values.items()}
        self._cache = None
        width = 2 * len(self._values) + 16
        if self.agg.groups * width <= self.cache_bytes:
            batches = list(self._batches())
            if batches:
                cols = {c: np.concatenate([b[0][c] for b in batches]) for c in self._values}
                t = np.concatenate([b[1] for b in batches])
                r = np.concatenate([b[2] for b in batches])
            else:
                cols = {c: np.zeros(0, np.uint16) for c in self._values}
                t = r = np.zeros(0)
            self._cache = (cols, t, r)
            self._draw_sample(cols, r)

    def _draw_sample(self, cols: dict[int, np.ndarray], r: np.ndarray) -> None:
        # Groups drawn with probability proportional to their total mass, so a count in the
        # sample is Binomial(size, n(X) / N) whatever the weights.
        total = float(r.sum())
        if len(r) <= self.sample_size or total <= 0:
            self._sample = None
            return
        rng = np.random.default_rng(0)
        pick = rng.choice(len(r), size=self.sample_size, p=r / total)
        self._sample = ({c: v[pick] for c, v in cols.items()}, np.ones(self.sample_size))

    def rows_lower_bound(self, itemsets: Sequence[Itemset], z: float) -> np.ndarray:
        """A lower confidence bound (normal quantile ``z``) on each item-set's total mass, from
        the mass-proportional sample; zeros when no sample was drawn (small tables)."""
        if self._sample is None or not itemsets:
            return np.zeros(len(itemsets))
        cols, ones = self._sample
        _, hits = ItemCounter._counted(itemsets, self._radix_plans(itemsets), cols, ones)
        k = self.sample_size
        p = hits / k
        den = 1 + z * z / k
        mid = (p + z * z / (2 * k)) / den
        half = z * np.sqrt(p * (1 - p) / k + z * z / (4 * k * k)) / den
        return np.maximum(mid - half, 0.0) * self.agg.total_reference

    def _batches(self) -> Iterator[tuple[dict[int, np.ndarray], np.ndarray, np.ndarray]]:
        sel = ", ".join([*(f"k{c}" for c in self._values), "t", "r"])
        reader = self.agg.src.con.sql(f"SELECT {sel} FROM {self.agg.table}").to_arrow_reader(
            _BATCH_ROWS
        )
        for batch in reader:
            rb: pa.RecordBatch = batch
            cols = {
                c: rb.column(i).to_numpy(zero_copy_only=False) for i, c in enumerate(self._values)
            }
            n = len(self._values)
            yield (
                cols,
                rb.column(n).to_numpy(zero_copy_only=False),
                rb.column(n + 1).to_numpy(zero_copy_only=False),
            )

    def count(
        self, itemsets: Sequence[Itemset], *, mask: np.ndarray | None = None, target: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """Failure and total mass of each item-set (restricted to ``mask`` when given); the
        failure mass is left at zero when ``target`` is false."""
        out_t = np.zeros(len(itemsets))
        out_r = np.zeros(len(itemsets))
        if not itemsets:
            return out_t, out_r
        plans = self._radix_plans(itemsets)
        offset = 0
        source = [self._cache] if self._cache is not None else self._batches()
        for cols, t, r in source:
            n = len(t)
            if mask is not None:
                m = mask[offset : offset + n]
                t, r = t * m, r * m
            offset += n
            self._count_batch(cols, t if target else None, r, plans, out_t, out_r)
        return out_t, out_r

    def _radix_plans(
        self, itemsets: Sequence[Itemset]
    ) -> list[tuple[tuple[int, ...], list[int], np.ndarray, np.ndarray]]:
        by_cuboid: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, s in enumerate(itemsets):
            by_cuboid[tuple(c for c, _ in s)].append(i)
        plans = []
        for cuboid, idx in by_cuboid.items():
            radix = [len(self._values[c]) + 1 for c in cuboid]
            keys = np.array([self._key(itemsets[i], radix) for i in idx], dtype=np.int64)
            plans.append((cuboid, radix, np.asarray(idx), keys))
        return plans

    @staticmethod
    def _counted(
        itemsets: Sequence[Itemset],
        plans: list[tuple[tuple[int, ...], list[int], np.ndarray, np.ndarray]],
        cols: dict[int, np.ndarray],
        r: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        out_t = np.zeros(len(itemsets))
        out_r = np.zeros(len(itemsets))
        ItemCounter._count_batch(cols, None, r, plans, out_t, out_r)
        return out_t, out_r

    def match(self, items: Itemset) -> np.ndarray:
        """Which groups of the aggregate (in scan order) hold every item of ``items``."""
        parts = []
        source = [self._cache] if self._cache is not None else self._batches()
        for cols, t, _ in source:
            m = np.ones(len(t), dtype=bool)
            for c, v in items:
                m &= cols[c] == self._code[c][v]
            parts.append(m)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)

    def _key(self, items: Itemset, radix: list[int]) -> int:
        key = 0
        for (c, v), base in zip(items, radix, strict=False):
            key = key * base + self._code[c][v]
        return key

    @staticmethod
    def _count_batch(
        cols: dict[int, np.ndarray],
        t: np.ndarray | None,
        r: np.ndarray,
        plans: list[tuple[tuple[int, ...], list[int], np.ndarray, np.ndarray]],
        out_t: np.ndarray,
        out_r: np.ndarray,
    ) -> None:
        prefix: dict[tuple[int, ...], np.ndarray] = {}
        for cuboid, radix, idx, keys in plans:
            bins = int(np.prod(radix, dtype=np.int64))
            dtype = np.int32 if bins < 2**31 else np.int64
            head = cuboid[:-1]
            if head in prefix:
                key = prefix[head] * radix[-1] + cols[cuboid[-1]]
            else:
                key = cols[cuboid[0]].astype(dtype)
                for c, base in zip(cuboid[1:], radix[1:], strict=False):
                    key = key * base + cols[c]
            if len(cuboid) < 3:
                prefix[cuboid] = key
            if bins <= _DENSE_BINS:
                out_r[idx] += np.bincount(key, weights=r, minlength=bins)[keys]
                if t is not None:
                    out_t[idx] += np.bincount(key, weights=t, minlength=bins)[keys]
            else:
                order = np.argsort(keys)
                sk = keys[order]
                pos = np.searchsorted(sk, key)
                pos[pos >= len(sk)] = 0
                hit = sk[pos] == key
                out_r[idx[order]] += np.bincount(pos[hit], weights=r[hit], minlength=len(sk))
                if t is not None:
                    out_t[idx[order]] += np.bincount(pos[hit], weights=t[hit], minlength=len(sk))
