"""Blocking time of asynchronous saves, and the cost of checkpointing every training step.

Runs, in one process and one run, on the same state:

1. blocking time (the part that stalls training) of ``torch.distributed.checkpoint.async_save``
   with its default stager (a fresh ``DefaultStager`` per call, so fresh staging pages every
   save), of ``dcp.async_save`` with one ``DefaultStager(StagingOptions(False, False, False,
   False))`` kept across saves (its staging buffers are cached per source storage and reused:
   DCP's best configuration on a CPU-only machine, where pinned memory, CUDA streams and
   non-blocking copies are unavailable), of a plain ``copy_`` into reused buffers, of
   stalwart's ``save_async`` eager and lazy (the state being a guarded optimizer's
   parameters, the only tensors whose copy a lazy save defers), and of a copy into freshly
   allocated buffers.
   Contenders run interleaved, their order rotating every repetition; medians and ranges.
2. a small real training loop (MLP + AdamW) with a checkpoint every step: none, stalwart lazy
   ``save_async`` to disk (guarded optimizer), stalwart memory tier every step + disk every
   20, ``dcp.async_save`` with the default stager and with a persistent stager (each waiting
   for the previous save, as DCP documents). Runs interleaved; medians and ranges.

    .venv/bin/python bench/async_bench.py --state-mib 256 --reps 9 --steps 40 --runs 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import stalwart

BLOCKING = {
    "dcp": "dcp.async_save, default stager",
    "dcp_stager": "dcp.async_save, persistent stager",
    "copy": "copy_ into reused buffers",
    "eager": "stalwart save_async (eager)",
    "lazy": "stalwart save_async (lazy)",
    "fresh": "clone into fresh buffers",
}
TRAIN = {
    "none": "no checkpoints",
    "stalwart": "stalwart lazy save_async, disk",
    "tiered": "stalwart memory every step + disk/20",
    "dcp": "dcp.async_save, default stager",
    "dcp_stager": "dcp.async_save, persistent stager",
}


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


def persistent_stager() -> DefaultStager:
    """DCP's stager with every CUDA-only option off, kept across saves (buffers cached)."""
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )


def _timed(save: Callable[[], Any], finish: Callable[[Any], Any]) -> float:
    """Seconds ``save`` blocks the caller; ``finish`` then waits for the background work."""
    t = time.perf_counter()
    handle = save()
    blocked = time.perf_counter() - t
    finish(handle)
    return blocked


def blocking(state: dict[str, torch.Tensor], reps: int, root: Path) -> dict[str, list[float]]:
    """Blocking time per save, each mode saving repeatedly as a training job would.

    Contenders are interleaved and their order rotates every repetition, so that a burst of
    load from other jobs does not land on one contender only.
    """
    out: dict[str, list[float]] = {k: [] for k in BLOCKING}
    reused = {k: torch.empty_like(v) for k, v in state.items()}
    opts = stalwart.CheckpointOptions(keep=stalwart.KeepLast(1))
    eager = stalwart.Checkpointer(root / "eager", opts)
    lazy = stalwart.Checkpointer(root / "lazy", opts)
    # A lazy save defers only the copies of tensors a guarded optimizer owns (anything else
    # may change before the next step and is copied before save_async returns): the state
    # here stands for a model's parameters, so an optimizer over the same storages is guarded.
    guarded = torch.optim.SGD([torch.nn.Parameter(v) for v in state.values()], lr=0.0)
    lazy.guard(guarded)  # the checkpointer holds the optimizer weakly: keep it alive here
    stager = persistent_stager()

    def copy() -> None:
        for k, v in state.items():
            reused[k].copy_(v)

    def run(mode: str, rep: int) -> float:
        if mode == "dcp":
            cid = str(root / "dcp" / f"s{rep % 2}")
            return _timed(lambda: dcp.async_save(state, checkpoint_id=cid), lambda f: f.result())
        if mode == "dcp_stager":
            cid = str(root / "dcps" / f"s{rep % 2}")
            return _timed(
                lambda: dcp.async_save(state, checkpoint_id=cid, async_stager=stager),
                lambda f: f.result(),
            )
        if mode == "eager":
            return _timed(lambda: eager.save_async(rep, state), lambda p: p.wait())
        if mode == "lazy":
            return _timed(lambda: lazy.save_async(rep, state, lazy=True), lambda p: p.wait())
        if mode == "copy":
            return _timed(copy, lambda _: None)
        return _timed(lambda: {k: v.clone() for k, v in state.items()}, lambda _: None)

    modes = list(BLOCKING)
    try:
        for rep in range(reps + 1):  # rep 0 warms up allocators, buffers and thread pools
            shift = rep % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                t = run(mode, rep)
                if rep:
                    out[mode].append(t)
    finally:
        eager.close()
        lazy.close()
        stager.close()
        del guarded
    return out


