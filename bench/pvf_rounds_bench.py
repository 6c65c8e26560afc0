"""Sequential stopping: rounds appended to one Campaign vs the old concatenate-and-rerun loop.

    nice -n 10 .venv/bin/python bench/pvf_rounds_bench.py [--model digits-cnn] [--repeats 3]

Before campaigns were objects, every round of ``pvf(..., margin=...)`` concatenated the fault
lists and re-ran ``run_campaign`` over all trials so far, re-tracing the model each round.
``old`` below is that loop, verbatim apart from names; ``new`` is ``pvf`` with
``UntilWidth``. Both draw the same faults (same seeds), so the per-trial outcomes must be
identical: the script checks it. Contenders are interleaved; medians and ranges of
``--repeats`` runs; one thread (a shared machine makes multi-threaded timings noisy).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from stalwart import inject, models, vulnerability
from stalwart.vulnerability import FaultList, PVFOptions, UntilWidth, estimate, run_campaign


def old_loop(
    model: nn.Module, x: Any, crits: list[str], by: str, stop: UntilWidth, seed: int
) -> vulnerability.CampaignResult:
    """The pre-Campaign ``pvf`` loop (default error model, per-tensor stratification for
    ``tensor``/``layer``, bit narrowing for ``bit``)."""
    strat = by in ("tensor", "layer", "component")
    per_round = stop.trials
    if strat:
        per_round = max(
            1, stop.trials // len(inject.targets.select_tensors(model, "*", quantized=True))
        )
    base = inject.BitFlip()
    faults = FaultList([], seed, "", {})
    targets: Any = "*"
    err: Any = base
    rnd = 0
    while True:
        part = vulnerability.sample_faults(
            model, per_round, targets=targets, error=err, seed=seed + 7919 * rnd, per_tensor=strat
        )
        faults = FaultList(
            faults.faults + part.faults, seed, part.error, faults.population | part.population
        )
        result = run_campaign(model, x, faults, crits)
        rnd += 1
        wide = stop.next_round(estimate(result, by), len(faults))
        if not wide:
            return result
        if by == "tensor":
            targets = wide
        elif by == "bit":
            err = dataclasses.replace(base, bits=[int(b) for b in wide if int(b) >= 0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="digits-cnn")
    ap.add_argument("--inputs", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--half-width", type=float, default=0.04)
    ap.add_argument("--trials", type=int, default=400)
    ap.add_argument("--max-trials", type=int, default=4000)
    ap.add_argument("--by", nargs="+", default=["tensor", "bit"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    ref = models.load(args.model)
    x = tuple(t[: args.inputs] for t in ref.inputs)
    crits = list(ref.criteria[:1])
    stop = UntilWidth(args.half_width, trials=args.trials, max_trials=args.max_trials)
    rows = []
    for by in args.by:
        times: dict[str, list[float]] = {"old": [], "new": []}
        results: dict[str, Any] = {}
        for _ in range(args.repeats):
            for who in ("old", "new"):  # interleaved
                t0 = time.perf_counter()
                if who == "old":
                    results[who] = old_loop(ref.model, x, crits, by, stop, seed=0)
                else:
                    opts = PVFOptions(by=by, stop=stop, seed=0)
                    results[who] = vulnerability.pvf(ref.model, x, crits, opts).result
                times[who].append(time.perf_counter() - t0)
        old, new = results["old"], results["new"]
        same = old.faults.faults == new.faults.faults and all(
            np.array_equal(old.failed[c], new.failed[c]) for c in crits
        )
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append(
            {
                "model": args.model,
                "by": by,
                "trials": len(new),
                "rounds_old_s": times["old"],
                "rounds_new_s": times["new"],
                "median_old_s": med["old"],
                "median_new_s": med["new"],
                "speedup": med["old"] / med["new"],
                "outcomes_identical": same,
            }
        )
        r = rows[-1]
        print(
            f"{args.model} by {by}: {r['trials']} trials; old {med['old']:.2f} s "
            f"[{min(times['old']):.2f}, {max(times['old']):.2f}], new {med['new']:.2f} s "
            f"[{min(times['new']):.2f}, {max(times['new']):.2f}]: {r['speedup']:.2f}x; "
            f"outcomes identical: {same}"
        )
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
