"""Where a lazy save's blocking time goes on the training thread, stage by stage.

The training loop of ``bench/async_bench.py`` (4x512 MLP + AdamW, 12.6 MB of state) is saved
200 times without any background work, timing each stage of what ``save_async`` does before
it returns: the state dicts, ``flatten`` (values read now), the local boxes, the guarded
optimizer's storages, and ``stage`` (layout plus eager copies). Medians in ms; the step of
the same loop is printed for scale.

    .venv/bin/python bench/save_path_profile.py --saves 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from stalwart.checkpoint.capture import HostBuffer, optimizer_storages, stage
from stalwart.checkpoint.durable.plan import local_items
from stalwart.tree import flatten


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=200)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(
        *[m for _ in range(4) for m in (torch.nn.Linear(512, 512), torch.nn.GELU())],
        torch.nn.Linear(512, 10),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(512, 512), torch.randint(0, 10, (512,))
    steps = []
    for _ in range(20):
        t = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        steps.append(time.perf_counter() - t)
    times: dict[str, list[float]] = {
        k: [] for k in ("state_dict", "flatten", "boxes", "defer", "stage")
    }
    buffer = HostBuffer()
    for _ in range(args.saves):
        t0 = time.perf_counter()
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        t1 = time.perf_counter()
        flat = flatten(state)
        t2 = time.perf_counter()
        items = local_items(flat)
        t3 = time.perf_counter()
        defer = optimizer_storages([opt])
        t4 = time.perf_counter()
        stage(items, buffer, defer=defer)
        t5 = time.perf_counter()
        for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            times[k].append(v)
    total = sum(statistics.median(v) for v in times.values())
    print(f"{len(items)} boxes; training step median {statistics.median(steps) * 1e3:.1f} ms")
    for k, v in times.items():
        lo, hi = min(v) * 1e3, max(v) * 1e3
        print(f"  {k:10s} {statistics.median(v) * 1e3:.3f} ms  ({lo:.3f}-{hi:.3f})")
    print(f"  total      {total * 1e3:.3f} ms = {total / statistics.median(steps):.1%} of a step")


if __name__ == "__main__":
    main()
