"""localize()'s KPI search on generated leaves: deep causes (every attribute), several causes at
once, ratio KPIs, an answer with a confidence whenever the data hold an anomaly."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pytest

from stalwart.diagnose import DiagnoseOptions, localize
from stalwart.diagnose.kpi_localize import _leaves, kpi_leaves
from stalwart.diagnose.kpi_search import SearchParams, search
from stalwart.diagnose.options import EngineTuning
from stalwart.diagnose.source import open_source
from stalwart.errors import ConfigError

DIMS = {"a": 6, "b": 5, "c": 4, "d": 3}


def _cube(seed: int, noise: float = 0.05) -> tuple[dict[str, list[str]], np.ndarray, np.ndarray]:
    """Every combination of DIMS' values, a skewed forecast and an actual off by noise."""
    rng = np.random.default_rng(seed)
    grid = list(itertools.product(*(range(n) for n in DIMS.values())))
    cols = {k: [f"{k}{row[i]}" for row in grid] for i, k in enumerate(DIMS)}
    forecast = rng.weibull(0.8, len(grid)) * 100 + 1.0
    actual = forecast * (1 + rng.normal(0, noise, len(grid)))
    return cols, forecast, actual


def _hit(cols: dict[str, list[str]], **items: str) -> np.ndarray:
    return np.logical_and.reduce([np.array(cols[k]) == v for k, v in items.items()])


def _found(d: object) -> set[tuple[tuple[str, str], ...]]:
    return {tuple(sorted(f.items.items())) for f in d.findings}  # type: ignore[attr-defined]


def _table(cols: dict[str, list[str]], actual: np.ndarray, forecast: np.ndarray) -> pa.Table:
    return pa.table({**cols, "actual": actual, "forecast": forecast})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_cause_spanning_every_attribute_is_found(seed: int) -> None:
    cols, forecast, actual = _cube(seed)
    leaf = {"a": "a2", "b": "b3", "c": "c1", "d": "d0"}
    actual[_hit(cols, **leaf)] = forecast[_hit(cols, **leaf)] * 0.1
    d = localize(_table(cols, actual, forecast), "actual", "forecast")
    assert _found(d) == {tuple(sorted(leaf.items()))}
    assert d.mode == "kpi-additive"


@pytest.mark.parametrize("seed", [3, 4])
def test_several_causes_at_different_depths(seed: int) -> None:
    cols, forecast, actual = _cube(seed)
    for items in ({"a": "a1"}, {"b": "b2", "c": "c3"}):
        hit = _hit(cols, **items)
        actual[hit] = forecast[hit] * 0.4
    d = localize(_table(cols, actual, forecast), "actual", "forecast")
    assert _found(d) == {(("a", "a1"),), (("b", "b2"), ("c", "c3"))}
    assert 0.5 <= d.confidence <= 1.0
    assert all(0.5 <= f.confidence <= 1.0 for f in d.findings)
    assert sum(f.explained for f in d.findings) > 0.8


def test_a_rise_is_localized_as_well_as_a_drop() -> None:
    cols, forecast, actual = _cube(5)
    hit = _hit(cols, c="c2")
    actual[hit] = forecast[hit] * 1.8
    d = localize(_table(cols, actual, forecast), "actual", "forecast")
    assert _found(d) == {(("c", "c2"),)}


def test_ratio_kpi_with_a_deep_and_a_shallow_cause() -> None:
    cols, requests, _ = _cube(6)
    requests = np.round(requests * 50) + 100
    rng = np.random.default_rng(6)
    rate = np.clip(0.97 + rng.normal(0, 0.005, len(requests)), 0, 1)
    for items, bad in (({"d": "d1"}, 0.6), ({"a": "a0", "b": "b1", "c": "c2"}, 0.3)):
        rate[_hit(cols, **items)] = bad
    t = pa.table(
        {
            **cols,
            "ok": np.round(requests * rate),
            "req": requests,
            "ok_fc": requests * 0.97,
            "req_fc": requests,
        }
    )
    d = localize(t, ("ok", "req"), ("ok_fc", "req_fc"))
    assert _found(d) == {(("d", "d1"),), (("a", "a0"), ("b", "b1"), ("c", "c2"))}
    assert d.mode == "kpi-ratio"


@pytest.mark.parametrize("seed", range(4))
def test_an_anomalous_input_always_gets_an_answer_with_a_confidence(seed: int) -> None:
    # A faint cause, well inside the noise: the search may not be sure, but it answers.
    cols, forecast, actual = _cube(seed, noise=0.2)
    hit = _hit(cols, b="b4")
    actual[hit] = forecast[hit] * 0.9
    d = localize(_table(cols, actual, forecast), "actual", "forecast")
    assert d.findings, d.message
    assert 0.0 <= d.confidence <= 1.0
    assert all(0.0 <= f.confidence <= 1.0 for f in d.findings)


