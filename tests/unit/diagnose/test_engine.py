"""FP-Growth against brute force, cleaning decisions, KPI localisation, hierarchies, and
fault-injection campaign tables."""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.diagnose import DiagnoseOptions, analyze, localize
from stalwart.diagnose.fpgrowth import fpgrowth, fpgrowth_rows

pytestmark = pytest.mark.timeout(120)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sets(st.integers(0, 9), min_size=1, max_size=6), st.integers(1, 5)),
        min_size=1,
        max_size=40,
    ),
    st.integers(1, 30),
    st.integers(1, 4),
)
def test_fpgrowth_matches_brute_force(
    rows: list[tuple[set[int], int]], min_weight: int, max_len: int
) -> None:
    tx = [sorted(t) for t, _ in rows]
    ws = [float(w) for _, w in rows]
    brute: dict[tuple[int, ...], float] = defaultdict(float)
    for t, w in zip(tx, ws, strict=True):
        for k in range(1, max_len + 1):
            for c in itertools.combinations(t, k):
                brute[c] += w
    want = {k: v for k, v in brute.items() if v >= min_weight}
    assert fpgrowth(tx, ws, min_weight=min_weight, max_len=max_len) == want


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sets(st.integers(0, 9), max_size=6), st.integers(0, 5)),
        min_size=1,
        max_size=40,
    ),
    st.integers(1, 30),
    st.integers(1, 4),
)
def test_fpgrowth_rows_matches_fpgrowth(
    rows: list[tuple[set[int], int]], min_weight: int, max_len: int
) -> None:
    tx = [sorted(t) for t, _ in rows]
    ws = [float(w) for _, w in rows]
    matrix = np.full((len(tx), 6), -1)
    for i, t in enumerate(tx):
        matrix[i, 6 - len(t) :] = t[::-1]  # any slot order, empty slots anywhere
    want = fpgrowth(tx, ws, min_weight=min_weight, max_len=max_len)
    got = fpgrowth_rows(matrix, np.array(ws), min_weight=min_weight, max_len=max_len)
    assert got.keys() == want.keys()
    for s, w in want.items():
        assert got[s] == pytest.approx(w)


def test_cleaning_drops_ids_buckets_numbers_keeps_nulls_and_exclusions() -> None:
    rng = np.random.default_rng(0)
    n = 6000
    latency = rng.lognormal(3, 1, n)
    zone = np.array(["a", "b", "c", None])[rng.integers(0, 4, n)]
    failed = (latency > np.quantile(latency, 0.8)) & (rng.random(n) < 0.5) | (rng.random(n) < 0.01)
    t = pa.table(
        {
            "request_id": [f"req-{i}" for i in range(n)],
            "latency_ms": latency,
            "zone": zone,
            "build": [f"b{i % 3}" for i in range(n)],
            "failed": failed,
        }
    )
    d = analyze(t, "failed", options=DiagnoseOptions(exclude=["build"]))
    actions = {(c["column"], c["action"]) for c in d.cleaning}
    assert ("request_id", "dropped") in actions
    assert ("latency_ms", "bucketed") in actions
    assert ("zone", "nulls") in actions
    assert "build" not in d.columns
    assert [f.items for f in d.findings] == [
        {"latency_ms": ">= " + f.items["latency_ms"][3:]} for f in d.findings
    ]
    assert d.findings and d.findings[0].items["latency_ms"].startswith(">=")


def test_localize_additive_kpi_finds_the_dropping_leaves() -> None:
    rows = []
    for dc in ("dc1", "dc2", "dc3"):
        for app in ("web", "api", "batch", "ml"):
            for ver in ("v1", "v2"):
                exp = 1000.0
                act = 400.0 if (dc == "dc2" and app == "api") else exp * (1 + 0.01 * len(app))
                rows.append((dc, app, ver, act, exp))
    t = pa.table(list(zip(*rows, strict=True)), names=["dc", "app", "ver", "real", "pred"])
    d = localize(t, actual="real", expected="pred")
    assert [f.items for f in d.findings] == [{"app": "api", "dc": "dc2"}]
    assert d.mode == "kpi-additive" and d.findings[0].support > 0.9


