"""Pre-aggregation in DuckDB and counting of item-sets over the aggregate.

Every cleaned attribute is coded as a small integer (0 for values no candidate uses, 1..k
otherwise), and each row carries its failure mass ``t`` and total mass ``r``. When the coded rows
fit in ``in_memory_bytes`` they are fetched as they are, in one projection scan: a GROUP BY over
20 attributes barely compresses real logs (nearly every row is its own combination) and costs
four times the scan. Larger inputs are written once, in the same scan, to a row cache on local
disk (``rowcache``: one file per column, one byte a code) that every counting round rereads
chunk by chunk; they are grouped by every coded column first only when that shrinks them 4x.

Counting: rows whose total mass is 1 and failure mass 0 or 1 (plain events) are held as one
bitset per item; an item-set's masses are popcounts of the AND of its items' bitsets (and the
failure bitset), a few microseconds per item-set. The other rows (weighted, or grouped) are
counted per cuboid (set of columns) with one ``bincount`` over its packed code, so the cost is one
vector pass per cuboid, not per item-set. The failing rows (``t > 0``) are fetched separately,
at full resolution, and grouped in NumPy for mining.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stalwart.diagnose.budget import IN_MEMORY_BYTES, in_memory_budget
from stalwart.diagnose.clean import OTHER_VALUE, CleanPlan
from stalwart.diagnose.options import EngineTuning
from stalwart.diagnose.quoting import literal
from stalwart.diagnose.rowcache import (
    SAMPLE_ROWS,
    Chunk,
    RowCache,
    group_rows,
    scratch_folder,
    write_rows,
)
from stalwart.diagnose.source import Source
from stalwart.diagnose.unitbits import UnitBits

__all__ = [
    "Aggregate",
    "FailureGroups",
    "ItemCounter",
    "Itemset",
    "aggregate",
    "failure_groups",
    "in_memory_budget",
]

log = logging.getLogger(__name__)

Itemset = tuple[tuple[int, str], ...]
"""An item-set: (column index, value) pairs sorted by column index."""

_DENSE_BINS = 1 << 22
_CASE_VALUES = 32  # a CASE chain beats list_position up to about this many values


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
    values: dict[int, list[str]]
    total_target: float
    total_reference: float
    groups: int
    """Rows of the aggregate (the input's rows when they were not grouped)."""
    arrays: tuple[dict[int, np.ndarray], np.ndarray, np.ndarray] | None = None
    """In-memory codes per column (uint8, or uint16 past 255 values), failure masses and total
    masses."""
    cache: RowCache | None = None
    """The coded rows on local disk, when they are not held in ``arrays``."""


def _num(v: float) -> str:
    return str(int(v)) if v == int(v) else f"{v:.4g}"


def failure_groups(
    src: Source, plan: CleanPlan, *, target_sql: str, tuning: EngineTuning | None = None
) -> FailureGroups:
    """The failing rows grouped by every cleaned attribute, dictionary-coded batch by batch;
    past ``tuning.stream_rows`` input rows the batches stream from DuckDB, so the rows' text
    values never sit in memory all at once (at 100 M rows: millions of rows of 20 strings)."""
    tuning = tuning or EngineTuning()
    # DuckDB's GROUP BY of twenty text columns costs ten times the scan (failing rows are mostly
    # distinct): the rows come ungrouped and are grouped by their codes, whenever the rows held
    # since the last grouping outnumber the groups (memory follows the groups)
    sel = ", ".join(f"{e} AS a{i}" for i, e in enumerate(plan.exprs))
    rel = src.sql(
        f"SELECT {sel}, ({target_sql})::DOUBLE AS t FROM {{src}} WHERE ({target_sql}) > 0"
    )
    # a materialized result is faster while small: stream only large inputs
    reader = (
        rel.to_arrow_table().to_batches()
        if plan.rows <= tuning.stream_rows
        else rel.to_arrow_reader(tuning.batch_rows)
    )
    n_cols = len(plan.columns)
    lookup: list[dict[str, int]] = [{} for _ in range(n_cols)]
    codes, t = np.zeros((0, n_cols), dtype=np.int32), np.zeros(0)
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    held = 0
    for batch in reader:
        parts.append((_dictionary_codes(batch, lookup), batch.column(n_cols).to_numpy(False)))
        held += batch.num_rows
        if held >= max(len(t), tuning.batch_rows):
            codes, t = _regroup(codes, t, parts)
            parts, held = [], 0
    codes, t = _regroup(codes, t, parts)
    return FailureGroups(plan.columns, codes, [list(d) for d in lookup], t)


def _dictionary_codes(batch: pa.RecordBatch, lookup: list[dict[str, int]]) -> np.ndarray:
    """The batch's first ``len(lookup)`` columns as codes into the growing ``lookup``."""
    codes = np.empty((batch.num_rows, len(lookup)), dtype=np.int32)
    for i, known in enumerate(lookup):
        enc = pc.dictionary_encode(batch.column(i))
        ids = [known.setdefault(str(v), len(known)) for v in enc.dictionary.to_pylist()]
        codes[:, i] = np.asarray(ids, dtype=np.int32)[enc.indices.to_numpy(zero_copy_only=False)]
    return codes


def _regroup(
    codes: np.ndarray, t: np.ndarray, parts: list[tuple[np.ndarray, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray]:
    if not parts:
        return codes, t
    more = np.concatenate([codes, *(c for c, _ in parts)])
    return group_rows(more, np.concatenate([t, *(w.astype(np.float64) for _, w in parts)]))


def aggregate(
    src: Source,
    plan: CleanPlan,
    values: dict[int, list[str]],
    *,
    target_sql: str,
    reference_sql: str,
    in_memory_bytes: int = IN_MEMORY_BYTES,
    tuning: EngineTuning | None = None,
) -> Aggregate:
    """Code every attribute by ``values`` (the values frequent among failures, the rest 0) and
    attach each row's failure and total mass: held in memory as NumPy arrays when the coded rows
    fit in ``in_memory_bytes``, else written to a row cache in the analysis' temporary folder
    (grouped by every coded column first when that divides them by ``tuning.group_gain``)."""
    tuning = tuning or EngineTuning()
    values = dict(sorted(values.items()))
    sel = "".join(f"{_coded(plan, c, vs)} AS k{c}, " for c, vs in values.items())
    proj = (
        f"SELECT {sel}coalesce({target_sql}, 0)::DOUBLE AS t, "
        f"coalesce({reference_sql}, 0)::DOUBLE AS r FROM {{src}}"
    )
    if plan.rows * _row_bytes(len(values)) <= in_memory_bytes:
        table = src.sql(proj).to_arrow_table()
        n = len(values)
        cols = {
            c: table.column(i).combine_chunks().to_numpy(zero_copy_only=False)
            for i, c in enumerate(values)
        }
        t = table.column(n).combine_chunks().to_numpy(zero_copy_only=False)
        r = table.column(n + 1).combine_chunks().to_numpy(zero_copy_only=False)
        log.info("held %d coded rows in memory", len(t))
        return Aggregate(src, values, float(t.sum()), float(r.sum()), len(t), arrays=(cols, t, r))
    # Out of core: the coded rows are written once to local files (one scan); they are grouped
    # (a second scan) only when that shrinks them several times over, since a GROUP BY of rows
    # that are nearly all distinct costs a spilled hash table for nothing.
    sizes, folder = {c: len(vs) for c, vs in values.items()}, scratch_folder(src)
    # a counting pass holds one chunk of tuning.batch_rows rows
    chunk, gain = tuning.batch_rows, tuning.group_gain
    reader = src.sql(proj).to_arrow_reader(chunk)
    rows = write_rows(reader, list(values), sizes, folder, plan.rows // gain, chunk)
    distinct = rows.distinct()
    if distinct * gain <= plan.rows:
        keys = "".join(f"k{c}, " for c in values)
        grouped = src.sql(f"SELECT {keys}sum(t) AS t, sum(r) AS r FROM ({proj}) GROUP BY ALL")
        reader = grouped.to_arrow_reader(chunk)
        rows.remove()
        rows = write_rows(reader, list(values), sizes, folder, chunk_rows=chunk)
    log.info("aggregated into %d groups (about %d distinct or more)", rows.rows, distinct)
    return Aggregate(src, values, rows.total_target, rows.total_reference, rows.rows, cache=rows)


def _row_bytes(n_columns: int) -> int:
    # uint16 codes, float64 t and r, and the bitsets and temporaries counting needs
    return 2 * n_columns + 24


def _coded(plan: CleanPlan, c: int, vs: list[str]) -> str:
    """SQL coding column ``c``: 1..k for ``vs`` in order, 0 for any other value."""
    lits = [literal(v) for v in vs]
    kind = "UTINYINT" if len(vs) < 256 else "USMALLINT"  # the smallest that holds 0..k
    if OTHER_VALUE in vs or len(vs) > _CASE_VALUES:
        # a kept value is its own unfolded value, so folding is needed only when 'other'
        # itself is one of the values that matter
        expr = plan.exprs[c] if OTHER_VALUE in vs else plan.unfolded[c]
        return f"coalesce(list_position([{', '.join(lits)}], {expr}), 0)::{kind}"
    whens = " ".join(f"WHEN {lit} THEN {k + 1}" for k, lit in enumerate(lits))
    return f"(CASE {plan.unfolded[c]} {whens} ELSE 0 END)::{kind}"


class ItemCounter:
    """Counts failure and total masses of item-sets over the aggregate, optionally on a subset
    of its groups (``mask``, aligned with the table's scan order)."""

    def __init__(
        self, agg: Aggregate, *, cache_bytes: int = 1 << 30, sample_size: int = SAMPLE_ROWS
    ) -> None:
        self.agg = agg
        self.cache_bytes = cache_bytes
        self._cache: tuple[dict[int, np.ndarray], np.ndarray, np.ndarray] | None = None
        self._sample: tuple[dict[int, np.ndarray], np.ndarray] | None = None
        self._bits: UnitBits | None = None
        self.sample_size = sample_size
        self._values: dict[int, list[str]] = {}

    def prepare(self) -> None:
        """Cache the coded aggregate in memory when it fits in ``cache_bytes``."""
        self._values = self.agg.values
        self._code = {c: {v: k + 1 for k, v in enumerate(vs)} for c, vs in self._values.items()}
        self._cache = None
        self._bits = None
        if self.agg.arrays is not None:
            self._cache = self.agg.arrays
        elif self.agg.groups * _row_bytes(len(self._values)) <= self.cache_bytes:
            batches = list(self._batches())
            if batches:
                cols = {c: np.concatenate([b[0][c] for b in batches]) for c in self._values}
                t = np.concatenate([b[1] for b in batches])
                r = np.concatenate([b[2] for b in batches])
            else:
                cols = {c: np.zeros(0, np.uint16) for c in self._values}
                t = r = np.zeros(0)
            self._cache = (cols, t, r)
        if self._cache is not None:
            cols, t, r = self._cache
            self._bits = UnitBits(cols, t, r)
            self._draw_sample(cols, r)
        elif self.agg.cache is not None:  # drawn while the rows were written
            sample = self.agg.cache.sample(self.sample_size)
            self._sample = None if sample is None else (sample, np.ones(self.sample_size))

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
        hits = np.zeros(len(itemsets))
        _count_batch(cols, None, ones, self._radix_plans(itemsets), np.zeros(len(itemsets)), hits)
        k = self.sample_size
        p = hits / k
        den = 1 + z * z / k
        mid = (p + z * z / (2 * k)) / den
        half = z * np.sqrt(p * (1 - p) / k + z * z / (4 * k * k)) / den
        return np.maximum(mid - half, 0.0) * self.agg.total_reference

    def _batches(
        self, columns: Iterable[int] | None = None, flags: bool = False
    ) -> Iterator[Chunk]:
        assert self.agg.cache is not None
        return self.agg.cache.read(self._values if columns is None else columns, flags=flags)

    def count(
        self, itemsets: Sequence[Itemset], *, mask: np.ndarray | None = None, target: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """Failure and total mass of each item-set (restricted to ``mask`` when given); the
        failure mass is left at zero when ``target`` is false."""
        out_t = np.zeros(len(itemsets))
        out_r = np.zeros(len(itemsets))
        if not itemsets:
            return out_t, out_r
        codes = [tuple((c, self._code[c][v]) for c, v in s) for s in itemsets]
        plans = None
        parts: Iterable[tuple[tuple[dict[int, np.ndarray], np.ndarray, np.ndarray], UnitBits]]
        if self._cache is not None:
            assert self._bits is not None
            parts = [(self._cache, self._bits)]
        else:
            # streamed: each batch gets its own bitsets, built for the items asked about
            needed = sorted({c for s in itemsets for c, _ in s})
            parts = ((b, UnitBits(*b)) for b in self._batches(needed, flags=True))
        offset = 0
        for (cols, t, r), bits in parts:
            n = len(t)
            m = None if mask is None else np.asarray(mask[offset : offset + n], dtype=bool)
            offset += n
            bits.count(codes, m, target, out_t, out_r)
            if len(bits.rest):
                rest = bits.rest if m is None else bits.rest[m[bits.rest]]
                sub = {c: v[rest] for c, v in cols.items()}
                plans = plans or self._radix_plans(itemsets)
                _count_batch(sub, t[rest] if target else None, r[rest], plans, out_t, out_r)
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

    def match(self, items: Itemset) -> np.ndarray:
        """Which groups of the aggregate (in scan order) hold every item of ``items``."""
        parts = []
        source = (
            self._batches((c for c, _ in items), True) if self._cache is None else [self._cache]
        )
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


def _count_batch(
    cols: dict[int, np.ndarray],
    t: np.ndarray | None,
    r: np.ndarray,
    plans: list[tuple[tuple[int, ...], list[int], np.ndarray, np.ndarray]],
    out_t: np.ndarray,
    out_r: np.ndarray,
) -> None:
    """Add each item-set's masses in one batch to ``out_r`` (and ``out_t`` when ``t`` is given),
    cuboid by cuboid: a dense bincount of radix keys when the bins are few, else a search in
    the item-sets' sorted keys."""
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
