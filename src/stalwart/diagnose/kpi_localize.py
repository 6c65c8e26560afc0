"""``localize``'s pipeline: clean the attributes, one row per cleaned leaf with its KPI columns
summed (DuckDB GROUP BY), the leaf-level search of ``kpi_search``, and findings.

The search reads each leaf's raw actual and forecast values (not clipped deviation masses): the
forecast noise is estimated from the leaves that moved *against* the deviation, so both signs
must reach it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow.compute as pc

from stalwart.diagnose.budget import duckdb_limit, parse_bytes
from stalwart.diagnose.clean import plan_cleaning
from stalwart.diagnose.kpi_search import KpiLeaves, Localized, SearchParams, search
from stalwart.diagnose.kpi_sums import cell_ids
from stalwart.diagnose.options import DiagnoseOptions
from stalwart.diagnose.quoting import as_double
from stalwart.diagnose.result import Diagnosis, Finding
from stalwart.diagnose.source import Source
from stalwart.diagnose.target import Masses
from stalwart.errors import ConfigError

__all__ = ["kpi_leaves", "localize_frame", "localize_kpi"]

_TINY = 1e-12
_BATCH = 1 << 20
"""Leaves per batch on their way from DuckDB to NumPy."""
_LEAF_BYTES = 160
"""Bytes per leaf the search's arrays and its largest per-cuboid temporaries take beside the
codes and KPI columns (measured on a RiskLoc H case, 24 M leaves of six attributes: peak RSS
4.26 GB in the second stage, of which about 0.4 GB the interpreter; see ``_check_budget``;
summing a dense cube's layers together adds about 9 bytes a leaf, 171 -> 180 over the leaves
on an H-shaped cube of 2.4 M leaves)."""
_RELEASE_LIMIT = "64MB"
"""DuckDB's limit for a moment after the leaves are fetched, to empty its buffer pool."""
_PROCESS_BYTES = 250 * 10**6
"""Resident bytes of the interpreter and its libraries beside the leaves (DuckDB's buffer pool
is emptied before the search, see ``_release``)."""


def localize_kpi(
    src: Source,
    actual: str | tuple[str, str],
    expected: str | tuple[str, str],
    attrs: list[str],
    masses: Masses,
    opts: DiagnoseOptions,
) -> Diagnosis:
    """Localize the KPI's deviation over ``attrs`` (already checked against the source)."""
    start = time.perf_counter()
    mode = "kpi-additive" if isinstance(actual, str) else "kpi-ratio"
    plan = plan_cleaning(
        src, attrs, target_sql=masses.target, weight_sql=masses.reference, options=opts
    )
    kw: dict[str, Any] = {
        "cleaning": [
            {"column": s.column, "action": s.action, "detail": s.detail} for s in plan.steps
        ],
        "notes": list(src.notes),
    }
    if not plan.columns:
        msg = (
            "every attribute column was dropped by cleaning (see cleaning); name columns to "
            "keep with keep=[...]"
        )
        return Diagnosis([], mode, 0.0, 0.0, 0, (), message=msg, **kw)
    kpi = [actual] if isinstance(actual, str) else list(actual)
    kpi += [expected] if isinstance(expected, str) else list(expected)
    codes, values, k = _leaves(src, plan.exprs, kpi, opts.memory_limit)
    _release(src, opts.memory_limit)
    d = _from_arrays(codes, values, k, plan.columns, opts, grouped=True)
    d.cleaning, d.notes = kw["cleaning"], kw["notes"] + d.notes
    spent = time.perf_counter() - start - d.timings_s["search"]
    d.timings_s = {"prepare": round(spent, 4), **d.timings_s}
    return d