def test_localize_ratio_kpi() -> None:
    rng = np.random.default_rng(1)
    rows = []
    for cdn in range(6):
        for isp in range(4):
            for br in (500, 1000, 2000):
                req = float(rng.integers(2000, 5000))
                rate = 0.98 if cdn != 3 else 0.70
                rows.append((str(cdn), f"isp{isp}", str(br), rate * req, req, 0.98 * req, req))
    names = ["cdn", "isp", "bitrate", "ok", "req", "ok_exp", "req_exp"]
    t = pa.table(list(zip(*rows, strict=True)), names=names)
    d = localize(t, actual=("ok", "req"), expected=("ok_exp", "req_exp"))
    assert [f.items for f in d.findings] == [{"cdn": "3"}]


def test_hierarchy_keeps_one_level_per_finding() -> None:
    n = 8000
    rng = np.random.default_rng(2)
    host = rng.integers(0, 40, n)
    rack = host // 5
    region = rack // 4
    failed = (rack == 3) & (rng.random(n) < 0.4) | (rng.random(n) < 0.01)
    t = pa.table(
        {
            "region": [f"g{x}" for x in region],
            "rack": [f"r{x}" for x in rack],
            "host": [f"h{x}" for x in host],
            "failed": failed,
        }
    )
    d = analyze(t, "failed", options=DiagnoseOptions(hierarchies=(("region", "rack", "host"),)))
    assert [f.items for f in d.findings] == [{"rack": "r3"}]


def test_hosts_are_reported_not_the_rack_or_attributes_they_share() -> None:
    # two bad hosts of one rack, sharing a kernel with a few good ones: the rack and the kernel
    # are elevated only through them, so the findings are the two hosts
    n = 20_000
    rng = np.random.default_rng(4)
    host = rng.integers(0, 40, n)
    kernel = np.where(np.isin(host, [15, 16, 3, 27]), "k2", np.where(host % 2, "k1", "k0"))
    failed = np.isin(host, [15, 16]) & (rng.random(n) < 0.3) | (rng.random(n) < 0.01)
    t = pa.table(
        {
            "rack": [f"r{x // 5}" for x in host],
            "host": [f"h{x}" for x in host],
            "kernel": kernel,
            "failed": failed,
        }
    )
    opts = DiagnoseOptions(hierarchies=(("rack", "host"), ("kernel", "host")))
    d = analyze(t, "failed", options=opts)
    assert sorted(f.label() for f in d.findings) == ["host=h15", "host=h16"]
    for rank_by in ("explained", "likelihood"):
        d = analyze(
            t, "failed", options=DiagnoseOptions(hierarchies=opts.hierarchies, rank_by=rank_by)
        )
        assert sorted(f.label() for f in d.findings) == ["host=h15", "host=h16"]


def test_fault_injection_campaign_table() -> None:
    # a per-trial table as a campaign writes it: which layer x bit x dtype makes trials fail?
    rng = np.random.default_rng(3)
    n = 20_000
    layer = rng.choice([f"layers.{i}.mlp" for i in range(6)] + ["embed", "head"], n)
    dtype = rng.choice(["bf16", "fp32"], n)
    bit = np.where(dtype == "bf16", rng.integers(0, 16, n), rng.integers(0, 32, n))
    exponent_msb = ((dtype == "bf16") & (bit == 14)) | ((dtype == "fp32") & (bit == 30))
    sdc = exponent_msb & (layer != "embed") & (rng.random(n) < 0.9) | (rng.random(n) < 0.005)
    t = pa.table(
        {
            "trial": np.arange(n),
            "layer": layer,
            "bit": bit,
            "dtype": dtype,
            "outcome": np.where(sdc, "sdc", "masked"),
        }
    )
    d = analyze(t, "outcome = 'sdc'")
    found = [f.items for f in d.findings]
    assert {"bit": "30", "dtype": "fp32"} in found or {"bit": "30"} in found
    assert {"bit": "14", "dtype": "bf16"} in found or {"bit": "14"} in found
    assert ("trial", "dropped") in {(c["column"], c["action"]) for c in d.cleaning}
