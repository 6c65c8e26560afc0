"""Out-of-core root-cause analysis: wall time and peak RSS against ``memory_limit``.

    .venv/bin/python bench/rca_scale_bench.py --rows 10000000 --memory-limit 1GB --repeat 3
    .venv/bin/python bench/rca_scale_bench.py --rows 100000000 --memory-limit 4GB --repeat 1
    .venv/bin/python bench/rca_scale_bench.py --rows 1000000 --memory-limit none --repeat 5

The log is bench/rca_bench.py's ``scale`` log (20 attribute columns, an ID column, 3 causes of
depth 1, 2 and 3), written by DuckDB straight to Parquet, never through Python. Each run is a
fresh process whose resident set size is sampled every 20 ms by a thread (``ru_maxrss`` too),
so the peak includes DuckDB's buffers, Arrow's pool and NumPy arrays alike; the line says how far
that peak is from the limit and which phase of the analysis was running when it was reached,
with the process's CPU time (user + system, all threads) and the 1-minute load average at the
end (the machine is shared: CPU time is the steadier number).
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
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rca_bench import _SCALE_CAUSES, _scale_sql

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _bytes(limit: str) -> int:
    text = limit.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * _UNITS[unit])
    return int(text)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _one(path: str, memory_limit: str | None) -> None:
    """One analysis in this process: print wall time, peak RSS and the phase at the peak."""
    import logging

    from stalwart.diagnose import DiagnoseOptions, analyze

    peak = [0, 0.0, "start"]
    phase = ["open"]

    class _Phase(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            phase[0] = record.getMessage()[:60]

    logging.getLogger("stalwart.diagnose").addHandler(_Phase())
    logging.getLogger("stalwart.diagnose").setLevel(logging.INFO)
    start = time.perf_counter()
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            rss = _rss()
            if rss > peak[0]:
                peak[:] = [rss, time.perf_counter() - start, phase[0]]

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    opts = DiagnoseOptions(memory_limit=memory_limit, example_rows=0)
    d = analyze(path, "failed", options=opts)
    wall = time.perf_counter() - start
    done.set()
    thread.join()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    maxrss = usage.ru_maxrss * 1024
    print(
        json.dumps(
            {
                "wall_s": wall,
                "cpu_s": usage.ru_utime + usage.ru_stime,
                "peak_bytes": max(maxrss, peak[0]),
                "peak_at_s": peak[1],
                "peak_after": peak[2],
                "timings_s": d.timings_s,
                "groups": d.groups,
                "findings": [f.items for f in d.findings],
            }
        )
    )


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "_one":
        _one(sys.argv[2], None if sys.argv[3] == "none" else sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--memory-limit", default="1GB", help="DuckDB memory_limit, or 'none'")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--keep", action="store_true", help="keep the Parquet file for the next run")
    args = ap.parse_args()
    path = str(Path(args.dir) / f"stalwart-rca-scale-{args.rows}.parquet")
    truth = sorted(
        str({f"c{k:02d}": f"c{k:02d}v{v}" for k, v in sorted(c.items())}) for c in _SCALE_CAUSES
    )
    try:
        if not Path(path).exists():
            import duckdb

            start = time.perf_counter()
            with duckdb.connect(config={"memory_limit": "2GB"}) as con:
                con.execute(_scale_sql(args.rows, path))
            print(f"wrote {path} in {time.perf_counter() - start:.0f} s")
        size = os.path.getsize(path) / 2**30
        print(
            f"{args.rows:,} rows x 20 attribute columns + ID, Parquet {size:.2f} GiB, "
            f"memory_limit {args.memory_limit}, {args.repeat} fresh process(es)"
        )
        walls, peaks, cpus = [], [], []
        for _ in range(args.repeat):
            cmd = [sys.executable, __file__, "_one", path, args.memory_limit]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            if proc.returncode:
                print(f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-3:]}")
                return
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            walls.append(out["wall_s"])
            cpus.append(out["cpu_s"])
            peaks.append(out["peak_bytes"])
            exact = sorted(map(str, out["findings"])) == truth
            print(
                f"  wall {out['wall_s']:6.1f} s  CPU {out['cpu_s']:6.1f} s  load "
                f"{os.getloadavg()[0]:.1f}  peak RSS {out['peak_bytes'] / 1e9:5.2f} GB at "
                f"{out['peak_at_s']:.1f} s (after {out['peak_after']!r})  exact: {exact}\n"
                f"  phases {out['timings_s']}  groups {out['groups']:,}"
            )
        line = f"median wall {statistics.median(walls):.1f} s (range {min(walls):.1f}-"
        line += f"{max(walls):.1f}), median CPU {statistics.median(cpus):.1f} s (process, all "
        line += f"threads), peak RSS max {max(peaks) / 1e9:.2f} GB"
        if args.memory_limit != "none":
            limit = _bytes(args.memory_limit)
            line += f" = {max(peaks) / limit:.2f}x memory_limit ({limit / 1e9:.2f} GB)"
        print(line)
    finally:
        if not args.keep and Path(path).exists():
            os.remove(path)


if __name__ == "__main__":
    main()