def kpi_leaves(
    codes: np.ndarray,
    cards: tuple[int, ...],
    actual: tuple[np.ndarray, ...],
    expected: tuple[np.ndarray, ...],
) -> KpiLeaves:
    """Leaves of an additive KPI (``actual=(v,)``) or a ratio KPI (``(num, den)`` pairs).

    A ratio leaf's value is num / den (0 without a denominator); its explanatory power is
    Adtributor's for derived measures: the change it alone would make to the overall ratio.
    """
    if len(actual) == 1:
        v, f = (np.asarray(x[0], dtype=np.float64) for x in (actual, expected))
        total = float(v.sum() - f.sum())
        ep = (v - f) / total if abs(total) > _TINY else np.zeros_like(v)
        return KpiLeaves(codes, cards, v, f, ep, 1.0 if total >= 0 else -1.0)
    an, ad = (np.asarray(x, dtype=np.float64) for x in actual)
    en, ed = (np.asarray(x, dtype=np.float64) for x in expected)
    v = np.divide(an, ad, out=np.zeros_like(an), where=ad != 0)
    f = np.divide(en, ed, out=np.zeros_like(en), where=ed != 0)
    fa, fb = float(en.sum()), float(ed.sum())
    num = (an - en) * fb - (ad - ed) * fa
    den = fb * (fb + ad - ed)
    ep = np.divide(num, den, out=np.zeros_like(num), where=np.abs(den) > _TINY)
    s = float(ep.sum())
    ep = ep / s if abs(s) > _TINY else np.zeros_like(ep)
    return KpiLeaves(codes, cards, v, f, ep, 1.0 if s >= 0 else -1.0, True)


def _from_arrays(
    codes: np.ndarray,
    values: list[list[str]],
    k: list[np.ndarray],
    columns: tuple[str, ...],
    opts: DiagnoseOptions,
    *,
    grouped: bool = False,
) -> Diagnosis:
    """Search the leaves (rows sharing every attribute value summed first, unless ``grouped``
    says no two rows do) and report."""
    start = time.perf_counter()
    cards = tuple(max(len(v), 1) for v in values)
    if not grouped:
        codes, k = _group(codes, cards, k)
    half = len(k) // 2
    leaves = kpi_leaves(codes, cards, tuple(k[:half]), tuple(k[half:]))
    found = search(leaves, SearchParams.from_options(opts))
    mode = "kpi-additive" if half == 1 else "kpi-ratio"
    notes = []
    if found.fallback:
        notes.append(
            "no element passed the risk bar (kpi_risk): the best-scoring one is shown, with "
            "its low confidence"
        )
    findings = _findings(found, leaves, k, columns, values)
    total_t, total_r = _masses(k, None)
    none = "nothing found: no leaf moved away from its forecast the way the total did"
    return Diagnosis(
        findings,
        mode,
        total_t,
        total_r,
        len(codes),
        columns,
        candidates=len(found.causes),
        covered=float(min(1.0, sum(max(c.ep, 0.0) for c in found.causes))),
        message="" if findings else none,
        confidence=found.confidence,
        notes=notes,
        timings_s={"search": round(time.perf_counter() - start, 4)},
    )


def _release(src: Source, memory_limit: str | None) -> None:
    """Make DuckDB hand its cached buffers back (its pool stays allocated up to its own
    ``memory_limit`` after the queries that filled it) by lowering and restoring the limit:
    the leaves are in NumPy now and the search reads nothing more from the source. Only on
    stalwart's own connection, whose limit it set."""
    if not src.owns_connection:
        return
    limit = duckdb_limit(memory_limit)
    src.sql(f"SET memory_limit = '{_RELEASE_LIMIT}'")
    src.sql(f"SET memory_limit = '{limit}'" if limit else "RESET memory_limit")  # a checked size


def _fits(n: int, width: int, memory_limit: str | None) -> bool:
    """Whether ``n`` leaves of ``width`` bytes of codes and KPI sums each fit the search."""
    size = parse_bytes(memory_limit)
    return size is None or _PROCESS_BYTES + n * (width + _LEAF_BYTES) <= size


def _check_budget(n: int, width: int, memory_limit: str | None) -> None:
    """Refuse, before the leaves reach NumPy, a search that would outgrow ``memory_limit`` (the
    whole process' budget): ``n`` leaves of ``width`` bytes of codes and KPI sums each."""
    need = _PROCESS_BYTES + n * (width + _LEAF_BYTES)
    if not _fits(n, width, memory_limit):
        raise ConfigError(
            f"localize's KPI search needs about {need / 1e9:.1f} GB for {n:,} leaves (distinct "
            f"combinations of the attributes), more than memory_limit={memory_limit!r}: raise "
            f"memory_limit to at least {-(-need // 10**8) / 10:.1f}GB, or localize over fewer "
            "or coarser attributes (fewer leaves)"
        )


