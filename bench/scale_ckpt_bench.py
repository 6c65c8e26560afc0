"""Checkpoints at a real job's shard size: 4 ranks, >= 8 GiB, save, load, reshard, peak memory.

Issue 25's fourth measure, side by side in one run: stalwart (``Checkpointer``), DCP
(``dcp.save``/``dcp.load`` with ``get_state_dict``/``set_state_dict``, its documented recipe) and
ByteCheckpoint 0.0.2 (``bytecheckpoint.save/load(..., framework="fsdp2")`` with
``fast_saving``/``fast_loading``, its documented fast paths; a bench-only peer, installed as
``docs/benchmarks.md`` says).

The state: ``--layers`` x ``Linear(dim, dim, bias=False)`` + AdamW moments, FSDP2
(``fully_shard`` per layer) on a 4-rank gloo mesh; 43 x 4096 is 8.0 GiB in all (2.0 GiB a rank).
It is built on the meta device and filled in place with values that are a function of each
element's global position (``_fill``), so any rank can check any load bit for bit, chunk by
chunk, without a second copy in memory: this is what lets 8 GiB fit next to the loads.

Phase 1, 4 ranks: ``--rounds`` rounds; in each the contenders save (order rotating) and then load
back into a zeroed state, page cache dropped before each timed load (root only; otherwise said),
the slowest rank's time barrier to barrier. Peak memory: each rank samples its own resident set
every 5 ms during the operation; the figure is the largest rank's rise above its level before.
Phase 2, 2 ranks (a resharding load: 4 shards per tensor on disk, 2 in memory): each contender
loads the phase-1 checkpoint it wrote, checked bit for bit the same way.

    .venv/bin/python bench/scale_ckpt_bench.py --layers 43 --dim 4096 --rounds 3

Bounded by: one virtio disk (each contender writes 8 GiB per save), 2 shared cores for 4 ranks,
gloo over loopback for DCP's and ByteCheckpoint's planning collectives.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dist_load_bench as dlb  # DCP's recipe, the cold-cache timer

from stalwart.checkpoint import Checkpointer

NAMES = ["stalwart", "dcp", "bytecheckpoint"]
ROWS = 1 << 20  # elements generated at a time by the checks


def _build(layers: int, dim: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # AdamW's state without a step: the moments, filled below
        opt.state[p] = {"step": torch.tensor(7.0), "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p)}  # fmt: skip
    _fill(model, opt)
    return model, opt


def _tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[tuple[int, Any]]:
    """(tensor id, DTensor) for every parameter and moment, the same ids on every layout."""
    out = []
    for k, p in enumerate(model.parameters()):
        out.append((3 * k, p))
        out += [(3 * k + 1, opt.state[p]["exp_avg"]), (3 * k + 2, opt.state[p]["exp_avg_sq"])]
    return out


def _span(t: Any) -> tuple[torch.Tensor, int]:
    """The local shard (flat) and its first element's global index (FSDP2 shards dim 0)."""
    local = t.to_local()
    rows = -(-t.shape[0] // dist.get_world_size())
    return local.view(-1), dist.get_rank() * rows * t.shape[1]


def _values(tid: int, start: int, n: int) -> torch.Tensor:
    idx = torch.arange(start, start + n, dtype=torch.float64)
    return torch.sin(idx * (1e-3 + tid * 1e-5) + tid).to(torch.float32)


def _fill(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for tid, t in _tensors(model, opt):
            flat, first = _span(t)
            for s in range(0, flat.numel(), ROWS):
                n = min(ROWS, flat.numel() - s)
                flat[s : s + n] = _values(tid, first + s, n)


def _check(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for tid, t in _tensors(model, opt):
        flat, first = _span(t)
        for s in range(0, flat.numel(), ROWS):
            n = min(ROWS, flat.numel() - s)
            if not torch.equal(flat[s : s + n], _values(tid, first + s, n)):
                raise AssertionError(f"tensor {tid}: a load did not restore the saved values")


def _zero(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for _, t in _tensors(model, opt):
            t.to_local().zero_()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak(fn: Callable[[], Any]) -> int:
    """Run ``fn``; the largest rise of this process's resident set above its level before."""
    base, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            done.wait(0.005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        fn()
    finally:
        done.set()
        th.join()
    return max(peak[0], _rss()) - base


def _bcp(op: str, model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    import bytecheckpoint as bcp

    state = {"model": model, "optimizer": opt}
    if op == "save":
        bcp.save(path, state, framework="fsdp2", fast_saving=True)
    else:
        bcp.load(path, state, framework="fsdp2", fast_loading=True)


def _op(name: str, op: str, model: nn.Module, opt: torch.optim.Optimizer, where: Path) -> None:
    if name == "stalwart":
        with Checkpointer(where) as ck:
            state = {"model": model, "optim": opt}
            ck.save(1, state) if op == "save" else ck.load(state)
    elif name == "dcp":
        (dlb._dcp_save if op == "save" else dlb._dcp_load)(model, opt, str(where))
    else:
        _bcp(op, model, opt, str(where))


def _timed_op(rank: int, name: str, op: str, model: nn.Module, opt: Any, where: Path) -> Any:
    peak: list[int] = []

    def run() -> None:
        peak.append(_peak(lambda: _op(name, op, model, opt, where)))

    if op == "load":
        _zero(model, opt)
        t, _ = dlb._timed(rank, run)
    else:
        dist.barrier()
        t0 = time.perf_counter()
        run()
        dist.barrier()
        t = time.perf_counter() - t0
    times = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(times, torch.tensor([t], dtype=torch.float64))
    peaks = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor([peak[0]], dtype=torch.int64))
    if op == "load":
        _check(model, opt)
    return max(float(x) for x in times), max(int(x) for x in peaks)


def _where(base: str, name: str, rnd: int) -> Path:
    return Path(base) / f"{name}-r{rnd}"


def save_and_load(rank: int, world: int, base: str, layers: int, dim: int, rounds: int) -> Any:
    model, opt = _build(layers, dim)
    nbytes = sum(t.to_local().numel() * 4 for _, t in _tensors(model, opt))
    res: dict[str, Any] = {
        n: {"save": [], "load": [], "save_mem": [], "load_mem": []} for n in NAMES
    }
    for rnd in range(rounds):
        order = NAMES[rnd % 3 :] + NAMES[: rnd % 3]
        for name in order:
            where = _where(base, name, rnd)
            if rank == 0 and rnd > 0:  # keep only the newest round's checkpoint of each
                shutil.rmtree(_where(base, name, rnd - 1), ignore_errors=True)
            dist.barrier()
            t, m = _timed_op(rank, name, "save", model, opt, where)
            res[name]["save"].append(t)
            res[name]["save_mem"].append(m)
        for name in order:
            t, m = _timed_op(rank, name, "load", model, opt, _where(base, name, rnd))
            res[name]["load"].append(t)
            res[name]["load_mem"].append(m)
        if rank == 0:
            print(f"round {rnd}: " + ", ".join(
                f"{n} save {res[n]['save'][-1]:.1f}s load {res[n]['load'][-1]:.1f}s"
                for n in order), flush=True)  # fmt: skip
    total = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(total, torch.tensor([nbytes], dtype=torch.int64))
    res["bytes"] = sum(int(x) for x in total)
    return res


def reshard(rank: int, world: int, base: str, layers: int, dim: int, rounds: int) -> Any:
    model, opt = _build(layers, dim)
    res: dict[str, Any] = {n: {"load": [], "load_mem": []} for n in NAMES}
    for rnd in range(rounds):
        order = NAMES[rnd % 3 :] + NAMES[: rnd % 3]
        for name in order:
            t, m = _timed_op(rank, name, "load", model, opt, _where(base, name, rounds - 1))
            res[name]["load"].append(t)
            res[name]["load_mem"].append(m)
    return res


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def report(first: dict[str, Any], second: dict[str, Any], rounds: int) -> None:
    gib = first["bytes"] / 2**30
    drop = os.access("/proc/sys/vm/drop_caches", os.W_OK)
    print(f"\nstate {gib:.2f} GiB over 4 ranks; page cache dropped before each load: {drop}; "
          f"{rounds} rounds, medians [ranges], s; memory = largest rank's rise, GiB")  # fmt: skip
    rows = [("save, 4 ranks", first, "save"), ("load, 4 ranks", first, "load"),
            ("reshard load 4 -> 2 ranks", second, "load")]  # fmt: skip
    print("\n| | " + " | ".join(NAMES) + " | stalwart / best peer |")
    print("|---|" + "---|" * (len(NAMES) + 1))
    for label, res, key in rows:
        meds = {n: statistics.median(res[n][key]) for n in NAMES}
        best = min(meds[n] for n in NAMES if n != "stalwart")
        cells = " | ".join(_fmt(res[n][key]) for n in NAMES)
        print(f"| {label} (s) | {cells} | {meds['stalwart'] / best:.2f}x |")
        mems = " | ".join(f"{statistics.median(res[n][key + '_mem']) / 2**30:.2f}" for n in NAMES)
        print(f"| {label}, peak memory rise per rank (GiB) | {mems} | |")


def _torchrun(body: str, world: int, a: argparse.Namespace, base: str) -> Any:
    """Ranks under torchrun (ByteCheckpoint starts a server process: no daemonic parents)."""
    out = Path(base) / f"{body}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
           f"--master-port={_free_port()}", __file__,
           "--body", body, "--layers", str(a.layers), "--dim", str(a.dim),
           "--rounds", str(a.rounds), "--base", base, "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # ByteCheckpoint logs every phase at INFO: keep the rest
        if not line.startswith("[20"):
            print(line, end="", flush=True)
    if proc.wait() != 0:
        raise SystemExit(f"{body} failed (exit {proc.returncode}); its output is above")
    return json.loads(out.read_text())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(a: argparse.Namespace) -> None:
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=3600))
    torch.set_num_threads(1)
    body = {"save_and_load": save_and_load, "reshard": reshard}[a.body]
    res = body(dist.get_rank(), dist.get_world_size(), a.base, a.layers, a.dim, a.rounds)
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--body", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--base", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.body:
        _rank_main(a)
        return
    try:
        import bytecheckpoint  # noqa: F401
    except ImportError:
        sys.exit("ByteCheckpoint is not installed: see docs/benchmarks.md (bench-only peer)")
    base = tempfile.mkdtemp(prefix="scale_ckpt_", dir=a.dir)
    try:
        first = _torchrun("save_and_load", 4, a, base)
        second = _torchrun("reshard", 2, a, base)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(base)
    report(first, second, a.rounds)


if __name__ == "__main__":
    main()
