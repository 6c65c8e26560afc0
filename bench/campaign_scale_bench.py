"""Throughput of sharded campaigns on 1, 2 and 4 workers (torch gloo processes and Ray).

    nice -n 10 .venv/bin/python bench/campaign_scale_bench.py [--model mlp] [--trials 6000]
        [--workers 1 2 4] [--backends torch ray] [--repeats 3] [--json out.json]

One fault list (seeded), one reference model built by a picklable factory in every worker
(``models.load(name, cache=True)``: the driver trains and caches it first, so workers load
the same weights). Each run is end to end: worker start-up (spawn or Ray actors), model
load and trace, the shards, the merge; a fresh campaign directory every run. The peer is
``run_campaign`` in this process on one thread. Contenders are interleaved per repeat; the
table quotes medians and ranges. Every merged result is checked against the one-process
result on every trial (the per-trial table must be equal); the count of checked trials is
printed. Speedup is over one worker of the same back-end; efficiency = speedup / workers.
Ray is started once (``num_cpus`` = the most workers asked for), outside the timings.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time

import torch

from stalwart import models
from stalwart.vulnerability import run_campaign, sample_faults, scale


def one_process(name: str, trials: int) -> tuple[float, object]:
    """The peer: run_campaign in this process, one thread."""
    torch.set_num_threads(1)
    ref = models.load(name, cache=True)
    faults = sample_faults(ref.model, trials, seed=0)
    t0 = time.perf_counter()
    res = run_campaign(ref.model, ref.inputs, faults, "top1", labels=None)
    return time.perf_counter() - t0, res


def sharded(name: str, trials: int, backend: str, workers: int) -> tuple[float, object]:
    """One end-to-end sharded run into a fresh directory."""
    ref = models.load(name, cache=True)
    faults = sample_faults(ref.model, trials, seed=0)
    make = functools.partial(models.load, name, cache=True)
    with tempfile.TemporaryDirectory(prefix="campaign-bench-") as d:
        t0 = time.perf_counter()
        res = scale.run_sharded(make, faults, d, "top1", workers=workers, backend=backend)
        return time.perf_counter() - t0, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--trials", type=int, default=6000)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--backends", nargs="+", default=["torch", "ray"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    models.load(a.model, cache=True)  # train and cache once, before any worker loads it
    if "ray" in a.backends:
        import ray

        ray.init(num_cpus=max(a.workers), include_dashboard=False, log_to_driver=False)
    times: dict[str, list[float]] = {}
    checked = 0
    ref_table = None
    for rep in range(a.repeats):
        s, res = one_process(a.model, a.trials)
        times.setdefault("one process", []).append(s)
        ref_table = res.table()
        for backend in a.backends:
            for w in a.workers:
                s, res = sharded(a.model, a.trials, backend, w)
                assert res.table().equals(ref_table), f"{backend} x{w} differs from one process"
                checked += len(res)
                times.setdefault(f"{backend} x{w}", []).append(s)
                print(f"repeat {rep}: {backend} x{w}: {s:.2f} s", flush=True)
    report(a, times, checked)


def report(a: argparse.Namespace, times: dict[str, list[float]], checked: int) -> None:
    """Print the markdown table (and write JSON when asked)."""
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"\n{a.model}, {a.trials} trials, {os.cpu_count()} CPUs, medians of {a.repeats} "
        f"(range in trials/s); {checked} merged trials checked equal to one process\n"
    )
    print("| run | trials/s | range | speedup vs 1 worker | efficiency | vs one process |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for k, v in times.items():
        backend, _, w = k.partition(" x")
        base = med.get(f"{backend} x1")
        speed = base / med[k] if base and w else float("nan")
        eff = speed / int(w) if w else float("nan")
        lo, hi = a.trials / max(v), a.trials / min(v)
        print(
            f"| {k} | {a.trials / med[k]:,.0f} | {lo:,.0f}-{hi:,.0f} | {speed:.2f} | "
            f"{eff:.2f} | {med['one process'] / med[k]:.2f} |"
        )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "seconds": times, "checked": checked}, fh, indent=1)


if __name__ == "__main__":
    main()
