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

3. ``--gib-layers L`` (issue 25): a gigabyte state checkpointed to memory every step.
   ``L`` x ``Linear(--gib-dim, bias=False)`` + AdamW (22 x 2048: 1.03 GiB of parameters and
   moments), batch ``--gib-batch``, one compute thread; runs of ``--gib-steps`` steps without
   checkpoints and with a memory-tier snapshot every step (lazy ``save_async``, guarded
   optimizer), interleaved, ``--gib-runs`` each. In the same runs: the background CPU seconds
   per GB snapshotted (process CPU time minus the training thread's, over the timed steps,
   less the same difference without checkpoints) against the copy + hash limit (one thread's
   CPU time for a ``copy_`` of the same tensors into reused buffers plus XXH3-128 over the
   same bytes, the work a snapshot cannot avoid), measured between the runs.

    .venv/bin/python bench/async_bench.py --state-mib 256 --reps 9 --steps 40 --runs 5
    .venv/bin/python bench/async_bench.py --gib-layers 22 --gib-runs 7   # part 3 only
"""

from __future__ import annotations

import argparse
import os
import random
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
import xxhash
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


def _gib_model(layers: int, dim: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def gib_run(mode: str, model: Any, opt: Any, a: argparse.Namespace) -> dict[str, float]:
    """Steps/s and background CPU seconds of one run of ``mode`` (``none`` or ``memory``)."""
    torch.set_num_threads(1)
    x = torch.randn(a.gib_batch, a.gib_dim)
    ck = None
    if mode == "memory":
        ck = stalwart.TieredCheckpointer(
            [stalwart.Tier(name="memory", every=stalwart.EveryNSteps(1), keep=stalwart.KeepLast(1))]
        )
        ck.guard(opt)
    t0 = cpu0 = main0 = 0.0
    for step in range(a.gib_steps + 2):
        if step == 2:  # after warm-up (buffers faulted in, threads started)
            t0, cpu0, main0 = time.perf_counter(), time.process_time(), time.thread_time()
        if ck is not None:
            ck.save_async(step, {"model": model.state_dict(), "optim": opt.state_dict()},
                          lazy=True)  # fmt: skip
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    if ck is not None:
        ck.wait()
    wall = time.perf_counter() - t0
    bg = (time.process_time() - cpu0) - (time.thread_time() - main0)
    if ck is not None:
        ck.close()
    return {"rate": a.gib_steps / wall, "bg_cpu": bg, "main_cpu": time.thread_time() - main0}


def copy_hash_limit(model: Any, opt: Any, bufs: list[torch.Tensor]) -> tuple[float, int]:
    """One thread's CPU seconds to copy the state into reused buffers and XXH3 its bytes."""
    srcs = [t for t in model.state_dict().values()]
    srcs += [v for st in opt.state.values() for v in st.values() if v.dim() > 0]
    if not bufs:
        bufs += [torch.empty_like(t) for t in srcs]
        for b, t in zip(bufs, srcs, strict=True):
            b.copy_(t)  # fault the pages in once: the snapshot's buffers are reused too
    c0 = time.thread_time()
    n = 0
    for b, t in zip(bufs, srcs, strict=True):
        b.copy_(t)
        xxhash.xxh3_128_digest(memoryview(b.view(-1).view(torch.uint8).numpy().data))
        n += b.numel() * b.element_size()
    return time.thread_time() - c0, n


