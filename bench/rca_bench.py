"""Root-cause analysis benchmarks: accuracy on generated multi-cause logs, and end-to-end speed
and peak memory against an mlxtend + pandas pipeline and pyspark's FPGrowth.

    .venv/bin/python bench/rca_bench.py accuracy [--rows 100000] [--seeds 5]
    .venv/bin/python bench/rca_bench.py speed [--rows 1000000] [--repeat 3] [--peers mlxtend,spark]
    .venv/bin/python bench/rca_bench.py scale [--rows 100000000] [--memory-limit 4GB] [--dir /tmp]

``scale`` writes the log with DuckDB straight to Parquet (never in Python memory), analyses it
under a DuckDB ``memory_limit`` well below the data size, and deletes the file afterwards.

Real-incident accuracy (RS data set) is bench/rca_rs.py. Each speed run is a fresh process
(``_one``) that reports its wall time and its own peak RSS, so runs do not share caches.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stalwart.diagnose import DiagnoseOptions, analyze
from stalwart.diagnose.synth import make_failure_log

MIN_SUPPORT, MAX_LEN, MIN_LIFT = 0.05, 3, 1.5
PEER_MEMORY_BYTES = 14 << 30  # address-space cap of a peer process: the machine is shared


def accuracy(rows: int, seeds: int, strength: float) -> None:
    print(
        f"generated logs: {rows:,} rows x 20 columns + ID, causes at {strength:.0%} failure rate, "
        f"1% background; {seeds} seeds per cell; set-level P/R/F1"
    )
    print("causes  depth   TP  FP  FN  precision  recall    F1")
    for n_causes in (1, 2, 3):
        for depth in (1, 2, 3):
            tp = fp = fn = 0
            for seed in range(seeds):
                log = make_failure_log(
                    rows, causes=n_causes, depth=depth, seed=100 * seed + 7, strength=strength
                )
                d = analyze(log.table, log.label, options=DiagnoseOptions(example_rows=0))
                pred = {tuple(sorted(f.items.items())) for f in d.findings}
                true = {tuple(sorted(c.items())) for c in log.causes}
                tp, fp, fn = tp + len(pred & true), fp + len(pred - true), fn + len(true - pred)
            p = tp / (tp + fp) if tp + fp else 0.0
            r = tp / (tp + fn) if tp + fn else 0.0
            f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
            print(
                f"{n_causes:>6} {depth:>6} {tp:>4} {fp:>3} {fn:>3} {p:>10.3f} {r:>7.3f} {f1:>5.3f}"
            )


def _stalwart(path: str, memory_limit: str | None = None) -> int:
    d = analyze(path, "failed", options=DiagnoseOptions(example_rows=0, memory_limit=memory_limit))
    print(json.dumps({"timings_s": d.timings_s, "groups": d.groups}), file=sys.stderr)
    print(json.dumps({"findings": [f.items for f in d.findings]}), file=sys.stderr)
    return len(d.findings)


def _mlxtend(path: str) -> int:
    """The same analysis from mlxtend's fpgrowth and pandas: drop ID-like columns, mine the
    failures, compute each item-set's lift over all rows, prune, rank by lift."""
    import numpy as np
    import pandas as pd
    from mlxtend.frequent_patterns import fpgrowth

    df = pd.read_parquet(path)
    cols = [c for c in df.columns if c != "failed" and df[c].nunique() <= 0.02 * len(df)]
    onehot = pd.get_dummies(df[cols].astype(str), prefix_sep="=").astype(bool)
    failed = df["failed"].to_numpy()
    sets = fpgrowth(onehot[failed], min_support=MIN_SUPPORT, max_len=MAX_LEN, use_colnames=True)
    base = failed.mean()
    mat = {c: onehot[c].to_numpy() for c in onehot.columns}
    lifts = []
    for items in sets["itemsets"]:
        m = np.logical_and.reduce([mat[i] for i in items])
        lifts.append(failed[m].mean() / base if m.any() else 0.0)
    sets["lift"] = lifts
    kept = sets[sets["lift"] >= MIN_LIFT].sort_values("lift", ascending=False)
    by = {frozenset(s): lift for s, lift in zip(kept["itemsets"], kept["lift"], strict=True)}
    pruned = [s for s in by if not any(t < s and by[s] < 1.1 * by[t] for t in by)]
    return len(pruned)


