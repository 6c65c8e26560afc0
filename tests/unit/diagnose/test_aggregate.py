"""Counting over the aggregate: the in-memory path (coded rows, unit rows as bitsets) and the
grouped path (DuckDB GROUP BY, streamed or cached) give the same masses, with and without a
mask, for plain and for weighted rows."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest

from stalwart.diagnose import DiagnoseOptions, Diagnosis, analyze, rowcache
from stalwart.diagnose.aggregate import ItemCounter, aggregate, in_memory_budget
from stalwart.diagnose.clean import plan_cleaning
from stalwart.diagnose.options import EngineTuning
from stalwart.diagnose.source import open_source
from stalwart.diagnose.synth import make_failure_log
from stalwart.diagnose.target import event_masses

pytestmark = pytest.mark.timeout(120)


def _weighted_table() -> pa.Table:
    log = make_failure_log(6_000, columns=6, causes=1, depth=2, seed=11, coverage=(0.02, 0.1))
    rng = np.random.default_rng(0)
    # a third of the rows stand for several events: they are counted outside the bitsets
    n = np.where(rng.random(log.table.num_rows) < 0.3, rng.integers(2, 6, log.table.num_rows), 1)
    return log.table.drop_columns(["host_id"]).append_column("n", pa.array(n.astype(np.int64)))


@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize("weight", [None, "n"])
def test_in_memory_and_out_of_core_counts_agree(weight: str | None, narrow: bool) -> None:
    table = _weighted_table()
    with open_source(table) as src:
        masses = event_masses(src, "failed", weight)
        attrs = [c for c in src.columns if c not in masses.used and c != "n"]
        plan = plan_cleaning(
            src,
            attrs,
            target_sql=masses.target,
            weight_sql=masses.reference,
            options=DiagnoseOptions(),
        )
        values = {
            c: [
                str(v)
                for (v,) in src.sql(
                    f"SELECT DISTINCT {e} AS v FROM {{src}} ORDER BY v LIMIT 3"
                ).fetchall()
            ]
            for c, e in enumerate(plan.exprs)
        }
        if narrow:  # few distinct coded rows: out of core they are grouped
            values = {0: values[0][:1], 1: values[1][:1]}
        kw = {"target_sql": masses.target, "reference_sql": masses.reference}
        held = aggregate(src, plan, values, **kw)
        grouped = aggregate(src, plan, values, in_memory_bytes=0, **kw)
        assert held.arrays is not None and grouped.arrays is None
        assert held.groups == table.num_rows
        assert grouped.groups <= (4 if narrow else table.num_rows)
        assert held.total_reference == pytest.approx(grouped.total_reference)
        items = [(c, v) for c, vs in values.items() for v in vs]
        sets = [
            tuple(s)
            for k in (1, 2, 3)
            for s in itertools.combinations(items, k)
            if len({c for c, _ in s}) == k
        ][:400]
        counters = [ItemCounter(held), ItemCounter(grouped), ItemCounter(grouped, cache_bytes=0)]
        for counter in counters:
            counter.prepare()
        want_t, want_r = counters[-1].count(sets)
        assert want_r.sum() > 0
        for counter in counters[:2]:
            t, r = counter.count(sets)
            np.testing.assert_allclose(t, want_t)
            np.testing.assert_allclose(r, want_r)
        # a mask (aligned with each aggregate's own scan order) restricts the counts alike
        probe = sets[0]
        outside = [c.count(sets[:50], mask=~c.match(probe)) for c in (counters[0], counters[-1])]
        np.testing.assert_allclose(outside[0][0], outside[1][0])
        np.testing.assert_allclose(outside[0][1], outside[1][1])


def test_findings_do_not_depend_on_the_in_memory_budget() -> None:
    # under a small memory limit the coded rows go through a DuckDB temporary table
    log = make_failure_log(60_000, columns=10, causes=2, depth=(1, 2), seed=4)
    held = analyze(log.table, "failed", options=DiagnoseOptions(example_rows=0))
    grouped = analyze(
        log.table, "failed", options=DiagnoseOptions(example_rows=0, memory_limit="8MB")
    )
    assert held.groups == grouped.groups == 60_000
    assert len(held.findings) == 2
    assert [f.items for f in held.findings] == [f.items for f in grouped.findings]
    assert [f.rows for f in held.findings] == [f.rows for f in grouped.findings]


def _findings(d: Diagnosis) -> list[tuple[object, ...]]:
    return [
        (f.items, f.failures, f.rows, f.support, f.lift, f.lift_low, f.confidence, f.explained)
        for f in d.findings
    ]


@pytest.mark.parametrize("weighted", [False, True])
def test_out_of_core_run_equals_the_in_memory_run(weighted: bool) -> None:
    # 200k rows under a tiny memory_limit: the coded rows go to the row cache on disk, in
    # chunks of 30k (weighted: plain and weighted chunks mixed), grouped or not by their number
    log = make_failure_log(200_000, columns=12, causes=3, depth=(1, 2, 3), seed=9)
    table = log.table
    if weighted:  # the second half of the rows stand for 1-3 events each
        n = np.ones(table.num_rows, dtype=np.int64)
        n[100_000:] = np.random.default_rng(1).integers(1, 4, 100_000)
        table = table.append_column("n", pa.array(n))
    weight = "n" if weighted else None
    opts = DiagnoseOptions(example_rows=0)
    held = analyze(table, "failed", weight=weight, options=opts)
    small = replace(opts, memory_limit="16MB", tuning=EngineTuning(batch_rows=30_000))
    assert in_memory_budget("16MB") < 200_000 * 24
    ooc = analyze(table, "failed", weight=weight, options=small)
    assert len(held.findings) == 3
    assert _findings(ooc) == _findings(held)
    assert ooc.covered == held.covered  # (candidates differ: only in memory is a sample drawn)


def test_streamed_sample_is_drawn_by_mass() -> None:
    # the row cache draws ItemCounter's sample while it writes, chunk by chunk: a weighted
    # item's share of the sample estimates its share of the mass, and the bound holds
    table = make_failure_log(150_000, columns=4, causes=1, seed=5).table.drop_columns(["host_id"])
    # past the first 50k rows (plain chunks), rows of c00v0 weigh 3: its share of the mass is
    # not its share of the rows
    heavy = (table.column("c00").to_numpy(zero_copy_only=False) == "c00v0") & (
        np.arange(table.num_rows) >= 50_000
    )
    n = np.where(heavy, 3, 1)
    table = table.append_column("n", pa.array(n))
    # chunks of 20k rows, kept as rows, not grouped
    tuning = EngineTuning(batch_rows=20_000, group_gain=10**9)
    with open_source(table) as src:
        masses = event_masses(src, "failed", "n")
        plan = plan_cleaning(
            src,
            ["c00", "c01"],
            target_sql=masses.target,
            weight_sql=masses.reference,
            options=DiagnoseOptions(),
        )
        values = {0: ["c00v0", "c00v1"], 1: ["c01v0", "c01v2"]}
        kw = {"target_sql": masses.target, "reference_sql": masses.reference}
        agg = aggregate(src, plan, values, in_memory_bytes=0, tuning=tuning, **kw)
        counter = ItemCounter(agg, cache_bytes=0)
        counter.prepare()
        sets = [((0, "c00v0"),), ((0, "c00v1"),), ((0, "c00v0"), (1, "c01v2"))]
        _, exact = counter.count(sets, target=False)
        assert (counter.rows_lower_bound(sets, 6.0) <= exact).all()
        est = counter.rows_lower_bound(sets, 0.0)
        share = exact / agg.total_reference
        sigma = np.sqrt(share * (1 - share) / rowcache.SAMPLE_ROWS) * agg.total_reference
        assert (np.abs(est - exact) < 5 * sigma).all()


@pytest.mark.parametrize("collide", [False, True])
def test_group_rows_sums_each_distinct_row(collide: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 3, (5000, 4)).astype(np.int32)
    t = rng.integers(1, 5, 5000).astype(np.float64)
    if collide:  # every row hashes alike: grouped by the rows themselves
        monkeypatch.setattr(rowcache, "row_hash", lambda cols, n: np.zeros(n, np.uint64))
    got, sums = rowcache.group_rows(codes, t)
    want, inverse = np.unique(codes, axis=0, return_inverse=True)
    order = np.lexsort(got.T[::-1])
    np.testing.assert_array_equal(got[order], want)
    np.testing.assert_array_equal(sums[order], np.bincount(inverse.ravel(), weights=t))


def test_in_memory_budget_follows_the_memory_limit() -> None:
    assert in_memory_budget(None) == 1 << 30
    assert in_memory_budget("4GB") == 500_000_000
    assert in_memory_budget("512MiB") == 64 << 20
    assert in_memory_budget("100 mb") == 12_500_000
    assert in_memory_budget("not a size") == 1 << 30
