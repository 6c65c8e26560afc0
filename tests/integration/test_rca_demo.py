"""The root-cause section of ``stalwart demo``, and an out-of-core run under a small DuckDB
memory limit that must spill rather than fail."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from stalwart.demos.rca import run_rca_demo
from stalwart.diagnose import DiagnoseOptions, analyze
from stalwart.diagnose.synth import make_failure_log

pytestmark = pytest.mark.timeout(120)


def test_demo_section_recovers_the_injected_causes() -> None:
    console = Console(record=True, width=160)
    d = run_rca_demo(console, rows=60_000)
    assert "demo: found 3 of 3 causes" in d.notes
    assert "injected causes recovered exactly" in console.export_text()


def test_spills_under_a_small_memory_limit(tmp_path: Path) -> None:
    log = make_failure_log(300_000, causes=2, depth=(1, 2), seed=5)
    table = log.table.cast(
        pa.schema(
            [
                pa.field(f.name, pa.string() if f.name != "failed" else pa.bool_())
                for f in log.table.schema
            ]
        )
    )
    pq.write_table(table, tmp_path / "log.parquet")
    d = analyze(
        str(tmp_path / "log.parquet"),
        "failed",
        options=DiagnoseOptions(
            memory_limit="100MB", threads=1, temp_directory=str(tmp_path / "spill")
        ),
    )
    assert sorted(map(str, (f.items for f in d.findings))) == sorted(map(str, log.causes))
