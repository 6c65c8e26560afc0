"""Where a lazy save's blocking time goes on the training thread, stage by stage.

The training loop of ``bench/async_bench.py`` (4x512 MLP + AdamW, 12.6 MB of state) is saved
200 times without any background work, timing each stage of what ``save_async`` does before
it returns: the state dicts, ``flatten`` (values read now), the local boxes, the guarded
optimizer's storages, and ``stage`` (layout plus eager copies). Medians in ms; the step of
the same loop is printed for scale.

    .venv/bin/python bench/save_path_profile.py --saves 200

``--first-save N``: where the first ``save_async`` of a new ``Checkpointer`` spends its time
against a steady one, on 2 gloo ranks (``run_ranks``), the same FSDP2 and DDP states as
``bench/dist_load_bench.py`` (``--layers`` x ``Linear(--dim)`` + AdamW): N rounds, each a
new Checkpointer of one root (built, its first step check, its background group, the call)
and a reused one, interleaved; slowest rank, medians in ms.

    .venv/bin/python bench/save_path_profile.py --first-save 9 --layers 21 --dim 2048
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stalwart.checkpoint.capture import HostBuffer, optimizer_storages, stage
from stalwart.checkpoint.durable.plan import local_items
from stalwart.tree import flatten

PARTS = ("build", "step check", "background group", "save_async rest", "total")
FAULTS = "page faults (thousands)"


def first_save_ranks(
    rank: int, world: int, base: str, layers: int, dim: int, n: int, layouts: list[str]
) -> Any:
    """Per-part times of a new Checkpointer's first save_async against a reused one."""
    import dist_load_bench as dlb

    from stalwart.checkpoint import Checkpointer

    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for layout in layouts:
        model, opt = dlb._model(layers, dim, layout == "fsdp2")
        state = {"model": model, "optim": opt}
        root = Path(base) / layout
        reused = Checkpointer(root / "reused")
        reused.save_async(0, state).wait()  # its own first save, not counted
        res: dict[str, dict[str, list[float]]] = {k: {p: [] for p in (*PARTS, FAULTS)}
                                                  for k in ("first", "steady")}  # fmt: skip
        for r in range(n):
            for kind in sorted(res, reverse=r % 2 == 1):
                dist.barrier()
                t0 = time.perf_counter()
                ck = Checkpointer(root / "per_save") if kind == "first" else reused
                t1 = time.perf_counter()
                ck._async_saves.check_new_step(r + 1)  # what save_async does first
                t2 = time.perf_counter()
                ck._async_saves.background_group()
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t3 = time.perf_counter()
                p = ck.save_async(r + 1, state)  # checks again (free now), flattens, copies
                t4 = time.perf_counter()
                faults = [0] * world
                dist.all_gather_object(
                    faults, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
                )
                res[kind][FAULTS].append(max(faults) / 1e3 / 1e3)  # printed x1e3 below
                for part, v in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0),
                                   strict=True):  # fmt: skip
                    got = [0.0] * world
                    dist.all_gather_object(got, v)
                    res[kind][part].append(max(got))
                p.wait()
                if ck is not reused:
                    ck.close()
        reused.close()
        out[layout] = res
        del model, opt, state
    return out


def first_save(a: argparse.Namespace) -> None:
    import sys

    from stalwart.testing import run_ranks

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    base = tempfile.mkdtemp(prefix="first_save_")
    try:
        res = run_ranks(first_save_ranks, 2, base, a.layers, a.dim, a.first_save,
                        a.layouts.split(","), timeout_s=1800)[0]  # fmt: skip
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for layout, r in res.items():
        print(f"\n== {layout}: slowest rank, median [range] of {a.first_save}, ms")
        for part in (*PARTS, FAULTS):
            cells = "  ".join(
                f"{k} {statistics.median(r[k][part]) * 1e3:7.1f} "
                f"[{min(r[k][part]) * 1e3:.1f}-{max(r[k][part]) * 1e3:.1f}]"
                for k in r
            )
            print(f"  {part:18s} {cells}")
        first, steady = (statistics.median(r[k]["total"]) for k in ("first", "steady"))
        pairs = sorted(f / s for f, s in zip(r["first"]["total"], r["steady"]["total"],
                                             strict=True))  # fmt: skip
        q = len(pairs) // 4
        print(f"  first / steady: {first / steady:.2f}x (medians); per round, paired: median "
              f"{statistics.median(pairs):.2f}x, middle half {pairs[q]:.2f}-{pairs[-q - 1]:.2f}x, "
              f"rounds over 1.2x: {sum(x > 1.2 for x in pairs)} of {len(pairs)}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=200)
    ap.add_argument("--first-save", type=int, default=0, help="rounds of the 2-rank mode")
    ap.add_argument("--layers", type=int, default=21)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layouts", default="fsdp2,ddp", help="of --first-save: fsdp2, ddp")
    args = ap.parse_args()
    if args.first_save:
        first_save(args)
        return
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
