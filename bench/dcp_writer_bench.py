"""``dcp.save`` through stalwart's StorageWriter against ``dcp.save`` with DCP's FileSystemWriter.

One process (``no_dist=True``), one synthetic fp32 state of ``--size-mib`` MiB (8 MiB
tensors plus a few small ones and plain values, the same state for every contender), saved
with the same call, ``dcp.save(state, storage_writer=..., no_dist=True)``; only the writer
differs:

``dcp-fs-t1/-t4``  ``FileSystemWriter(sync_files=True, thread_count=1|4)``: DCP's own format.
``stalwart``       ``StalwartWriter(root)``: chunked, BLAKE3-addressed, deduplicated against
                   the root, fsync'd, manifest committed last.

Each repetition saves every contender once, in an order rotated per repetition
(interleaved), into a fresh folder; times are wall-clock from the call to its return (data
durable). Then the incremental case: ~10 % of the bytes (whole tensors, chosen from the
seed) change and each contender saves again next to its first save; DCP rewrites everything,
stalwart writes only the changed chunks. Bytes written are measured on disk (the size of
every file the save created). A bit-exact ``dcp.load`` check of each contender's second save
runs untimed.

Run:  .venv/bin/python bench/dcp_writer_bench.py --size-mib 256 --reps 5 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from stalwart.integrations.dcp import StalwartReader, StalwartWriter

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
TENSOR_MIB = 8


def make_state(size_mib: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    n = max(1, size_mib // TENSOR_MIB)
    state: dict[str, Any] = {
        f"layers.{i}.weight": torch.randn(TENSOR_MIB << 18, generator=g) for i in range(n)
    }
    state["norm.bias"] = torch.randn(4096, generator=g)
    state["train"] = {"step": 100, "lr": 3e-4, "tags": ["bench"]}
    return state


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _dcp_fs(threads: int) -> Callable[[dict[str, Any], Path, int], None]:
    def save(state: dict[str, Any], folder: Path, step: int) -> None:
        writer = FileSystemWriter(folder / f"step-{step}", sync_files=True, thread_count=threads)
        dcp.save(state, storage_writer=writer, no_dist=True)

    return save


_WRITERS: dict[Path, StalwartWriter] = {}


def _stalwart(state: dict[str, Any], folder: Path, step: int) -> None:
    # One writer per root, kept across saves, as a training loop holds it.
    writer = _WRITERS.setdefault(folder, StalwartWriter(folder))
    dcp.save(state, checkpoint_id=step, storage_writer=writer, no_dist=True)


CONTENDERS: dict[str, Callable[[dict[str, Any], Path, int], None]] = {
    "dcp-fs-t1": _dcp_fs(1),
    "dcp-fs-t4": _dcp_fs(4),
    "stalwart": _stalwart,
}


def check(name: str, state: dict[str, Any], folder: Path) -> None:
    target = {k: torch.empty_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    reader: Any = (
        StalwartReader(folder, step=2)
        if name == "stalwart"
        else FileSystemReader(folder / "step-2")
    )
    dcp.load(target, storage_reader=reader, no_dist=True)
    for k, t in target.items():
        if not torch.equal(t, state[k]):
            raise AssertionError(f"{name}: {k} differs after load")


def run(size_mib: int, reps: int, seed: int, tmp: Path) -> dict[str, dict[str, list[float]]]:
    state = make_state(size_mib, seed)
    tensors = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel() > 4096]
    k = max(1, round(len(tensors) / 10))
    changed = tensors[:: max(1, len(tensors) // k)][:k]  # ~10 % of the bytes, spread out
    out: dict[str, dict[str, list[float]]] = {
        n: {"full_s": [], "full_bytes": [], "incr_s": [], "incr_bytes": []} for n in CONTENDERS
    }
    names = list(CONTENDERS)
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            folder = tmp / f"{name}-{rep}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            t0 = time.perf_counter()
            CONTENDERS[name](state, folder, 1)
            out[name]["full_s"].append(time.perf_counter() - t0)
            out[name]["full_bytes"].append(disk_bytes(folder))
            before = out[name]["full_bytes"][-1]
            g = torch.Generator().manual_seed(seed + rep + 1)
            saved = {k: state[k].clone() for k in changed}
            for k in changed:
                state[k].copy_(torch.randn(state[k].shape, generator=g))
            t0 = time.perf_counter()
            CONTENDERS[name](state, folder, 2)
            out[name]["incr_s"].append(time.perf_counter() - t0)
            out[name]["incr_bytes"].append(disk_bytes(folder) - before)
            check(name, state, folder)
            for k, v in saved.items():
                state[k].copy_(v)
            if folder in _WRITERS:
                _WRITERS.pop(folder).close()
            shutil.rmtree(folder, ignore_errors=True)
    return out


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f} to {max(values):.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dcp-writer-bench-", dir=args.dir))
    try:
        res = run(args.size_mib, args.reps, args.seed, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    mib = 1 << 20
    base = statistics.median(res["dcp-fs-t1"]["full_s"])
    base_incr = statistics.median(res["dcp-fs-t1"]["incr_s"])
    print(
        f"dcp.save of {args.size_mib} MiB, {args.reps} interleaved reps, torch {torch.__version__}"
    )
    print(
        "| writer | full save s, median [range] | MiB written | vs dcp-fs-t1 | "
        "incremental (10 % changed) s | MiB written | vs dcp-fs-t1 |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in res.items():
        print(
            f"| {name} | {summary(r['full_s'])} | "
            f"{statistics.median(r['full_bytes']) / mib:.1f} | "
            f"{base / statistics.median(r['full_s']):.2f}x | {summary(r['incr_s'])} | "
            f"{statistics.median(r['incr_bytes']) / mib:.1f} | "
            f"{base_incr / statistics.median(r['incr_s']):.2f}x |"
        )
    print("(vs: speed-up over DCP's FileSystemWriter with one thread; >1 is faster)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": res}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