def _spark(path: str) -> int:
    """pyspark's FPGrowth over the failures' item arrays, then lift by one join per level."""
    from pyspark.ml.fpm import FPGrowth
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "6g")
        .getOrCreate()
    )
    df = spark.read.parquet(path)
    cols = [c for c in df.columns if c not in ("failed", "host_id")]
    items = F.array(*(F.concat(F.lit(c + "="), F.col(c).cast("string")) for c in cols))
    fail = df.where("failed").select(items.alias("items"))
    model = FPGrowth(itemsCol="items", minSupport=MIN_SUPPORT).fit(fail)
    sets = model.freqItemsets.where(F.size("items") <= MAX_LEN).collect()
    # reference counts: explode every row's item-sets of each candidate's columns is what one
    # would write; counting each candidate with a filter is the plain version
    allrows = df.select(items.alias("items"), "failed").cache()
    total, nfail = allrows.count(), df.where("failed").count()
    kept = 0
    for row in sets[:200]:  # capped: one Spark job per candidate
        cond = F.lit(True)
        for it in row["items"]:
            cond = cond & F.array_contains("items", it)
        n = allrows.where(cond).count()
        kept += int(n and (row["freq"] / n) / (nfail / total) >= MIN_LIFT)
    spark.stop()
    return kept


def _one(engine: str, path: str, memory_limit: str | None = None) -> None:
    if engine != "stalwart":
        # an out-of-memory peer fails with MemoryError instead of taking the shared machine down
        resource.setrlimit(resource.RLIMIT_AS, (PEER_MEMORY_BYTES, PEER_MEMORY_BYTES))
    start = time.perf_counter()
    if engine == "stalwart":
        n = _stalwart(path, memory_limit)
    else:
        n = {"mlxtend": _mlxtend, "spark": _spark}[engine](path)
    wall = time.perf_counter() - start
    use = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak = max(use.ru_maxrss, kids.ru_maxrss) / 1024
    cpu = use.ru_utime + use.ru_stime + kids.ru_utime + kids.ru_stime
    print(json.dumps({"engine": engine, "wall_s": wall, "cpu_s": cpu, "peak_mb": peak, "found": n}))


def speed(rows: int, repeat: int, peers: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "log.parquet")
        log = make_failure_log(rows, causes=3, depth=(1, 2, 3), seed=1)
        table = log.table.cast(
            pa.schema(
                [
                    pa.field(f.name, pa.string() if f.name != "failed" else pa.bool_())
                    for f in log.table.schema
                ]
            )
        )
        pq.write_table(table, path)
        print(
            f"{rows:,} rows x 20 attribute columns + ID column, "
            f"{sum(table.column('failed').to_pylist()):,} failures; Parquet input; "
            f"median of {repeat} fresh processes"
        )
        results: dict[str, tuple[float, float, float]] = {}
        for engine in ["stalwart", *peers]:
            walls, peaks, cpus = [], [], []
            for _ in range(repeat if engine != "spark" else 1):
                proc = subprocess.run(
                    [sys.executable, __file__, "_one", engine, path],
                    capture_output=True,
                    text=True,
                    timeout=3600,
                )
                if proc.returncode:
                    print(f"{engine}: failed: {proc.stderr.strip().splitlines()[-1:]}")
                    break
                out = json.loads(proc.stdout.strip().splitlines()[-1])
                walls.append(out["wall_s"])
                peaks.append(out["peak_mb"])
                cpus.append(out["cpu_s"])
            if walls:
                results[engine] = (statistics.median(walls), max(peaks), statistics.median(cpus))
                print(
                    f"{engine:>9}: wall {results[engine][0]:7.2f} s  CPU "
                    f"{results[engine][2]:7.2f} s  peak RSS {results[engine][1]:7.0f} MB  "
                    f"wall runs {[round(w, 2) for w in walls]}"
                )
        if "stalwart" in results:
            mine = results["stalwart"]
            for engine, (wall, _, cpu) in results.items():
                if engine != "stalwart":
                    print(
                        f"stalwart vs {engine}: {wall / mine[0]:.1f}x less wall time, "
                        f"{cpu / mine[2]:.1f}x less CPU time"
                    )


# Cardinalities as in stalwart.diagnose.synth; values Zipf-like: floor(card * u^3).
_CARDS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 25, 30, 40, 50, 64, 100, 150, 200, 300, 500)
# Three causes of depth 1, 2 and 3 (column -> value), covering 1.3%, 0.8% and 1.5% of the rows.
_SCALE_CAUSES = ({19: 5}, {14: 0, 17: 2}, {4: 0, 9: 0, 12: 1})


