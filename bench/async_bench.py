"""Blocking time of asynchronous saves, and the cost of checkpointing every training step.

Runs, in one process and one run, on the same state:

1. blocking time (the part that stalls training) of ``torch.distributed.checkpoint.async_save``,
   of stalwart's ``save_async`` eager and lazy, of a plain copy into reused buffers and of a
   copy into freshly allocated buffers (fresh pages cost more than reused ones);
2. a small real training loop (MLP + AdamW) without checkpoints, with a stalwart lazy
   ``save_async`` every step (guarded optimizer), and with ``dcp.async_save`` every step
   (waiting for the previous one, as DCP documents), reporting steps/s and overhead.

    .venv/bin/python bench/async_bench.py --state-mib 512 --reps 5 --steps 60
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import stalwart


def make_state(mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    left = mib << 20
    i = 0
    sizes = [64 << 20, 16 << 20, 4 << 20, 1 << 20, 64 << 10]
    while left > 0:
        n = min(sizes[i % len(sizes)], left)
        state[f"t{i}"] = torch.randn(n // 4, generator=g)
        left -= n
        i += 1
    return state


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def blocking(state: dict[str, torch.Tensor], reps: int, root: Path) -> dict[str, float]:
    """Blocking time per save, each mode saving repeatedly as a training job would."""
    out: dict[str, list[float]] = {k: [] for k in ("dcp", "eager", "lazy", "copy", "fresh")}
    reused = {k: torch.empty_like(v) for k, v in state.items()}
    eager = stalwart.Checkpointer(
        root / "eager", stalwart.CheckpointOptions(keep=stalwart.KeepLast(1))
    )
    lazy = stalwart.Checkpointer(
        root / "lazy", stalwart.CheckpointOptions(keep=stalwart.KeepLast(1))
    )
    for rep in range(reps + 1):  # rep 0 warms up allocators, buffers and thread pools
        t = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(root / "dcp" / f"s{rep % 2}"))
        t_dcp = time.perf_counter() - t
        fut.result()

        t = time.perf_counter()
        p = eager.save_async(rep, state)
        t_eager = time.perf_counter() - t
        p.wait()

        t = time.perf_counter()
        p = lazy.save_async(rep, state, lazy=True)
        t_lazy = time.perf_counter() - t
        p.wait()

        t = time.perf_counter()
        for k, v in state.items():
            reused[k].copy_(v)
        t_copy = time.perf_counter() - t
        t = time.perf_counter()
        fresh = {k: v.clone() for k, v in state.items()}
        t_fresh = time.perf_counter() - t
        del fresh
        if rep:
            for k, v in zip(out, (t_dcp, t_eager, t_lazy, t_copy, t_fresh), strict=True):
                out[k].append(v)
    eager.close()
    lazy.close()
    return {k: med(v) for k, v in out.items()}


def train(mode: str, steps: int, root: Path) -> float:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one core computes, the other is left to background I/O
    model = torch.nn.Sequential(
        *[m for _ in range(4) for m in (torch.nn.Linear(512, 512), torch.nn.GELU())],
        torch.nn.Linear(512, 10),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(512, 512), torch.randint(0, 10, (512,))
    ck: Any = None
    fut = None
    if mode == "stalwart":
        ck = stalwart.Checkpointer(
            root / "stalwart", stalwart.CheckpointOptions(keep=stalwart.KeepLast(2))
        )
        ck.guard(opt)
    elif mode == "tiered":
        ck = stalwart.TieredCheckpointer(
            [
                stalwart.Tier(
                    name="memory", every=stalwart.EveryNSteps(1), keep=stalwart.KeepLast(1)
                ),
                stalwart.Tier(
                    name="local",
                    root=root / "tiered",
                    every=stalwart.EveryNSteps(20),
                    keep=stalwart.KeepLast(2),
                ),
            ]
        )
        ck.guard(opt)
    t0 = 0.0
    for step in range(steps + 5):
        if step == 5:
            t0 = time.perf_counter()  # after warm-up
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        if mode in ("stalwart", "tiered"):
            ck.save_async(step, state, lazy=True)
        elif mode == "dcp":
            if fut is not None:
                fut.result()
            fut = dcp.async_save(state, checkpoint_id=str(root / "dcp" / f"s{step % 2}"))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if ck is not None:
        ck.wait()
        ck.close()
    if fut is not None:
        fut.result()
    return steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--state-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*existing checkpoint.*")
    root = Path(tempfile.mkdtemp(prefix="stalwart-async-", dir=args.dir))
    store = dist.FileStore(str(root / "store"), 1)
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=600)
    )
    print(
        f"machine: nproc={os.cpu_count()}, torch {torch.__version__}, load {os.getloadavg()[0]:.2f}"
    )
    try:
        state = make_state(args.state_mib)
        b = blocking(state, args.reps, root)
        print(
            f"\nblocking time of one save of {args.state_mib} MiB ({len(state)} tensors), "
            f"median of {args.reps}:"
        )
        for k, label in (
            ("dcp", "dcp.async_save"),
            ("eager", "stalwart save_async (eager)"),
            ("lazy", "stalwart save_async (lazy)"),
            ("copy", "copy_ into reused buffers"),
            ("fresh", "clone into fresh buffers"),
        ):
            print(f"  {label:32s} {b[k] * 1e3:9.1f} ms   {b[k] / b['copy']:6.2f}x copy")
        print(
            f"  eager / dcp = {b['eager'] / b['dcp']:.2f} (target <= 0.5); eager / copy = "
            f"{b['eager'] / b['copy']:.2f} (target <= 1.5); "
            f"lazy / copy = {b['lazy'] / b['copy']:.3f} "
            f"(target < 0.10); fresh / reused copy = {b['fresh'] / b['copy']:.2f}"
        )
        rates: dict[str, list[float]] = {m: [] for m in ("none", "stalwart", "tiered", "dcp")}
        for _ in range(3):
            for m in rates:
                rates[m].append(train(m, args.steps, root))
        r = {m: med(v) for m, v in rates.items()}
        print(f"\ntraining with a checkpoint every step ({args.steps} steps, median of 3 runs):")
        for m, label in (
            ("none", "no checkpoints"),
            ("stalwart", "stalwart lazy save_async"),
            ("tiered", "stalwart memory + disk/20"),
            ("dcp", "dcp.async_save"),
        ):
            print(
                f"  {label:28s} {r[m]:7.2f} steps/s   "
                f"overhead {100 * (1 - r[m] / r['none']):5.1f} %"
            )
    finally:
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
