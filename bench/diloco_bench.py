"""DiLoCo against data parallelism, and buffered async DiLoCo against sync with a straggler.

Three ``stalwart run`` workers of ``tests/distributed/diloco_worker.py`` (a generated
regression task, fresh rows per (step, rank), AdamW inner optimizer). Per-step compute is
*modelled* by a sleep of ``--compute-s`` on every worker, so the figures do not depend on how
busy this shared 2-core box is; the straggler is worker 2 with a chaos ``Delay`` of the same
length per step (2x slower).

1. No straggler, equal samples: ``ddp`` (one all-reduce per step) against ``diloco``
   (``--h`` inner steps per outer step, Nesterov 0.7/0.9): bytes contributed per sample, wall
   time per sample, held-out loss.
2. Worker 2 slowed 2x: ``ddp``, synchronous ``diloco``, ``async k=3`` (``Buffered(k=3)``:
   compute-aware H makes the slow member run fewer inner steps, so all three report
   together; no staleness, Nesterov 0.7/0.9), ``k=2 delayed`` (the outer step once 2 of 3
   reported, staleness <= 2, outer momentum 0.9, the default delayed Nesterov rule of
   :mod:`stalwart.elastic.outer_rules`) and ``k=2 per-version`` (the same with a Nesterov
   step per version, the rule that diverged); K < N runs for twice the outer steps (20+
   versions): wall time until the held-out loss is under the target (1.1x the final loss of
   synchronous DiLoCo with the same seed), from the per-outer-step traces.

Each seed (``--seeds``) changes the initial model, the teacher's rows and the held-out set
(the bench runs itself as the worker, wrapping ``diloco_worker.py``); contenders are
interleaved per seed; medians and ranges over the seeds.

    nice -n 10 .venv/bin/python bench/diloco_bench.py --seeds 3 4 5 --slow-only --h 20 \
        --compute-s 0.02 --contenders diloco "async k=3" "k=2 delayed" "k=2 per-version"
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stalwart.elastic.async_outer import Buffered
from stalwart.testing import Delay, KillSchedule

WORKER = Path(__file__).resolve().parents[1] / "tests" / "distributed" / "diloco_worker.py"
ROWS = 16  # rows per inner step and worker (diloco_worker.batch)


SLOW = {  # label: (worker mode, extra arguments, outer rule, outer steps x --outer)
    "ddp": ("ddp", [], "auto", 1),
    "diloco": ("diloco", [], "auto", 1),
    "async k=3": ("async", ["--k", "3"], "auto", 1),
    "k=2 delayed": ("async", ["--k", "2", "--fixed-h"], "auto", 2),
    "k=2 delayed, compute-aware": ("async", ["--k", "2"], "auto", 2),
    "k=2 delayed, drop stale": ("async", ["--k", "2", "--fixed-h", "--staleness", "0"], "auto", 2),
    "k=2 per-version": ("async", ["--k", "2", "--fixed-h"], "per-version", 2),
}


def worker(seed: int, rule: str, argv: list[str]) -> None:
    """Run ``diloco_worker.py`` with the task drawn from ``seed`` and the given outer rule."""
    sys.path.insert(0, str(WORKER.parent))
    import diloco_worker as w  # only the worker processes need it

    plain = w.batch
    w.batch = lambda step, rank, rows=16: plain(step + seed * 10**7, rank + 1000 * seed, rows)
    g = torch.Generator().manual_seed(7 + seed)
    w.TEACHER = (torch.randn(16, 32, generator=g), torch.randn(32, 1, generator=g))

    def model_and_inner(lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    w.model_and_inner = model_and_inner
    w.Buffered = functools.partial(Buffered, rule=rule)
    sys.argv = [str(WORKER), *argv]
    w.main()


def run(mode: str, a: argparse.Namespace, *, slow: bool, outer: int, seed: int = 0,
        rule: str = "auto", extra: Sequence[str] = ()) -> list[dict[str, Any]]:  # fmt: skip
    """One ``stalwart run`` of 3 workers; their final records."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("STALWART_ELASTIC_STORE", None)
    if slow:
        env.update(KillSchedule(delays=(Delay(worker=2, delay_s=a.compute_s),)).to_env())
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "3", "--max-restarts", "0",
               "--timeout", "120", __file__, "worker", str(seed), rule, "--mode", mode,
               "--outer", str(outer),
               "--h", str(a.h), "--compute-s", str(a.compute_s), "--trace", "--out", tmp,
               *extra]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{mode} failed:\n{done.stderr[-3000:]}")
        return [torch.load(p) for p in sorted(Path(tmp).glob("final-*.pt"))]