def _leaves(
    src: Source, exprs: tuple[str, ...], kpi: list[str], memory_limit: str | None = None
) -> tuple[np.ndarray, list[list[str]], list[np.ndarray]]:
    """One row per cleaned leaf (rows sharing every cleaned attribute value, KPI columns
    summed): codes (the smallest unsigned type holding every attribute's), each attribute's
    values by code (in order of first appearance), and the KPI sums.

    When the source's rows themselves fit ``memory_limit`` as leaves would, they reach NumPy
    as they are and rows of one leaf are summed there (a cube whose rows are its leaves, like
    RiskLoc's, needs no grouping at all: 2.6x less CPU than DuckDB's GROUP BY over strings).
    Otherwise the leaves are grouped into a DuckDB temporary table (under its
    ``memory_limit``, spilling) and reach NumPy in batches, so no column of leaf strings is
    ever held outside DuckDB; a search too large for ``memory_limit`` is refused first
    (``ConfigError``).
    """
    sel = ", ".join(f"{e} AS a{i}" for i, e in enumerate(exprs))
    vals = [as_double(c) for c in kpi]
    rows = int(src.sql("SELECT count(*) FROM {src}").fetchall()[0][0])
    if not _fits(rows, len(exprs) + 8 * len(kpi), memory_limit):
        return _grouped_leaves(src, sel, len(exprs), vals, memory_limit)
    cols = ", ".join(f"{v} AS k{i}" for i, v in enumerate(vals))
    reader = src.sql(f"SELECT {sel}, {cols} FROM {{src}}").to_arrow_reader(_BATCH)
    codes, values, k = _encode(reader, rows, len(exprs), len(kpi), np.dtype(np.uint8))
    codes, k = _group(codes, tuple(max(len(v), 1) for v in values), k)
    return codes, values, k


def _grouped_leaves(
    src: Source, sel: str, width: int, vals: list[str], memory_limit: str | None
) -> tuple[np.ndarray, list[list[str]], list[np.ndarray]]:
    """``_leaves`` through a DuckDB GROUP BY into a temporary table."""
    sums = ", ".join(f"sum({v}) AS k{i}" for i, v in enumerate(vals))
    name = f"stalwart_kpi_leaves_{uuid.uuid4().hex}"
    src.sql(f"CREATE TEMP TABLE {name} AS SELECT {sel}, {sums} FROM {{src}} GROUP BY ALL")
    try:
        distinct = ", ".join(f"count(DISTINCT a{i})" for i in range(width))
        n, *cards = src.sql(f"SELECT count(*), {distinct} FROM {name}").fetchall()[0]
        dtype = np.min_scalar_type(max(max(cards) - 1, 0))
        _check_budget(n, width * dtype.itemsize + 8 * len(vals), memory_limit)
        reader = src.sql(f"SELECT * FROM {name}").to_arrow_reader(_BATCH)
        return _encode(reader, n, width, len(vals), dtype)
    finally:
        src.sql(f"DROP TABLE IF EXISTS {name}")


def _encode(
    reader: Any, n: int, width: int, n_kpi: int, dtype: np.dtype
) -> tuple[np.ndarray, list[list[str]], list[np.ndarray]]:
    """At most ``n`` rows of ``width`` attribute columns then ``n_kpi`` KPI columns, batch by
    batch: attribute values as codes in order of first appearance (the code type widened if
    a column outgrows it), KPI columns as float64."""
    codes = np.empty((n, width), dtype=dtype)
    k = [np.empty(n, dtype=np.float64) for _ in range(n_kpi)]
    index: list[dict[str, int]] = [{} for _ in range(width)]
    pos = 0
    for batch in reader:
        end = pos + batch.num_rows
        for i, seen in enumerate(index):
            enc = pc.dictionary_encode(batch.column(i))
            lut = np.array(
                [seen.setdefault(str(v), len(seen)) for v in enc.dictionary.to_pylist()],
                dtype=np.int64,
            )
            if len(seen) - 1 > np.iinfo(codes.dtype).max:
                codes = codes.astype(np.min_scalar_type(len(seen) - 1))
            codes[pos:end, i] = lut[enc.indices.to_numpy(zero_copy_only=False)]
        for j, out in enumerate(k):
            out[pos:end] = batch.column(width + j).to_numpy(zero_copy_only=False)
        pos = end
    return codes[:pos], [list(seen) for seen in index], [x[:pos] for x in k]


