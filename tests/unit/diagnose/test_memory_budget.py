"""An analysis under a small ``memory_limit`` (coded rows streamed from a spilled DuckDB table,
DuckDB given its share of the limit) finds what it finds without one; FP-Growth in small chunks
and buffers mines what it mines in one piece."""

from __future__ import annotations

import numpy as np
import pytest

from stalwart.diagnose import DiagnoseOptions, analyze
from stalwart.diagnose import fpgrowth as fpgrowth_module
from stalwart.diagnose.budget import duckdb_limit, in_memory_budget, parse_bytes
from stalwart.diagnose.options import EngineTuning
from stalwart.diagnose.source import open_source
from stalwart.diagnose.synth import SyntheticLog


def test_duckdb_gets_its_share_of_the_limit() -> None:
    assert parse_bytes("1GB") == 10**9
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("lots") is None
    assert duckdb_limit("1GB") == "476MiB"
    assert duckdb_limit("2MB") == "64MiB"  # DuckDB's floor
    assert duckdb_limit(None) is None
    with open_source("SELECT 1 AS x", memory_limit="1GB") as src:
        setting = src.sql("SELECT current_setting('memory_limit')").fetchall()[0][0]
    assert setting.replace(" ", "").startswith(("476", "499"))  # MiB or MB, by DuckDB version


def test_small_memory_limit_gives_the_same_findings(log2: SyntheticLog) -> None:
    table = log2.table
    free = analyze(table, "failed")
    assert len(table) * 40 > in_memory_budget("2MB")  # 40 bytes a coded row: streamed
    streamed = EngineTuning(stream_rows=0)  # failing groups streamed too
    small = analyze(table, "failed", options=DiagnoseOptions(memory_limit="2MB", tuning=streamed))
    assert free.findings
    assert [(f.items, f.failures, f.rows) for f in small.findings] == [
        (f.items, f.failures, f.rows) for f in free.findings
    ]


def test_fpgrowth_in_small_chunks_matches_one_piece() -> None:
    rng = np.random.default_rng(5)
    cards = [3, 4, 5, 6, 7, 8]
    codes = np.stack([rng.integers(0, k, 3000) for k in cards], 1)
    items = codes + np.concatenate([[0], np.cumsum(cards)[:-1]])
    items = np.where(rng.random(items.shape) < 0.1, -1, items)
    w = rng.integers(1, 4, len(items)).astype(float)
    want = fpgrowth_module.fpgrowth_rows(items, w, min_weight=60.0, max_len=3)
    for dense in (1 << 22, 8):  # dense triple sums, then sorted sparse ones
        small = EngineTuning(node_chunk=97, triple_buffer=50, dense_triples=dense)
        got = fpgrowth_module.fpgrowth_rows(items, w, min_weight=60.0, max_len=3, tuning=small)
        assert got.keys() == want.keys()
        assert [got[k] for k in want] == pytest.approx(list(want.values()))
    assert any(len(k) == 3 for k in want)
