"""The two entry points, ``analyze`` (labelled events) and ``localize`` (KPI deviation), and the
pipeline they share: open, clean, pre-aggregate, mine, count, prune, select, report.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import duckdb

from stalwart.diagnose.aggregate import (
    ItemCounter,
    Itemset,
    aggregate,
    failure_groups,
    in_memory_budget,
)
from stalwart.diagnose.clean import CleanPlan, plan_cleaning
from stalwart.diagnose.kpi_localize import localize_frame, localize_kpi
from stalwart.diagnose.mining import (
    closure_fn,
    coded_values,
    frequent_items,
    mine_groups,
    support_floor,
)
from stalwart.diagnose.options import DiagnoseOptions
from stalwart.diagnose.result import Diagnosis, Finding, Neighbour
from stalwart.diagnose.score import (
    Scored,
    Tester,
    finding_confidence,
    overall_confidence,
    prune,
    select,
    wilson,
)
from stalwart.diagnose.source import Source, open_source, suggest
from stalwart.diagnose.target import Masses, event_masses, kpi_masses
from stalwart.errors import ConfigError

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["ReadOptions", "analyze", "localize"]

log = logging.getLogger(__name__)

_SAMPLE_Z = 6.0  # the sample's bound fails with probability ~1e-9 per item-set


class ReadOptions(TypedDict, total=False):
    """How ``analyze`` and ``localize`` read ``data``: keyword arguments of both."""

    connection: duckdb.DuckDBPyConnection | None
    """A DuckDB connection to run a SQL ``data`` on (it sees your tables)."""
    skip_bad_lines: bool
    """Drop malformed CSV and JSON lines (and report how many) instead of failing."""
    storage_options: dict[str, Any] | None
    """Options of a URL's fsspec filesystem (for s3fs: ``key``, ``secret``,
    ``client_kwargs={"endpoint_url": ...}``); the filesystem's environment otherwise."""


def analyze(
    data: Any,
    label: str,
    *,
    weight: str | None = None,
    columns: Sequence[str] | None = None,
    options: DiagnoseOptions | None = None,
    **reading: Unpack[ReadOptions],
) -> Diagnosis:
    """Find the combinations of attribute values that single out failing events.

    Args:
        data: a CSV, Parquet or JSON lines (``.jsonl``/``.ndjson``) path or glob, local or a
            URL (``s3://bucket/logs/*.parquet``), a SQL query, a DuckDB relation, a pandas or
            polars DataFrame, a polars LazyFrame (streamed, never collected), or an Arrow
            table; one row per event (or per group, with ``weight``).
        label: the failure label: a column (boolean, 0/1, or text such as ``fail``/``ok``) or a
            SQL condition such as ``"status != 'ok'"``.
        weight: a column counting the events each row stands for (pre-aggregated input).
        columns: the attribute columns; all others but the label and weight when omitted.
        options: cleaning, mining and selection settings (``DiagnoseOptions()`` when omitted;
            ``dataclasses.replace(opts, min_lift=2)`` changes one field).
        **reading: how to read ``data``: ``connection``, ``skip_bad_lines``,
            ``storage_options`` (``ReadOptions``).

    Returns:
        A ``Diagnosis`` whose ``findings`` are empty, with ``message`` saying why, when there
        are no failures, only failures, or nothing that singles them out.

    Raises:
        ConfigError: unreadable input, a missing column (with the closest names), bad options.
    """
    opts = options or DiagnoseOptions()
    with _open(data, opts, _checked(reading)) as src:
        masses = event_masses(src, label, weight)
        return _run(src, masses, columns, opts)


def localize(
    data: Any,
    actual: str | tuple[str, str],
    expected: str | tuple[str, str],
    *,
    columns: Sequence[str] | None = None,
    options: DiagnoseOptions | None = None,
    **reading: Unpack[ReadOptions],
) -> Diagnosis:
    """Find the combinations of attribute values that explain a KPI's deviation from forecast.

    One row per leaf (a full combination of attribute values; rows that share them are summed)
    with its actual and expected value: single columns for an additive KPI (counts, revenue),
    or (numerator, denominator) pairs for a ratio KPI (success rate = successes / requests).
    The search (``kpi_search``, set by the ``kpi_*`` options) finds causes of any depth, several
    at once, and answers with a ``confidence`` whenever the total deviates. A pandas frame of
    plain text attributes skips DuckDB. See ``analyze`` for the other arguments.
    """
    opts, reading = options or DiagnoseOptions(), _checked(reading)
    if (d := localize_frame(data, actual, expected, columns, opts)) is not None:
        return d
    with _open(data, opts, reading) as src:
        masses = kpi_masses(src, actual, expected)
        attrs = _attributes(src, masses, columns, opts)
        return localize_kpi(src, actual, expected, attrs, masses, opts)