def summary(finals: list[dict[str, Any]], h: int) -> dict[str, float]:
    """Per-run figures: samples, bytes and seconds per sample, final loss."""
    inner = [f.get("inner", f["steps"]) for f in finals]
    samples = sum(inner) * ROWS
    wall = max(f["loop_s"] for f in finals)
    sent = sum(f["bytes"] for f in finals)
    return {"samples": samples, "bytes_per_sample": sent / samples, "wall": wall,
            "us_per_sample": 1e6 * wall / samples, "loss": finals[0]["loss"]}  # fmt: skip


def time_to(finals: list[dict[str, Any]], target: float) -> float:
    """The first time any worker saw the global model under ``target`` (inf: never)."""
    hits = [t for f in finals for t, _, loss in f["trace"] if loss <= target]
    return min(hits) if hits else float("inf")


def _fmt(values: list[float], spec: str = ".3g") -> str:
    return f"{statistics.median(values):{spec}} [{min(values):{spec}}-{max(values):{spec}}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[3, 4, 5])
    p.add_argument(
        "--contenders",
        nargs="+",
        default=list(SLOW),
        choices=list(SLOW),
        help="straggler-scenario contenders (diloco, the reference, is always run)",
    )
    p.add_argument("--h", type=int, default=50)
    p.add_argument("--outer", type=int, default=10)
    p.add_argument("--compute-s", type=float, default=0.004)
    p.add_argument("--slow-only", action="store_true", help="only the straggler scenario")
    p.add_argument("--save", type=Path, help="write the runs' records (JSON)")
    a = p.parse_args()
    a.contenders = ["diloco", *(c for c in a.contenders if c != "diloco")]
    plain: dict[str, list[dict[str, float]]] = {"ddp": [], "diloco": []}
    slow: dict[str, list[list[dict[str, Any]]]] = {label: [] for label in a.contenders}
    for seed in a.seeds:
        for mode in plain if not a.slow_only else ():
            plain[mode].append(summary(run(mode, a, slow=False, outer=a.outer, seed=seed), a.h))
        for label in a.contenders:
            mode, extra, rule, factor = SLOW[label]
            slow[label].append(run(mode, a, slow=True, outer=a.outer * factor, seed=seed,
                                   rule=rule, extra=extra))  # fmt: skip
            finals = slow[label][-1]
            print(f"seed {seed} {label}: final {finals[0]['loss']:.4f}, trace "
                  f"{[round(x[2], 3) for x in finals[0]['trace']]}", flush=True)  # fmt: skip
    if a.slow_only:
        plain = {}
    print("| no straggler | bytes sent / sample | wall µs / sample | held-out loss |")
    print("|---|---|---|---|")
    for mode, rows in plain.items():
        print(
            f"| {mode} | {_fmt([r['bytes_per_sample'] for r in rows])} | "
            f"{_fmt([r['us_per_sample'] for r in rows])} | {_fmt([r['loss'] for r in rows])} |"
        )
    if plain:
        ratio = [d["bytes_per_sample"] / s["bytes_per_sample"]
                 for d, s in zip(plain["ddp"], plain["diloco"], strict=True)]  # fmt: skip
        print(f"\nddp / diloco bytes per sample: {_fmt(ratio)}")
    if a.save:
        keep = ("loss", "loop_s", "trace")
        raw = {m: [[{k: f[k] for k in keep} for f in run] for run in v] for m, v in slow.items()}
        a.save.write_text(json.dumps({"seeds": a.seeds, "runs": raw}))
    targets = [1.1 * summary(f, a.h)["loss"] for f in slow["diloco"]]
    print("\n| worker 2 slowed 2x | wall s to 1.1x sync final loss | final loss | run wall s |")
    print("|---|---|---|---|")
    times = {m: [time_to(f, t) for f, t in zip(runs, targets, strict=True)]
             for m, runs in slow.items()}  # fmt: skip
    for mode, runs in slow.items():
        sums = [summary(f, a.h) for f in runs]
        print(
            f"| {mode} | {_fmt(times[mode])} | {_fmt([s['loss'] for s in sums])} | "
            f"{_fmt([s['wall'] for s in sums])} |"
        )
    for label in (c for c in a.contenders if c != "diloco"):
        speed = [s / t for s, t in zip(times["diloco"], times[label], strict=True)]
        print(f"sync diloco / {label} time to target, per repeat: {_fmt(speed, '.2f')}")
    print(f"(seeds {a.seeds}, H={a.h}, {a.outer} outer steps, modelled {a.compute_s} s/step)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4:])
    else:
        main()