def every_step_gib(a: argparse.Namespace) -> None:
    model, opt = _gib_model(a.gib_layers, a.gib_dim)
    opt.zero_grad()
    model(torch.randn(2, a.gib_dim)).sum().backward()
    opt.step()  # AdamW's moments exist: the state is complete
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(v.numel() * v.element_size() for st in opt.state.values()
                  for v in st.values())  # fmt: skip
    res: dict[str, list[dict[str, float]]] = {"none": [], "memory": []}
    limit: list[float] = []
    bufs: list[torch.Tensor] = []
    for run in range(a.gib_runs):
        for mode in ("none", "memory") if run % 2 == 0 else ("memory", "none"):
            res[mode].append(gib_run(mode, model, opt, a))
        cpu, n = copy_hash_limit(model, opt, bufs)
        limit.append(cpu / (n / 1e9))
        last = {m: v[-1]["rate"] for m, v in res.items()}
        load = os.getloadavg()[0]
        print(f"run {run}: none {last['none']:.3f} steps/s, memory {last['memory']:.3f}, "
              f"load {load:.1f}", flush=True)  # fmt: skip
    rates = {m: [r["rate"] for r in v] for m, v in res.items()}
    gb = a.gib_steps * nbytes / 1e9
    base_bg = med([r["bg_cpu"] for r in res["none"]])
    per_gb = [(r["bg_cpu"] - base_bg) / gb for r in res["memory"]]
    main_extra = [
        (m["main_cpu"] - n["main_cpu"]) / a.gib_steps
        for m, n in zip(res["memory"], res["none"], strict=True)
    ]
    ovh = [1 - m / n for m, n in zip(rates["memory"], rates["none"], strict=True)]
    print(f"\nstate {nbytes / 2**30:.2f} GiB ({a.gib_layers} x Linear({a.gib_dim}) + AdamW), "
          f"batch {a.gib_batch}, {a.gib_steps} timed steps per run, {a.gib_runs} runs each, "
          "interleaved; median [min-max]")  # fmt: skip
    print("| | steps/s | range |\n|---|---:|---:|")
    for m, label in (("none", "no checkpoints"), ("memory", "memory snapshot every step")):
        print(f"| {label} | {med(rates[m]):.3f} | {_range(rates[m], fmt='.3f')} |")
    overall = 100 * (1 - med(rates["memory"]) / med(rates["none"]))
    lo, hi = _median_interval(ovh)
    print(f"\noverhead (1 - median rate ratio): {overall:.1f} %; "
          f"per run pair {_range(ovh, 100, '.1f')} %; paired median {100 * med(ovh):.1f} %, "
          f"95 % bootstrap interval of it {100 * lo:.1f} to {100 * hi:.1f} %")  # fmt: skip
    print(f"background CPU per GB snapshotted: {med(per_gb):.3f} s/GB "
          f"[{_range(per_gb, fmt='.3f')}]; copy + XXH3 limit {med(limit):.3f} s/GB "
          f"[{_range(limit, fmt='.3f')}]; "
          f"ratio {med(per_gb) / med(limit):.2f}x")  # fmt: skip
    print(f"training thread's extra CPU per step with snapshots: {med(main_extra) * 1e3:.1f} ms "
          f"[{_range(main_extra, 1e3)}]; background CPU per step without checkpoints "
          f"{base_bg / a.gib_steps * 1e3:.1f} ms")  # fmt: skip


def _median_interval(xs: list[float], draws: int = 10_000) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of the median of ``xs`` (seeded: reruns agree).

    The paired runs' overheads swing ±10 % with the box, far more than the effect; the
    interval says whether enough pairs ran to tell the median from a goal such as 3 %.
    """
    rng = random.Random(25)
    meds = sorted(med(rng.choices(xs, k=len(xs))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


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
    ap.add_argument("--gib-layers", type=int, default=0, help="part 3 only, with this many")
    ap.add_argument("--gib-dim", type=int, default=2048)
    ap.add_argument("--gib-batch", type=int, default=64)
    ap.add_argument("--gib-steps", type=int, default=10)
    ap.add_argument("--gib-runs", type=int, default=7)
    args = ap.parse_args()
    if args.gib_layers:
        torch.set_num_threads(1)
        print(f"machine: nproc={os.cpu_count()}, load {os.getloadavg()[0]:.2f}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")  # fmt: skip
        every_step_gib(args)
        print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")
        return
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