def _attributes(
    src: Source, masses: Masses, columns: Sequence[str] | None, opts: DiagnoseOptions
) -> list[str]:
    for name in [
        *(columns or ()),
        *opts.exclude,
        *opts.keep,
        *(c for h in opts.hierarchies for c in h),
    ]:
        if name not in src.columns:
            raise ConfigError(f"no column {name!r}.{suggest(name, src.columns)}")
    pool = list(columns) if columns else [c for c in src.columns if c not in masses.used]
    attrs = [c for c in pool if c not in opts.exclude and c not in masses.used]
    if not attrs:
        raise ConfigError(
            "no attribute columns to analyse: the input holds only the label/KPI columns "
            f"({', '.join(src.columns)})"
        )
    return attrs


def _nothing(plan: CleanPlan | None, message: str, **kw: Any) -> Diagnosis:
    return Diagnosis(
        [],
        "events",
        plan.total_target if plan else 0.0,
        plan.total_reference if plan else 0.0,
        0,
        plan.columns if plan else (),
        message=message,
        **kw,
    )


def _run(
    src: Source, masses: Masses, columns: Sequence[str] | None, opts: DiagnoseOptions
) -> Diagnosis:
    clock = time.perf_counter()
    timings: dict[str, float] = {}

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = round(now - clock, 4)
        clock = now

    attrs = _attributes(src, masses, columns, opts)
    plan = plan_cleaning(
        src, attrs, target_sql=masses.target, weight_sql=masses.reference, options=opts
    )
    cleaning = [{"column": s.column, "action": s.action, "detail": s.detail} for s in plan.steps]
    notes = list(src.notes)
    lap("clean")
    if not plan.columns:
        return _nothing(
            None,
            "every attribute column was dropped by cleaning (see "
            "cleaning); name columns to keep with keep=[...]",
            cleaning=cleaning,
            notes=notes,
            timings_s=timings,
        )
    kw: dict[str, Any] = {"cleaning": cleaning, "notes": notes, "timings_s": timings}
    total_t, total_r = plan.total_target, plan.total_reference
    if total_t <= 0:
        return _nothing(plan, "no failures: there is nothing to explain", **kw)
    if total_t >= total_r:
        return _nothing(
            plan,
            "every row is a failure: there is nothing to contrast the failures with",
            **kw,
        )
    base, budget = total_t / total_r, in_memory_budget(opts.memory_limit)
    fails = failure_groups(src, plan, target_sql=masses.target, tuning=opts.tuning)
    codes, values = fails.codes, fails.values
    lap("aggregate failures")
    min_weight = support_floor(total_t, opts.min_support)  # exactly at the share is in
    keepers = frequent_items(codes, fails.target, min_weight)
    mined = mine_groups(codes, fails.target, keepers, min_weight, opts, plan.columns)
    lap("mine")
    # the values a finding can hold are the frequent single items (measured: writing the coded
    # rows in a thread while NumPy mines was slower on a loaded 2-core machine)
    sql = {"target_sql": masses.target, "reference_sql": masses.reference}
    kept = coded_values(keepers, values)
    agg = aggregate(src, plan, kept, in_memory_bytes=budget, tuning=opts.tuning, **sql)
    lap("aggregate")
    closure = closure_fn(codes, values, plan.columns, opts.hierarchies)
    itemsets: dict[Itemset, float] = {
        tuple((c, values[c][v]) for c, v in s): w for s, w in mined.items()
    }
    counter = ItemCounter(agg, cache_bytes=budget)
    counter.prepare()
    scored = _count_levels(itemsets, counter, total_r, base, opts)
    lap("count")
    tester = Tester.make(opts, len(scored), counts=masses.counts)
    survivors = prune(list(scored.values()), base, tester, opts, closure)
    chosen, covered = select(
        survivors,
        total_failures=total_t,
        total_rows=total_r,
        recount=lambda sets, mask: counter.count(sets, mask=mask),
        match=counter.match,
        tester=tester,
        options=opts,
        closure=closure,
        everything=scored,
    )
    lap("select")
    z = _z(opts.confidence)
    findings = []
    for sel in chosen:
        sc = sel.scored
        lo, hi = wilson(sc.failures, sc.rows, z) if masses.counts else (sc.rate, sc.rate)
        findings.append(
            Finding(
                items={plan.columns[c]: v for c, v in sc.items},
                failures=_round(sc.failures),
                rows=_round(sc.rows),
                support=sc.failures / total_t,
                lift=sc.rate / base,
                lift_low=min(lo, sc.rate) / base,  # rounding put a 42-of-42 rate past its
                lift_high=max(hi, sc.rate) / base,  # bound: the interval holds the estimate
                explained=sel.attributable / total_t,
                confidence=finding_confidence(1.0 - base / lo if lo > 0 else 0.0),
                subsumed=tuple(_neighbours(sc, scored, plan.columns, base)),
                examples=tuple(fails.examples(sc.items, opts.example_rows))
                if opts.example_rows
                else (),
            )
        )
    lap("report")
    message = (
        ""
        if findings
        else (
            f"nothing found: no combination of attribute values singles out the failures "
            f"(min_support={opts.min_support}, min_lift={opts.min_lift}, alpha={opts.alpha})"
        )
    )
    return Diagnosis(
        findings,
        "events",
        total_t,
        total_r,
        agg.groups,
        plan.columns,
        candidates=len(scored),
        covered=covered,
        message=message,
        confidence=overall_confidence(
            [f.explained for f in findings], [f.confidence for f in findings]
        ),
        **kw,
    )