def _scale_sql(rows: int, path: str) -> str:
    def u(k: int) -> str:  # a uniform draw in [0, 1) per row and stream, reproducible
        return f"((hash(i * 64 + {k}) >> 11)::DOUBLE / 9007199254740992.0)"

    codes = ", ".join(
        f"least(floor({c} * pow({u(k)}, 3)), {c - 1})::INT AS v{k}" for k, c in enumerate(_CARDS)
    )
    cause = " OR ".join(
        "(" + " AND ".join(f"v{k} = {v}" for k, v in sorted(c.items())) + ")" for c in _SCALE_CAUSES
    )
    cols = ", ".join(f"'c{k:02d}v' || v{k} AS c{k:02d}" for k in range(len(_CARDS)))
    ids = max(rows // 5, 1)
    return (
        f"COPY (WITH base AS (SELECT i, {codes} FROM range({rows}) t(i)) "
        f"SELECT 'host-' || lpad((hash(i * 64 + 62) % {ids})::VARCHAR, 9, '0') AS host_id, {cols}, "
        f"{u(63)} < (CASE WHEN {cause} THEN 0.3 ELSE 0.01 END) AS failed FROM base) "
        f"TO '{path}' (FORMAT parquet, ROW_GROUP_SIZE 1000000)"
    )


def scale(rows: int, memory_limit: str, folder: str, peers: list[str], keep: bool) -> None:
    import duckdb

    path = str(Path(folder) / f"stalwart-rca-scale-{rows}.parquet")
    truth = [{f"c{k:02d}": f"c{k:02d}v{v}" for k, v in sorted(c.items())} for c in _SCALE_CAUSES]
    try:
        start = time.perf_counter()
        if not Path(path).exists():
            with duckdb.connect(config={"memory_limit": memory_limit}) as con:
                con.execute(_scale_sql(rows, path))
        size = os.path.getsize(path)
        print(
            f"{rows:,} rows x 20 attribute columns + ID column, 3 causes (depth 1, 2, 3); "
            f"Parquet {size / 2**30:.2f} GiB written by DuckDB in "
            f"{time.perf_counter() - start:.0f} s"
        )
        for engine in ["stalwart", *peers]:
            cmd = [sys.executable, __file__, "_one", engine, path]
            if engine == "stalwart":
                cmd.append(memory_limit)
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
            if proc.returncode:
                tail = proc.stderr.strip().splitlines()[-1:]
                print(f"{engine}: failed (exit {proc.returncode}): {tail}")
                continue
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            line = (
                f"{engine:>9}: wall {out['wall_s']:7.1f} s  CPU {out['cpu_s']:7.1f} s  "
                f"peak RSS {out['peak_mb']:7.0f} MB"
            )
            if engine == "stalwart":
                info = [json.loads(x) for x in proc.stderr.strip().splitlines()[-2:]]
                found = info[1]["findings"]
                exact = sorted(map(str, found)) == sorted(map(str, truth))
                line += f"  memory_limit {memory_limit}  findings {found}  exact: {exact}"
                line += f"\n           phases {info[0]['timings_s']}  groups {info[0]['groups']:,}"
            print(line)
    finally:
        if not keep and Path(path).exists():
            os.remove(path)


def main() -> None:
    if len(sys.argv) in (4, 5) and sys.argv[1] == "_one":
        _one(sys.argv[2], sys.argv[3], *sys.argv[4:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("accuracy")
    a.add_argument("--rows", type=int, default=100_000)
    a.add_argument("--seeds", type=int, default=5)
    a.add_argument("--strength", type=float, default=0.3)
    s = sub.add_parser("speed")
    s.add_argument("--rows", type=int, default=1_000_000)
    s.add_argument("--repeat", type=int, default=3)
    s.add_argument("--peers", default="mlxtend,spark")
    c = sub.add_parser("scale")
    c.add_argument("--rows", type=int, default=100_000_000)
    c.add_argument("--memory-limit", default="4GB")
    c.add_argument("--dir", default=tempfile.gettempdir())
    c.add_argument("--peers", default="")
    c.add_argument("--keep", action="store_true", help="keep the Parquet file")
    args = ap.parse_args()
    if args.cmd == "accuracy":
        accuracy(args.rows, args.seeds, args.strength)
    elif args.cmd == "speed":
        speed(args.rows, args.repeat, [p for p in args.peers.split(",") if p])
    else:
        peers = [p for p in args.peers.split(",") if p]
        scale(args.rows, args.memory_limit, args.dir, peers, args.keep)


if __name__ == "__main__":
    main()
