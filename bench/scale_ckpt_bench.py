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
Phase 2, 2 ranks, then 1 rank (resharding loads: 4 shards per tensor on disk, 2 or 1 in
memory): each contender loads the phase-1 checkpoint it wrote, checked bit for bit the same way.
Phase 3, 4 ranks, asynchronous saves: one process per contender and round (order rotating), so
each rank's memory rise is that contender's alone. Each saves twice, a warm-up and the timed
save, in its documented steady configuration: stalwart ``save_async`` on one Checkpointer (the
warm-up step deleted and collected first, so nothing deduplicates), unbounded and with
``max_staging_bytes=--cap-mib``; DCP ``dcp.async_save`` with one persistent ``DefaultStager``
(CPU options) on a gloo group of its own; ByteCheckpoint ``save(fast_saving=True)``, done when
its completion callback fires (its first save of a state is synchronous). Blocking time: the
call, slowest rank; to committed: until every rank's data and the commit are written; peak
memory: the largest rank's resident-set rise over both saves, above its level before them.
With ``--fresh-reshards`` phase 2 runs one process per contender and round as well (order
rotating), each load the first of its process, as a job resumed on fewer ranks loads: in one
process, a contender's load can pay for what an earlier one left there (the 1-rank reshard ran
0.33-0.34 s where stalwart loaded first in its round and 0.46-0.65 s after ByteCheckpoint's).

    .venv/bin/python bench/scale_ckpt_bench.py --layers 43 --dim 4096 --rounds 3

The same phase 1 at other shapes (issue 25's first measure, DDP and FSDP2 loads at 2 and 4
ranks): ``--layout ddp`` keeps the model whole on every rank (replicated, as DDP does;
ByteCheckpoint with ``framework="ddp"``), ``--world`` sets the ranks; phases 2 and 3 run only
for FSDP2 on 4 ranks.

    .venv/bin/python bench/scale_ckpt_bench.py --layout ddp --world 2 --layers 21 --dim 2048 \
        --rounds 5

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
from stalwart.checkpoint.durable.chunk_ref import ChunkRef, chunk_hash
from stalwart.storage.local import MAP_READS as ORIGINAL_MAP_READS

NAMES = ["stalwart", "dcp", "bytecheckpoint"]
B_SIDE = "stalwart_b"  # --map-ab / --check-ab: stalwart's checkpoint loaded again, differently
CHECKED_BY_XXH3 = ChunkRef.matches  # --check-ab's A side (format 3); B checks BLAKE3 names
MAP_MODES = {"always": True, "never": False}  # --map-ab: storage.local.MAP_READS of the B side
ASYNC = ["stalwart", "stalwart_capped", "dcp", "bytecheckpoint"]
Done = Callable[[], None]
ROWS = 1 << 20  # elements generated at a time by the checks


LAYOUT: dict[str, Any] = {"layout": "fsdp2", "map_ab": None, "check_ab": False}  # from argv


def _loaders() -> list[str]:
    """The loads of a round: the contenders, and stalwart's B side under an A/B option."""
    return [*NAMES, B_SIDE] if LAYOUT["map_ab"] or LAYOUT["check_ab"] else list(NAMES)


def _by_name(ref: ChunkRef, raw: Any, *, audit: bool = False) -> bool:
    """--check-ab's B side: a chunk checked by its BLAKE3 name, as formats 1 and 2 load."""
    return len(memoryview(raw)) == ref.nbytes and chunk_hash(raw) == ref.hash


def _rotated(names: list[str], rnd: int) -> list[str]:
    """``names`` in round ``rnd``'s order: each starts a round in turn."""
    k = rnd % len(names)
    return names[k:] + names[:k]


