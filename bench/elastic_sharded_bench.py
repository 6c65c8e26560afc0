"""A replacement healing its shard from peers' memory vs reading it from a disk checkpoint.

Each repetition runs ``stalwart run`` with 4 workers of
``tests/distributed/sharded_worker.py`` (3+1 XOR, protect every step, ``--table-mib`` MiB of
bulk per shard), SIGKILLs worker 1 inside its all-reduce at step 4 and reads the replacement's
heal from its log: ``heal`` (slots gathered, erasure group built, shard rebuilt, state
restored, replicated digests compared) and ``rebuild`` (the erasure rebuild alone). Between
launches it times reading the same shard (the expert, its momentum, the bulk) back from a
``torch.save`` file on local disk into a live module and optimizer: cold (page cache dropped:
``/proc/sys/vm/drop_caches`` as root, else ``posix_fadvise(DONTNEED)``) and warm. Quoted as
median [min-max]; ratios are disk time over heal time per repetition.

Run:  nice -n 10 .venv/bin/python bench/elastic_sharded_bench.py --table-mib 32 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed" / "sharded_worker.py"
sys.path.insert(0, str(WORKER.parent))

from sharded_worker import _expert  # noqa: E402

from stalwart.testing import Kill, KillSchedule  # noqa: E402


def heal_once(tmp: Path, mib: int) -> dict[str, float]:
    """One run with a kill; the replacement's heal times."""
    schedule = KillSchedule((Kill(worker=1, step=4, where="collective", delay_s=0.002),))
    env = {**os.environ, "OMP_NUM_THREADS": "1", **schedule.to_env()}
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "4", "--min-size", "4",
           "--max-restarts", "1", "--events", str(tmp / "events"), "--timeout", "60",
           str(WORKER), "--steps", "8", "--out", str(tmp / "out"),
           "--table-mib", str(mib)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"stalwart run failed:\n{done.stderr[-3000:]}")
    log = (tmp / "out" / "log-w4.jsonl").read_text().splitlines()
    heal = next(json.loads(x) for x in log if json.loads(x)["kind"] == "heal")
    return {"heal_s": heal["seconds"], "rebuild_s": heal["rebuild_s"]}


def _drop(path: Path) -> str:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "drop_caches"
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        return "fadvise"


def disk_once(folder: Path, mib: int) -> dict[str, float | str]:
    """Save a shard like the worker's, then time loading it back cold and warm."""
    expert = _expert(mib)
    opt = torch.optim.SGD(expert.parameters(), lr=0.05, momentum=0.9)
    expert(torch.ones(2, 8)).sum().backward()
    opt.step()
    path = folder / "shard.pt"
    with open(path, "wb") as f:
        torch.save({"model": expert.state_dict(), "optimizer": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    out: dict[str, float | str] = {}
    for kind in ("cold", "warm"):
        if kind == "cold":
            out["cache"] = _drop(path)
        t0 = time.perf_counter()
        sd = torch.load(path)
        expert.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
        out[f"{kind}_s"] = time.perf_counter() - t0
    return out


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table-mib", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp")
    a = ap.parse_args()
    print(f"# elastic_sharded_bench: {a.table_mib} MiB bulk per shard, reps={a.reps}, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    rows: list[dict[str, float | str]] = []
    for rep in range(a.reps):
        with tempfile.TemporaryDirectory(dir=a.dir) as d:
            order = ["disk", "heal"] if rep % 2 else ["heal", "disk"]  # interleaved
            row: dict[str, float | str] = {}
            for what in order:
                sub = Path(d) / what
                sub.mkdir()
                row.update(heal_once(sub, a.table_mib) if what == "heal" else
                           disk_once(sub, a.table_mib))  # fmt: skip
            rows.append(row)
            print(json.dumps(row))
    get = lambda key: [float(r[key]) for r in rows]  # noqa: E731
    cold = [float(r["cold_s"]) / float(r["heal_s"]) for r in rows]
    warm = [float(r["warm_s"]) / float(r["heal_s"]) for r in rows]
    print("\n| path | seconds | disk cold / heal | disk warm / heal |\n|---|---:|---:|---:|")
    print(f"| heal from peers (rebuild + restore + parity) | {spread(get('heal_s'))} | "
          f"{spread(cold)}x | {spread(warm)}x |")  # fmt: skip
    print(f"| erasure rebuild alone | {spread(get('rebuild_s'))} | | |")
    print(f"| disk read, cold ({rows[0]['cache']}) | {spread(get('cold_s'))} | | |")
    print(f"| disk read, warm | {spread(get('warm_s'))} | | |")


if __name__ == "__main__":
    main()
