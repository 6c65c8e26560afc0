"""How fast training runs while an async save writes in the background, by how packs are copied.

A pack's bytes are copied into page-aligned buffers before each O_DIRECT write
(``storage/direct_io.py``), on the writer thread of an async save. The copy now releases the
GIL (``direct_io._copy``, numpy); before, a memoryview slice copy held it for each 8 MiB. This
runs both in one process, alternated (order flipping every round): a small MLP trains on the
main thread (one compute thread, a Python-bound step of a few ms) while ``save_async`` of
``--tensors`` x 64 MiB of float32 (every 16 MiB chunk changed before each save, so nothing
deduplicates) writes to ``--dir``. Per save: steps/s during the save over steps/s alone just
before it, the time to committed, and the blocking time. Medians [ranges] of ``--rounds``.

    OMP_NUM_THREADS=1 .venv/bin/python bench/background_save_bench.py --rounds 10

Bounded by: 2 cores shared by the training thread, the writer thread and the hashing pool.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import stalwart.storage.direct_io as direct_io
from stalwart.checkpoint import Checkpointer


def _holding_gil(dest: memoryview, src: memoryview) -> None:
    dest[:] = src  # the copy before: a memoryview slice copy, GIL held throughout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=16, help="64 MiB float32 tensors saved")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--dir", default=None, help="where to save (default: a temp dir)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(16 << 20) for i in range(a.tensors)}
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.ReLU())])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 256)

    def step() -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    def steps_per_s(seconds: float) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            step()
            n += 1
        return n / (time.perf_counter() - t0)

    base = Path(a.dir or tempfile.mkdtemp(prefix="stalwart-bgsave-")) / "root"
    shutil.rmtree(base, ignore_errors=True)
    releasing = direct_io._copy
    variants = {
        "copy releases the GIL (now)": releasing,
        "copy holds the GIL (before)": _holding_gil,
    }
    res: dict[str, list[tuple[float, float, float]]] = {k: [] for k in variants}
    with Checkpointer(base) as ck:
        ck.save_async(0, state).wait()  # warm-up: buffers and threads
        k = 1
        for r in range(a.rounds):
            for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
                direct_io._copy = variants[name]  # type: ignore[assignment]
                for t in state.values():
                    t[:: 4 << 20] += 1.0  # one element in every 16 MiB chunk changes
                for old in ck.steps()[:-1]:
                    ck.delete(old)
                alone = steps_per_s(1.0)
                t0 = time.perf_counter()
                pending = ck.save_async(k, state)
                blocking = time.perf_counter() - t0
                k += 1
                n = 0
                while not pending.done():
                    step()
                    n += 1
                pending.wait()
                took = time.perf_counter() - t0
                res[name].append((n / took / alone, took, blocking))
        direct_io._copy = releasing
    shutil.rmtree(base, ignore_errors=True)
    print(
        f"{a.tensors * 64} MiB saved in the background, {a.rounds} saves each way, medians [ranges]"
    )
    print(
        "| pack copy | training speed during the save / alone | to committed (s) | blocking (s) |"
    )
    print("|---|---|---|---|")
    for name, rows in res.items():
        cols = [[row[i] for row in rows] for i in range(3)]
        cells = [f"{statistics.median(c):.2f} [{min(c):.2f}-{max(c):.2f}]" for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