@pytest.mark.parametrize("seed", [2, 6])
def test_a_broad_cause_whose_leaves_stay_inside_heavy_noise_is_found(seed: int) -> None:
    # Noise of 30%: the cause's leaves (down 40%) mostly lie inside the noise extremes; the
    # balance of its many leaves moved one way still marks it (balance_leaves).
    cols, forecast, actual = _cube(seed, noise=0.3)
    hit = _hit(cols, a="a3")
    actual[hit] = forecast[hit] * 0.6
    d = localize(_table(cols, actual, forecast), "actual", "forecast")
    assert (("a", "a3"),) in _found(d)


def test_no_deviation_means_no_finding_and_says_why() -> None:
    cols, forecast, _ = _cube(7)
    d = localize(_table(cols, forecast.copy(), forecast), "actual", "forecast")
    assert d.findings == [] and "nothing found" in d.message and d.confidence == 0.0


def test_max_depth_and_max_findings_bound_the_search() -> None:
    cols, forecast, actual = _cube(8)
    leaf = {"a": "a4", "b": "b0", "c": "c3", "d": "d2"}
    actual[_hit(cols, **leaf)] = 0.0
    for c in ("a1", "a3"):
        actual[_hit(cols, a=c)] *= 0.5
    shallow = localize(
        _table(cols, actual, forecast),
        "actual",
        "forecast",
        options=DiagnoseOptions(kpi_max_depth=2, max_findings=1),
    )
    assert len(shallow.findings) == 1 and len(shallow.findings[0].items) <= 2


def test_search_on_arrays_marks_a_fallback_with_low_confidence() -> None:
    # Four leaves, one moved a little against three still ones: nothing passes a strict bar.
    codes = np.array([[0, 0], [0, 1], [1, 0], [1, 1]])
    real, forecast = np.array([10.0, 10.0, 10.0, 9.0]), np.full(4, 10.0)
    leaves = kpi_leaves(codes, (2, 2), (real,), (forecast,))
    got = search(leaves, SearchParams(risk=1.0))
    assert got.fallback and len(got.causes) == 1 and got.confidence < 1.0
    assert search(leaves).causes[0].items == ((0, 1), (1, 1))


def _deep_and_broad(seed: int) -> tuple[np.ndarray, tuple[int, ...], np.ndarray, np.ndarray]:
    """A 12x10x8x6 cube with two broad causes (a=0, a=1 down 90%), a small deep one (b=3&c=5&d=2,
    12 leaves down 50%, well under 2% of the deviation) and a single leaf down 60%."""
    cards = (12, 10, 8, 6)
    codes = np.array(list(itertools.product(*(range(n) for n in cards))))
    rng = np.random.default_rng(seed)
    forecast = rng.weibull(0.8, len(codes)) * 100 + 1.0
    actual = forecast * (1 + rng.normal(0, 0.02, len(codes)))
    for hit, keep in (
        (codes[:, 0] <= 1, 0.1),
        ((codes[:, 1] == 3) & (codes[:, 2] == 5) & (codes[:, 3] == 2), 0.5),
        ((codes == [7, 7, 7, 4]).all(axis=1), 0.4),
    ):
        actual[hit] = forecast[hit] * keep
    return codes, cards, actual, forecast


@pytest.mark.parametrize("seed", [0, 1])
def test_small_deep_causes_under_broad_ones_are_found_by_the_second_stage(seed: int) -> None:
    codes, cards, actual, forecast = _deep_and_broad(seed)
    leaves = kpi_leaves(codes, cards, (actual,), (forecast,))
    want = {((0, 0),), ((0, 1),), ((1, 3), (2, 5), (3, 2)), ((0, 7), (1, 7), (2, 7), (3, 4))}
    got = search(leaves)
    assert {c.items for c in got.causes} == want
    assert max(c.ep for c in got.causes if len(c.items) > 1) < 0.02
    # Without the second stage only the broad causes pass the explanatory-power floor.
    first = search(leaves, SearchParams(scan_nats=float("inf")))
    assert {c.items for c in first.causes} == {((0, 0),), ((0, 1),)}