def _z(confidence: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(0.5 + confidence / 2)


def _round(x: float) -> float:
    return float(round(x)) if abs(x - round(x)) < 1e-9 else x


def _neighbours(
    s: Scored, scored: dict[Itemset, Scored], names: tuple[str, ...], base: float
) -> list[Neighbour]:
    out = []
    for items, reason in s.subsumed[:20]:
        o = scored[items]
        out.append(
            Neighbour(
                {names[c]: v for c, v in items},
                _round(o.failures),
                _round(o.rows),
                o.rate / base,
                reason,
            )
        )
    return out


def _count_levels(
    itemsets: dict[Itemset, float],
    counter: ItemCounter,
    total: float,
    base: float,
    opts: DiagnoseOptions,
) -> dict[Itemset, Scored]:
    """Count reference masses level by level, skipping item-sets whose Bonferroni lower bound
    n(X) >= n(X - i) + n(i) - N already caps their lift below ``min_lift``."""
    scored: dict[Itemset, Scored] = {}
    bound: dict[Itemset, float] = {}
    for k in range(1, opts.max_len + 1):
        level = [s for s in itemsets if len(s) == k]
        todo = []
        for s in level:
            f = itemsets[s]
            lb = f
            if k > 1:
                for i in range(k):
                    rest, one = s[:i] + s[i + 1 :], (s[i],)
                    n_rest = scored[rest].rows if rest in scored else bound.get(rest, 0.0)
                    n_one = scored[one].rows if one in scored else bound.get(one, 0.0)
                    lb = max(lb, n_rest + n_one - total)
            bound[s] = lb
            if lb > 0 and f / lb < opts.min_lift * base:
                continue
            todo.append(s)
        # A sample bounds n(X) from below with high confidence; item-sets whose lift cannot
        # reach min_lift are skipped before the exact count.
        low = counter.rows_lower_bound(todo, _SAMPLE_Z)
        exact = []
        for s, lb in zip(todo, low.tolist(), strict=False):
            bound[s] = max(bound[s], lb)
            if not (lb > 0 and itemsets[s] / lb < opts.min_lift * base):
                exact.append(s)
        _, rows = counter.count(exact, target=False)
        for s, r in zip(exact, rows.tolist(), strict=False):
            scored[s] = Scored(s, itemsets[s], r)
    return scored


def _checked(reading: ReadOptions) -> ReadOptions:
    """``reading`` when it holds only ``ReadOptions``' keys; else Python's ``TypeError`` naming
    the unknown ones, as for any misspelt keyword argument."""
    unknown = sorted(set(reading) - set(ReadOptions.__annotations__))
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {', '.join(unknown)}: the input is read with "
            f"{', '.join(ReadOptions.__annotations__)}; options go in DiagnoseOptions"
        )
    return reading


def _open(data: Any, opts: DiagnoseOptions, reading: ReadOptions) -> Any:
    """The input as a DuckDB source, read as ``reading`` says, with the engine settings of
    ``opts``."""
    return open_source(
        data,
        memory_limit=opts.memory_limit,
        temp_directory=opts.temp_directory,
        threads=opts.threads,
        **reading,
    )
