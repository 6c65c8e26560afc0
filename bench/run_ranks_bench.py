"""How long a gloo world takes to start, run one all-reduce and finish: run_ranks against spawn.

    nice -n 5 .venv/bin/python bench/run_ranks_bench.py [--worlds 2 4] [--repeats 5]

The peer is ``torch.multiprocessing.start_processes(..., start_method="spawn")``, the way
PyTorch's own multi-process tests and most users' start ranks: each rank a new interpreter
that imports torch, joins a gloo group through a ``FileStore`` and all-reduces one tensor.
``run_ranks`` does the same work in ranks forked by a forkserver that imported torch once.
Its first call pays the forkserver's start (one ``import torch``) and is shown apart; the
table quotes the later calls. Contenders are interleaved per repeat; medians and ranges.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stalwart.testing import run_ranks


def _reduce(rank: int, world: int) -> int:
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


def _spawned(rank: int, world: int, store_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    assert _reduce(rank, world) == world
    dist.destroy_process_group()


def with_spawn(world: int) -> float:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "store")
        mp.start_processes(_spawned, (world, path), nprocs=world, start_method="spawn")
    return time.perf_counter() - t0


def with_run_ranks(world: int) -> float:
    t0 = time.perf_counter()
    assert run_ranks(_reduce, world) == [world] * world
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    first = with_run_ranks(a.worlds[0])
    print(f"run_ranks first call (forkserver start included), world {a.worlds[0]}: {first:.2f} s")
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(a.repeats):
        for world in a.worlds:
            for name, fn in (("spawn", with_spawn), ("run_ranks", with_run_ranks)):
                times.setdefault((name, world), []).append(fn(world))
    print("| world | spawn, s median (range) | run_ranks, s median (range) | spawn / run_ranks |")
    print("|---|---|---|---|")
    for world in a.worlds:
        s, r = times["spawn", world], times["run_ranks", world]
        ms, mr = statistics.median(s), statistics.median(r)
        print(
            f"| {world} | {ms:.2f} ({min(s):.2f}-{max(s):.2f}) | {mr:.2f} ({min(r):.2f}-"
            f"{max(r):.2f}) | {ms / mr:.1f}x |"
        )


if __name__ == "__main__":
    main()