@pytest.mark.parametrize("seed", [0, 1])
def test_cuboid_sums_kept_recounted_or_from_the_dense_cube_agree(seed: int) -> None:
    """The three ways ElementSums counts (cuboids kept for the whole search, recounted every
    round, or every cuboid of a layer summed from the full cube's cells, as H-sized cubes
    are) find the same causes with the same scores, on a cube with broad, deep and single-leaf
    causes where both stages and several removal rounds run."""
    codes, cards, actual, forecast = _deep_and_broad(seed)
    order = np.random.default_rng(seed).permutation(len(codes))  # leaves in any order
    leaves = kpi_leaves(codes[order], cards, (actual[order],), (forecast[order],))
    got = {}
    for mode, cache, dense in (("kept", 10**9, 4), ("recount", 0, 0), ("dense", 0, 4)):
        tuning = EngineTuning(kpi_cache_ids=cache, kpi_dense_cells=dense)
        got[mode] = search(leaves, SearchParams(tuning=tuning))
    assert len(got["kept"].causes) >= 4
    for mode in ("recount", "dense"):
        assert [c.items for c in got[mode].causes] == [c.items for c in got["kept"].causes]
        for a, b in zip(got[mode].causes, got["kept"].causes, strict=True):
            assert a.ep == pytest.approx(b.ep, rel=1e-9, abs=1e-12)
            assert a.purity == pytest.approx(b.purity, rel=1e-9)
            assert a.leaves == b.leaves
        assert got[mode].confidence == pytest.approx(got["kept"].confidence, rel=1e-9)


def test_leaves_reach_numpy_in_the_smallest_code_type_and_a_too_small_budget_is_refused() -> None:
    cols, forecast, actual = _cube(0)
    src = open_source(_table(cols, actual, forecast))
    codes, values, k = _leaves(src, ('"a"', '"c"'), ["actual", "forecast"])
    assert codes.dtype == np.uint8 and codes.shape == (6 * 4, 2)
    assert sorted(values[0]) == [f"a{i}" for i in range(6)]
    assert np.isclose(k[0].sum(), actual.sum()) and np.isclose(k[1].sum(), forecast.sum())
    opts = DiagnoseOptions(memory_limit="100MB")
    with pytest.raises(ConfigError, match=r"needs about .* for 360 leaves.* raise memory_limit"):
        localize(_table(cols, actual, forecast), "actual", "forecast", options=opts)


def test_rows_summed_in_numpy_or_grouped_in_duckdb_give_the_same_leaves() -> None:
    """Rows that fit the budget reach NumPy as they are and rows of one leaf are summed there;
    rows that do not are grouped by DuckDB first. Both give the same leaves and sums, and a
    column with more than 255 values widens the codes to uint16 either way."""
    rng = np.random.default_rng(0)
    n = 100_000
    a = [f"a{i}" for i in rng.integers(0, 300, n)]
    b = [f"b{i}" for i in rng.integers(0, 4, n)]
    actual, forecast = rng.random(n), rng.random(n)
    src = open_source(pa.table({"a": a, "b": b, "actual": actual, "forecast": forecast}))
    got = {}
    # 100,000 rows need ~268 MB as leaves, the 1,200 leaves ~250 MB: the second run groups.
    for way, limit in (("numpy", None), ("duckdb", "260MB")):
        codes, values, k = _leaves(src, ('"a"', '"b"'), ["actual", "forecast"], limit)
        assert codes.dtype == np.uint16 and len(codes) == 1200
        got[way] = {
            (values[0][x], values[1][y]): (s, f)
            for (x, y), s, f in zip(codes.tolist(), k[0], k[1], strict=True)
        }
    assert got["numpy"].keys() == got["duckdb"].keys()
    for leaf, (s, f) in got["numpy"].items():
        assert got["duckdb"][leaf] == pytest.approx((s, f), rel=1e-12)
    want = {(x, y): 0.0 for x, y in zip(a, b, strict=True)}
    for x, y, s in zip(a, b, actual, strict=True):
        want[(x, y)] += s
    assert {leaf: v[0] for leaf, v in got["numpy"].items()} == pytest.approx(want, rel=1e-9)


def test_noise_cut_from_the_largest_values_equals_the_cut_from_all_of_them() -> None:
    """The noise cut (the (trim + 1)-th largest distinct move against the anomaly) is taken
    from a partition of the largest values when there are many: the same value as sorting
    every distinct value, ties and few distinct values included."""
    from stalwart.diagnose.kpi_scores import noise_cut

    def by_sorting(x: np.ndarray, trim: int) -> float:
        against = np.unique(-x[x < 0])
        return float(against[-1 - min(trim, (len(against) - 1) // 2)]) if len(against) else 0.0

    rng = np.random.default_rng(0)
    for case in range(400):
        x = rng.normal(0, 1, int(rng.integers(0, 6000)))
        if case % 3 == 0:
            x = np.round(x, int(rng.integers(0, 3)))  # many ties among the largest
        if case % 7 == 0:
            x[: len(x) // 2] = -0.5
        trim = int(rng.integers(0, 12))
        assert noise_cut(x, trim) == by_sorting(x, trim)