def _checkpointer(mode: str, root: Path, opt: torch.optim.Optimizer) -> Any:
    if mode == "stalwart":
        ck: Any = stalwart.Checkpointer(
            root / "stalwart", stalwart.CheckpointOptions(keep=stalwart.KeepLast(2))
        )
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
    else:
        return None
    ck.guard(opt)
    return ck


def train(mode: str, steps: int, root: Path) -> float:
    """Steps/s of a small MLP + AdamW with ``mode``'s checkpoint every step."""
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one core computes, the other is left to background I/O
    model = torch.nn.Sequential(
        *[m for _ in range(4) for m in (torch.nn.Linear(512, 512), torch.nn.GELU())],
        torch.nn.Linear(512, 10),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(512, 512), torch.randint(0, 10, (512,))
    ck = _checkpointer(mode, root, opt)
    stager = persistent_stager() if mode == "dcp_stager" else None
    fut = None
    t0 = 0.0
    for step in range(steps + 5):
        if step == 5:
            t0 = time.perf_counter()  # after warm-up
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        if ck is not None:
            ck.save_async(step, state, lazy=True)
        elif mode in ("dcp", "dcp_stager"):
            if fut is not None:
                fut.result()  # DCP: the previous save must finish before the next
            fut = dcp.async_save(
                state, checkpoint_id=str(root / mode / f"s{step % 2}"), async_stager=stager
            )
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if ck is not None:
        ck.wait()
        ck.close()
    if fut is not None:
        fut.result()
    if stager is not None:
        stager.close()
    return steps / (time.perf_counter() - t0)


def _range(xs: list[float], scale: float = 1.0, fmt: str = ".1f") -> str:
    return f"{min(xs) * scale:{fmt}}-{max(xs) * scale:{fmt}}"


def report_blocking(b: dict[str, list[float]], mib: int, n: int, reps: int) -> None:
    m = {k: med(v) for k, v in b.items()}
    print(f"\nblocking time of one save of {mib} MiB ({n} tensors), median [min-max] of {reps}:")
    print("| blocking time | ms (median) | range ms | x plain copy | x DCP persistent stager |")
    print("|---|---:|---:|---:|---:|")
    for k, label in BLOCKING.items():
        print(
            f"| {label} | {m[k] * 1e3:.1f} | {_range(b[k], 1e3)} | {m[k] / m['copy']:.3f} "
            f"| {m[k] / m['dcp_stager']:.3f} |"
        )
    per_rep = [e / c for e, c in zip(b["eager"], b["copy"], strict=True)]
    print(
        f"\ntargets: eager / DCP persistent stager = {m['eager'] / m['dcp_stager']:.2f} "
        f"(<= 1.0); eager / plain copy = {m['eager'] / m['copy']:.2f} (<= 1.2; per rep "
        f"{_range(per_rep, fmt='.2f')}); lazy / plain copy = {m['lazy'] / m['copy']:.3f} "
        f"(< 0.05); eager / DCP default = {m['eager'] / m['dcp']:.2f}; "
        f"fresh / reused copy = {m['fresh'] / m['copy']:.2f}"
    )


def report_training(rates: dict[str, list[float]], steps: int, runs: int) -> None:
    r = {m: med(v) for m, v in rates.items()}
    print(
        f"\ntraining with a checkpoint every step ({steps} steps; median [min-max] of {runs} "
        "interleaved runs; overhead = 1 - median rate / median rate without checkpoints):"
    )
    print("| training with a checkpoint every step | steps/s | range | overhead |")
    print("|---|---:|---:|---:|")
    for m, label in TRAIN.items():
        ovh = "—" if m == "none" else f"{100 * (1 - r[m] / r['none']):.1f} %"
        print(f"| {label} | {r[m]:.2f} | {_range(rates[m], fmt='.2f')} | {ovh} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--state-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=9, help="blocking-time repetitions")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--runs", type=int, default=5, help="training runs per mode")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*existing checkpoint.*")
    root = Path(tempfile.mkdtemp(prefix="stalwart-async-", dir=args.dir))
    store = dist.FileStore(str(root / "store"), 1)
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=600)
    )
    print(
        f"machine: nproc={os.cpu_count()}, torch {torch.__version__}, "
        f"load {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    try:
        state = make_state(args.state_mib)
        report_blocking(blocking(state, args.reps, root), args.state_mib, len(state), args.reps)
        rates: dict[str, list[float]] = {m: [] for m in TRAIN}
        modes = list(TRAIN)
        for run in range(args.runs):
            shift = run % len(modes)
            for m in modes[shift:] + modes[:shift]:
                rates[m].append(train(m, args.steps, root))
        report_training(rates, args.steps, args.runs)
        print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")
    finally:
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