def _build(layers: int, dim: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    if LAYOUT["layout"] == "fsdp2":
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
    if not hasattr(t, "to_local"):  # replicated: the whole tensor on every rank
        return t.detach().view(-1), 0
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
            _span(t)[0].zero_()


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
        bcp.save(path, state, framework=LAYOUT["layout"], fast_saving=True)
    else:
        bcp.load(path, state, framework=LAYOUT["layout"], fast_loading=True)


def _op(name: str, op: str, model: nn.Module, opt: torch.optim.Optimizer, where: Path) -> None:
    if name in ("stalwart", B_SIDE):
        from stalwart.storage import local

        # the A/Bs of issue 25: page-cache maps or buffers; XXH3-128 checks or BLAKE3 names.
        # stalwart itself keeps the defaults
        b_map = name == B_SIDE and LAYOUT["map_ab"]
        local.MAP_READS = MAP_MODES[LAYOUT["map_ab"]] if b_map else ORIGINAL_MAP_READS
        b_check = name == B_SIDE and LAYOUT["check_ab"]
        ChunkRef.matches = _by_name if b_check else CHECKED_BY_XXH3  # type: ignore[method-assign]
        with Checkpointer(where) as ck:
            state = {"model": model, "optim": opt}
            ck.save(1, state) if op == "save" else ck.load(state)
    elif name == "dcp":
        (dlb._dcp_save if op == "save" else dlb._dcp_load)(model, opt, str(where))
    else:
        _bcp(op, model, opt, str(where))


def _disk_read(where: Path) -> int:
    """Bytes the block device holding ``where`` has read since boot (every process's)."""
    dev = os.stat(where if where.exists() else where.parent).st_dev
    with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat") as f:
        return int(f.read().split()[2]) * 512


def _timed_op(rank: int, name: str, op: str, model: nn.Module, opt: Any, where: Path) -> Any:
    """(seconds, peak memory rise, bytes the disk read) of one operation, over the ranks."""
    peak: list[int] = []
    disk = [0]

    def run() -> None:
        if rank == 0:  # after the page cache was dropped and the ranks met
            disk[0] = -_disk_read(where)
        peak.append(_peak(lambda: _op(name, op, model, opt, where)))

    if op == "load":
        _zero(model, opt)
        t, _ = dlb._timed(rank, run)
        if rank == 0:  # every rank has finished: the barrier ended the timing
            disk[0] += _disk_read(where)
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
    return max(float(x) for x in times), max(int(x) for x in peaks), disk[0]


def _where(base: str, name: str, rnd: int) -> Path:
    return Path(base) / f"{'stalwart' if name == B_SIDE else name}-r{rnd}"


def save_and_load(rank: int, world: int, base: str, layers: int, dim: int, rounds: int) -> Any:
    model, opt = _build(layers, dim)
    nbytes = sum(_span(t)[0].numel() * 4 for _, t in _tensors(model, opt))
    keys = ("save", "load", "save_mem", "load_mem", "load_disk")
    res: dict[str, Any] = {n: {k: [] for k in keys} for n in _loaders()}
    for rnd in range(rounds):
        order = _rotated(NAMES, rnd)
        loads = _rotated(_loaders(), rnd)
        for name in order:
            where = _where(base, name, rnd)
            if rank == 0 and rnd > 0:  # keep only the newest round's checkpoint of each
                shutil.rmtree(_where(base, name, rnd - 1), ignore_errors=True)
            dist.barrier()
            t, m, _ = _timed_op(rank, name, "save", model, opt, where)
            res[name]["save"].append(t)
            res[name]["save_mem"].append(m)
        for name in loads:
            t, m, d = _timed_op(rank, name, "load", model, opt, _where(base, name, rnd))
            res[name]["load"].append(t)
            res[name]["load_mem"].append(m)
            res[name]["load_disk"].append(d)
        if rank == 0:
            print(f"round {rnd}: " + ", ".join(
                f"{n} save {res[n]['save'][-1]:.1f}s load {res[n]['load'][-1]:.2f}s"
                for n in order)
                + (f", B load {res[B_SIDE]['load'][-1]:.1f}s" if B_SIDE in res else ""),
                flush=True)  # fmt: skip
    total = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(total, torch.tensor([nbytes], dtype=torch.int64))
    res["bytes"] = sum(int(x) for x in total)
    return res


def reshard(rank: int, world: int, base: str, layers: int, dim: int, rounds: int) -> Any:
    model, opt = _build(layers, dim)
    res: dict[str, Any] = {n: {"load": [], "load_mem": [], "load_disk": []} for n in _loaders()}
    for rnd in range(rounds):
        for name in _rotated(_loaders(), rnd):
            t, m, d = _timed_op(rank, name, "load", model, opt, _where(base, name, rounds - 1))
            res[name]["load"].append(t)
            res[name]["load_mem"].append(m)
            res[name]["load_disk"].append(d)
        if rank == 0:
            order = _rotated(_loaders(), rnd)
            print(f"reshard to {world}, round {rnd}: " + ", ".join(
                f"{n} load {res[n]['load'][-1]:.2f}s" for n in order), flush=True)  # fmt: skip
    return res


def reshard_one(rank: int, world: int, base: str, layers: int, dim: int, a: Any) -> Any:
    """--fresh-reshards: one contender's resharding load, the first of a fresh process (as a
    job resumed on fewer ranks loads once), so no other contender ran in it before."""
    model, opt = _build(layers, dim)
    t, m, d = _timed_op(rank, a.contender, "load", model, opt, _where(base, a.contender,
                        a.rounds - 1))  # fmt: skip
    if rank == 0:
        print(f"fresh reshard to {world}, round {a.round}: {a.contender} load {t:.2f}s",
              flush=True)  # fmt: skip
    return {"load": t, "load_mem": m, "load_disk": d}


def _fresh_reshards(world: int, a: argparse.Namespace, base: str) -> dict[str, Any]:
    """Every contender's resharding loads, one process each, order rotating by round."""
    res: dict[str, Any] = {n: {"load": [], "load_mem": [], "load_disk": []} for n in _loaders()}
    for rnd in range(a.rounds):
        for name in _rotated(_loaders(), rnd):
            one = _torchrun("reshard_one", world, a, base, ("--contender", name, "--round",
                            str(rnd)))  # fmt: skip
            for k, v in one.items():
                res[name][k].append(v)
    return res


def _async_save(
    name: str, model: nn.Module, opt: Any, where: Path, cap: int
) -> tuple[
    Callable[[int, Path], Any], Callable[[Any], None], Callable[[], None], Callable[[], None]
]:
    """(start(step, dir), wait(handle), close(), clear()) of contender ``name``'s asynchronous
    save; ``clear`` runs untimed between the warm-up and the timed save."""
    state = {"model": model, "optim": opt}
    if name.startswith("stalwart"):
        from stalwart.checkpoint import CheckpointOptions

        opts = CheckpointOptions(max_staging_bytes=cap if name.endswith("capped") else None)
        ck = Checkpointer(where / "stalwart", opts)

        def start(step: int, _d: Path) -> Any:
            return ck.save_async(step, state)

        def clear() -> None:  # before the timed save, untimed: nothing to deduplicate against
            if dist.get_rank() == 0 and ck.steps():
                for old in ck.steps():
                    ck.delete(old)
                ck.gc(grace_s=0)

        return start, lambda p: p.wait(), ck.close, clear
    if name == "dcp":
        import torch.distributed.checkpoint as dcp
        from async_bench import persistent_stager
        from torch.distributed.checkpoint.state_dict import get_state_dict

        stager, group = persistent_stager(), dist.new_group(backend="gloo")

        def start_dcp(step: int, d: Path) -> Any:
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            return dcp.async_save(sd, checkpoint_id=str(d), async_stager=stager,
                                  process_group=group)  # fmt: skip

        return start_dcp, lambda f: f.result(), stager.close, lambda: None
    import bytecheckpoint as bcp

    done = threading.Event()

    def start_bcp(step: int, d: Path) -> Any:
        done.clear()
        bcp.save(str(d), {"model": model, "optimizer": opt}, framework="fsdp2",
                 fast_saving=True, global_steps=step, callback=done.set,
                 ignore_append_global_steps_to_folder=True)  # fmt: skip

    def wait_bcp(_h: Any) -> None:
        if dist.get_rank() == 0 and not done.wait(1800):  # called on the coordinator
            raise TimeoutError("ByteCheckpoint's save did not complete")

    return start_bcp, wait_bcp, lambda: None, lambda: None


def async_saves(rank: int, world: int, base: str, layers: int, dim: int, a: Any) -> Any:
    """One contender's warm-up and timed asynchronous save (one process, one round)."""
    model, opt = _build(layers, dim)
    where = Path(base) / f"async-{a.contender}-r{a.round}"
    start, wait, close, clear = _async_save(a.contender, model, opt, where, a.cap_mib << 20)
    times: list[float] = []

    def saves() -> None:  # the warm-up and the timed save, sampled together
        wait(start(1, where / "warm"))
        clear()
        dist.barrier()
        t0 = time.perf_counter()
        handle = start(2, where / "timed")
        times.append(time.perf_counter() - t0)
        wait(handle)
        dist.barrier()
        times.append(time.perf_counter() - t0)

    rise = _peak(saves)
    blocked, total = times
    close()
    _check(model, opt)  # the state was not changed by its saves
    figures = torch.tensor([blocked, total, float(rise)],
                           dtype=torch.float64)  # fmt: skip
    out = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(out, figures)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(where, ignore_errors=True)
        print(f"async round {a.round}: {a.contender} blocking {max(float(x[0]) for x in out):.2f}s"
              f" committed {max(float(x[1]) for x in out):.2f}s", flush=True)  # fmt: skip
    return {"blocking": max(float(x[0]) for x in out), "committed": max(float(x[1]) for x in out),
            "mem": max(float(x[2]) for x in out)}  # fmt: skip


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def _report_sync(
    first: dict[str, Any], second: dict[str, Any], third: dict[str, Any], a: argparse.Namespace
) -> None:
    rounds, world = a.rounds, a.world
    gib = first["bytes"] / 2**30 / (world if a.layout == "ddp" else 1)
    drop = os.access("/proc/sys/vm/drop_caches", os.W_OK)
    print(f"\n{a.layout}: state {gib:.2f} GiB over {world} ranks; page cache dropped before each "
          f"load: {drop}; "
          f"{rounds} rounds, medians [ranges], s; memory = largest rank's rise, GiB")  # fmt: skip
    rows = [(f"save, {world} ranks", first, "save"), (f"load, {world} ranks", first, "load"),
            ("reshard load 4 -> 2 ranks", second, "load"),
            ("reshard load 4 -> 1 rank", third, "load")]  # fmt: skip
    rows = [r for r in rows if r[1]]
    print("\n| | " + " | ".join(NAMES) + " | stalwart / best peer (of medians; paired) |")
    print("|---|" + "---|" * (len(NAMES) + 1))
    for label, res, key in rows:
        meds = {n: statistics.median(res[n][key]) for n in NAMES}
        peers = [n for n in NAMES if n != "stalwart"]
        best = min(meds[n] for n in peers)
        # Each round's stalwart time over that round's fastest peer: the disk's pace drifts
        # between rounds far more than between contenders inside one (loads are interleaved)
        mine = res["stalwart"][key]
        paired = [s / min(res[n][key][i] for n in peers) for i, s in enumerate(mine)]
        cells = " | ".join(_fmt(res[n][key]) for n in NAMES)
        print(f"| {label} (s) | {cells} | {meds['stalwart'] / best:.2f}x; paired by round: "
              f"{_fmt(paired)} |")  # fmt: skip
        mems = " | ".join(f"{statistics.median(res[n][key + '_mem']) / 2**30:.2f}" for n in NAMES)
        print(f"| {label}, peak memory rise per rank (GiB) | {mems} | |")
        if key == "load" and "load_disk" in res[NAMES[0]]:
            state = gib * 2**30
            disk = " | ".join(
                f"{statistics.median(res[n]['load_disk']) / state:.3f}" for n in NAMES
            )
            print(f"| {label}, bytes the disk read / state bytes | {disk} | |")
    for label, res, _ in (r for r in rows if B_SIDE in r[1] and r[2] == "load"):
        b_side, a_side = res[B_SIDE]["load"], res["stalwart"]["load"]
        paired = [y / x for y, x in zip(b_side, a_side, strict=True)]
        mode = f"MAP_READS={MAP_MODES[a.map_ab]}" if a.map_ab else "chunks checked by BLAKE3 name"
        best = min(statistics.median(res[n]["load"]) for n in NAMES if n != "stalwart")
        print(f"| {label}, B: {mode} (s) | {_fmt(b_side)}; B / stalwart, paired by "
              f"round: {_fmt(paired)}; B / best peer: "
              f"{statistics.median(b_side) / best:.2f}x |")  # fmt: skip


def report(
    first: dict[str, Any],
    second: dict[str, Any],
    third: dict[str, Any],
    asyncs: dict[str, list[dict[str, float]]],
    a: argparse.Namespace,
) -> None:
    if first:
        _report_sync(first, second, third, a)
    if not any(asyncs.values()):
        return
    print(f"\nasynchronous saves, 4 ranks (stalwart capped: max_staging_bytes={a.cap_mib} MiB)")
    print("\n| | " + " | ".join(ASYNC) + " | stalwart / best peer | capped / best peer |")
    print("|---|" + "---|" * (len(ASYNC) + 2))
    for key, label in (("blocking", "blocking (s)"), ("committed", "to committed (s)"),
                       ("mem", "peak memory rise per rank (GiB)")):  # fmt: skip
        scale = 2**30 if key == "mem" else 1
        xs = {n: [r[key] / scale for r in asyncs[n]] for n in ASYNC}
        meds = {n: statistics.median(v) for n, v in xs.items()}
        best = min(meds["dcp"], meds["bytecheckpoint"])
        ratio = (f"{meds['stalwart'] / best:.2f}x | {meds['stalwart_capped'] / best:.2f}x"
                 if best > 0 else " | ")  # fmt: skip
        print(f"| async save, {label} | " + " | ".join(_fmt(xs[n]) for n in ASYNC)
              + f" | {ratio} |")  # fmt: skip


def _torchrun(
    body: str, world: int, a: argparse.Namespace, base: str, extra: tuple[str, ...] = ()
) -> Any:
    """Ranks under torchrun (ByteCheckpoint starts a server process: no daemonic parents)."""
    out = Path(base) / f"{body}-{world}{'-'.join(('', *extra))}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
           f"--master-port={_free_port()}", __file__,
           "--body", body, "--layers", str(a.layers), "--dim", str(a.dim),
           "--rounds", str(a.rounds), "--base", base, "--out", str(out),
           "--cap-mib", str(a.cap_mib), "--layout", a.layout,
           *(("--map-ab", a.map_ab) if a.map_ab else ()),
           *(("--check-ab",) if a.check_ab else ()), *extra]  # fmt: skip
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
    rank, world = dist.get_rank(), dist.get_world_size()
    LAYOUT["layout"] = a.layout
    LAYOUT["map_ab"] = a.map_ab
    LAYOUT["check_ab"] = a.check_ab
    if a.body == "async_saves":
        res = async_saves(rank, world, a.base, a.layers, a.dim, a)
    elif a.body == "reshard_one":
        res = reshard_one(rank, world, a.base, a.layers, a.dim, a)
    else:
        body = {"save_and_load": save_and_load, "reshard": reshard}[a.body]
        res = body(rank, world, a.base, a.layers, a.dim, a.rounds)
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cap-mib", type=int, default=256, help="stalwart's capped staging, MiB")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--async-only", action="store_true", help="phase 3 alone")
    ap.add_argument("--no-async", action="store_true", help="phases 1 and 2 alone")
    ap.add_argument("--layout", choices=("fsdp2", "ddp"), default="fsdp2")
    ap.add_argument("--world", type=int, default=4, help="ranks of phase 1")
    ap.add_argument(
        "--map-ab",
        choices=sorted(MAP_MODES),
        default=None,
        help="also load stalwart's checkpoint with storage.local.MAP_READS set so (always: "
        "mapped; never: buffered), interleaved with the default load",
    )
    ap.add_argument(
        "--check-ab",
        action="store_true",
        help="also load stalwart's checkpoint checking each chunk by its BLAKE3 name (as "
        "formats 1 and 2 load) instead of its XXH3-128, interleaved with the default load",
    )
    ap.add_argument(
        "--fresh-reshards",
        action="store_true",
        help="phase 2 in a fresh process per contender and round (each load the first of its "
        "process, as a resumed job's), instead of every contender's rounds in one process",
    )
    ap.add_argument("--contender", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
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
        first: dict[str, Any] = {}
        second: dict[str, Any] = {}
        third: dict[str, Any] = {}
        full = a.layout == "fsdp2" and a.world == 4  # reshards and async saves: this shape
        if not a.async_only:
            first = _torchrun("save_and_load", a.world, a, base)
        if not a.async_only and full and a.fresh_reshards:
            second, third = _fresh_reshards(2, a, base), _fresh_reshards(1, a, base)
        elif not a.async_only and full:
            second = _torchrun("reshard", 2, a, base)
            third = _torchrun("reshard", 1, a, base)
        for name in NAMES:  # the loads are done: free the disk for the asynchronous saves
            shutil.rmtree(_where(base, name, a.rounds - 1), ignore_errors=True)
        asyncs: dict[str, list[dict[str, float]]] = {n: [] for n in ASYNC}
        for rnd in range(a.rounds if full and not a.no_async else 0):
            for name in _rotated(ASYNC, rnd):
                extra = ("--contender", name, "--round", str(rnd))
                asyncs[name].append(_torchrun("async_saves", 4, a, base, extra))
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(base)
    report(first, second, third, asyncs, a)


if __name__ == "__main__":
    main()
