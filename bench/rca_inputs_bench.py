"""RCA inputs: a polars LazyFrame streamed (sink_parquet, never collected) against the same
frame collected first, and against the plain Parquet path; JSON lines against CSV. Wall time
and peak RSS (VmHWM), each run in a fresh process, interleaved.

    .venv/bin/python bench/rca_inputs_bench.py [--rows 2000000] [--repeat 3]

The log is generated once to Parquet (and JSON lines / CSV copies) in a temporary folder.
Prints a markdown table: median and range per input, and the ratios to the Parquet path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ONE = """
import json, sys, time
import polars as pl
from stalwart.diagnose import analyze
kind, path = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
if kind == "lazyframe":
    data = pl.scan_parquet(path)
elif kind == "collected":
    data = pl.scan_parquet(path).collect()
else:
    data = path
d = analyze(data, "failed")
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"s": time.perf_counter() - t0, "rss_mb": int(hwm.split()[1]) / 1024,
    "findings": len(d.findings)}))
"""
# Peak RSS is VmHWM, the high-water mark of this process's own address space: ru_maxrss would
# start from the parent's RSS at fork (Linux carries it across fork and exec).


def _run(kind: str, path: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _ONE, kind, str(path)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import duckdb
    import pyarrow.parquet as pq

    from stalwart.diagnose.synth import make_failure_log

    with tempfile.TemporaryDirectory(prefix="rca-inputs-") as tmp:
        base = Path(tmp)
        log = make_failure_log(args.rows, columns=20, causes=2, seed=0)
        pq.write_table(log.table.cast(_plain(log.table.schema)), base / "log.parquet")
        del log  # the children measure themselves, but keep this process small too
        con = duckdb.connect()
        src = f"read_parquet('{base / 'log.parquet'}')"
        con.sql(f"COPY (SELECT * FROM {src}) TO '{base / 'log.jsonl'}' (FORMAT JSON)")
        con.sql(f"COPY (SELECT * FROM {src}) TO '{base / 'log.csv'}' (HEADER)")
        con.close()
        cases = {
            "parquet path": ("path", base / "log.parquet"),
            "LazyFrame (streamed)": ("lazyframe", base / "log.parquet"),
            "LazyFrame.collect() first": ("collected", base / "log.parquet"),
            "CSV path": ("path", base / "log.csv"),
            "JSON lines path": ("path", base / "log.jsonl"),
        }
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in cases}
        t0 = time.perf_counter()
        for _ in range(args.repeat):  # interleaved: every contender sees the same load
            for name, (kind, path) in cases.items():
                runs[name].append(_run(kind, path))
    ref_s = statistics.median(r["s"] for r in runs["parquet path"])
    ref_m = statistics.median(r["rss_mb"] for r in runs["parquet path"])
    print(
        f"{args.rows:,} rows x 20 columns, {args.repeat} runs each "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    print(
        "| input | seconds, median [range] | peak RSS MB, median [range] | "
        "time / parquet | RSS / parquet |"
    )
    print("|---|---|---|---|---|")
    for name, rs in runs.items():
        s = [r["s"] for r in rs]
        m = [r["rss_mb"] for r in rs]
        print(
            f"| {name} | {statistics.median(s):.2f} [{min(s):.2f}, {max(s):.2f}] | "
            f"{statistics.median(m):.0f} [{min(m):.0f}, {max(m):.0f}] | "
            f"{statistics.median(s) / ref_s:.2f}x | {statistics.median(m) / ref_m:.2f}x |"
        )


def _plain(schema):  # type: ignore[no-untyped-def]
    import pyarrow as pa

    return pa.schema([(f.name, pa.bool_() if f.name == "failed" else pa.string()) for f in schema])


if __name__ == "__main__":
    main()