def _group(
    codes: np.ndarray, cards: tuple[int, ...], k: list[np.ndarray]
) -> tuple[np.ndarray, list[np.ndarray]]:
    """One row per distinct code tuple (the first's codes), its KPI columns summed; rows
    already distinct come back as they are (checked by counting cells when the cube is
    small enough, without sorting)."""
    if cards:
        key = cell_ids(codes, tuple(range(len(cards))), cards)
    else:
        key = np.zeros(len(codes), dtype=np.int64)
    size = int(np.prod(cards, dtype=np.float64))
    if size <= 4 * len(codes) + 1024 and np.bincount(key, minlength=size).max(initial=0) <= 1:
        return codes, k
    uniq, first, inv = np.unique(key, return_index=True, return_inverse=True)
    if len(uniq) < len(codes):
        codes = codes[first]
        k = [np.bincount(inv.ravel(), weights=x, minlength=len(uniq)) for x in k]
    return codes, k


def _masses(k: list[np.ndarray], mask: np.ndarray | None) -> tuple[float, float]:
    """(deviation, reference) masses of the leaves in ``mask``: |actual - forecast| and the
    forecast for an additive KPI; for a ratio, the numerator lost or gained against the
    forecast ratio, and the actual denominator."""
    s = [float((x if mask is None else x[mask]).sum()) for x in k]
    if len(s) == 2:
        return abs(s[0] - s[1]), s[1]
    an, ad, en, ed = s
    ratio = en / ed if ed else 0.0
    return abs(an - ad * ratio), ad


def _findings(
    found: Localized,
    leaves: KpiLeaves,
    k: list[np.ndarray],
    columns: tuple[str, ...],
    values: list[list[str]],
) -> list[Finding]:
    total_t, total_r = _masses(k, None)
    base = total_t / total_r if total_r > 0 else 0.0
    out = []
    for c in found.causes:
        mask = np.ones(len(leaves.codes), dtype=bool)
        for col, v in c.items:
            mask &= leaves.codes[:, col] == v
        t, r = _masses(k, mask)
        lift = (t / r) / base if r > 0 and base > 0 else 0.0
        out.append(
            Finding(
                items={columns[col]: values[col][v] for col, v in c.items},
                failures=t,
                rows=r,
                support=t / total_t if total_t > 0 else 0.0,
                lift=lift,
                lift_low=lift,
                lift_high=lift,
                explained=c.ep,
                confidence=c.confidence,
            )
        )
    return out


def localize_frame(
    data: Any,
    actual: str | tuple[str, str],
    expected: str | tuple[str, str],
    columns: Sequence[str] | None,
    opts: DiagnoseOptions,
) -> Diagnosis | None:
    """``localize`` on a pandas DataFrame of plain text attributes without DuckDB, when the
    cleaning would change nothing (no nulls, 2 to ``max_values`` distinct values per column,
    no ``exclude``/``keep``/``hierarchies``); ``None`` for the general path."""
    if type(data).__module__.split(".")[0] != "pandas" or not hasattr(data, "columns"):
        return None
    import pandas  # the caller's own data is a pandas frame

    kpi = [actual] if isinstance(actual, str) else list(actual)
    kpi += [expected] if isinstance(expected, str) else list(expected)
    names = [str(c) for c in data.columns]
    attrs = list(columns) if columns else [c for c in names if c not in kpi]
    if opts.exclude or opts.keep or opts.hierarchies or len(set(names)) != len(names):
        return None
    if not attrs or not set(attrs + kpi) <= set(names) or set(attrs) & set(kpi):
        return None
    limit = min(opts.max_values, opts.id_min_distinct)
    codes = np.empty((len(data), len(attrs)), dtype=np.int64)
    values: list[list[str]] = []
    for i, c in enumerate(attrs):
        col = data[c]
        text = pandas.api.types.is_string_dtype(col) or isinstance(
            col.dtype, pandas.CategoricalDtype
        )
        if not text or col.isna().any():
            return None
        code, uniq = pandas.factorize(col)
        if not 2 <= len(uniq) <= limit or not all(isinstance(v, str) for v in uniq):
            return None
        codes[:, i], values = code, [*values, list(uniq)]
    try:
        k = [np.nan_to_num(np.asarray(data[c], dtype=np.float64)) for c in kpi]
    except (TypeError, ValueError):
        return None  # the general path says which column is wrong
    return _from_arrays(codes, values, k, tuple(attrs), opts)
