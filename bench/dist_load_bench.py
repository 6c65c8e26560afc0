"""Distributed loads, cold cache: stalwart (shared reads on and off) against DCP and torch.load.

Two gloo ranks on this machine (``run_ranks``), one state per layout:

``ddp``    ``--layers`` x ``Linear(dim, dim)`` + AdamW after one step, the same on every rank
           (replicated; 21 x 2048 is 1.06 GB).
``fsdp2``  the same model with ``fully_shard`` per layer on a CPU mesh: each rank holds half.

Each layout is saved once per contender; then ``--rounds`` rounds, the contenders' loads
interleaved (the order rotates each round). Before every timed load rank 0 drops the page
cache (``echo 3 > /proc/sys/vm/drop_caches``; without root it says so and the figures are
warm), then a barrier; the time is the slowest rank's, barrier to barrier. Every load is
checked bit-exact against the saved values (untimed).

Contenders: ``stalwart`` (``Checkpointer.load``, every chunk verified, replicated boxes read
once by the group and passed through /dev/shm files), ``stalwart-gloo`` (the same passed by
gloo broadcasts, as across hosts), ``stalwart-solo`` (the same with ``SHARED_READS = False``:
every rank reads all it holds, the pre-issue-25 path), ``dcp`` (``dcp.save``/``dcp.load`` with
``get_state_dict``/``set_state_dict``, the documented recipe; its default planner
deduplicates replicated tensors at save), ``torch`` (ddp only: rank 0 ``torch.save``s the
state dicts, every rank ``torch.load``s the file and loads it).

Bytes read per node: the sum over ranks of stalwart's ``LoadResult.bytes_read`` (reads it
issued to storage) against the checkpoint's unique stored bytes.

Components (same rounds, cold cache): ``disk`` (the ranks read the packs' bytes, split
between them, 4 MiB reads), ``hash`` (BLAKE3 of each rank's half), ``bcast`` (gloo broadcast
of each rank's half to the other). Then first vs steady ``save_async`` blocking: a new
Checkpointer per save against one reused, interleaved, ``wait()`` after each.

Run:  .venv/bin/python bench/dist_load_bench.py --layers 21 --dim 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stalwart.checkpoint import Checkpointer
from stalwart.checkpoint.durable import shared_read
from stalwart.checkpoint.durable.manifest import Manifest, manifest_key
from stalwart.checkpoint.durable.persist import chunk_hash
from stalwart.testing import run_ranks


def _model(layers: int, dim: int, fsdp: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, dim)).sum().backward()
    opt.step()
    return model, opt


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [_local(p).detach().clone() for p in model.parameters()]
    for st in opt.state.values():
        out += [_local(v).clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def _zero(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for t in _snapshot_refs(model, opt):
            t.zero_()


def _snapshot_refs(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [_local(p).detach() for p in model.parameters()]
    for st in opt.state.values():
        out += [_local(v) for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out


def _check(model: nn.Module, opt: torch.optim.Optimizer, want: list[torch.Tensor]) -> None:
    got = _snapshot(model, opt)
    same = len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert same, "a load did not restore the saved values"


def _cold(rank: int) -> None:
    if rank == 0:
        os.sync()
        with contextlib.suppress(OSError):  # not root: the figures are warm-cache ones
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
    dist.barrier()


def _timed(rank: int, fn: Any) -> tuple[float, Any]:
    _cold(rank)
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out


def _dcp_save(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _dcp_load(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _components(rank: int, world: int, root: Path, g: Any) -> dict[str, float]:
    """Cold read, hash and broadcast of this rank's share of the stalwart packs."""
    packs = sorted((root / "packs").iterdir())
    mine = [p for i, p in enumerate(packs) if i % world == rank]
    bufs: list[bytes] = []

    def read() -> None:
        for p in mine:
            with open(p, "rb", buffering=0) as f:
                while chunk := f.read(4 << 20):
                    bufs.append(chunk)

    t_read, _ = _timed(rank, read)
    t0 = time.perf_counter()
    for b in bufs:
        chunk_hash(memoryview(b))
    t_hash = time.perf_counter() - t0
    mine_t = torch.frombuffer(bytearray(b"".join(bufs)), dtype=torch.uint8)
    bufs.clear()
    every = g.all_gather(mine_t.numel())
    targets = [
        mine_t if r == rank else torch.empty(every[r], dtype=torch.uint8) for r in range(world)
    ]
    dist.barrier()
    t0 = time.perf_counter()  # only the broadcasts, 16 MiB at a time as the load sends them
    works = [
        dist.broadcast(piece, src=r, async_op=True)
        for r in range(world)
        for piece in targets[r].split(16 << 20)
    ]
    for w in works:
        w.wait()
    dist.barrier()
    t_bcast = time.perf_counter() - t0
    return {"disk": t_read, "hash": t_hash, "bcast": t_bcast}


def _load(
    name: str, model: nn.Module, opt: torch.optim.Optimizer, sroot: Path, droot: str, tfile: Path
) -> Any:
    """One contender's load into ``model`` and ``opt``; stalwart's returns its bytes read."""
    if name.startswith("stalwart"):
        shared_read.SHARED_READS = name != "stalwart-solo"
        shared_read.SHM_READS = name != "stalwart-gloo"
        with Checkpointer(sroot) as ck:
            ck.load({"model": model, "optim": opt})
            assert ck.last_load is not None
            return ck.last_load.bytes_read
    if name == "dcp":
        return _dcp_load(model, opt, droot)
    sd = torch.load(tfile, weights_only=True, mmap=False)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    return None


def rank_body(rank: int, world: int, base: str, layers: int, dim: int, rounds: int) -> Any:
    torch.set_num_threads(1)
    from stalwart.checkpoint.collective import resolve_group

    g = resolve_group()
    out: dict[str, Any] = {}
    for layout in ("ddp", "fsdp2"):
        model, opt = _model(layers, dim, layout == "fsdp2")
        want = _snapshot(model, opt)
        root = Path(base) / layout
        sroot, droot = root / "stalwart", str(root / "dcp")
        Checkpointer(sroot).save(1, {"model": model, "optim": opt})
        _dcp_save(model, opt, droot)
        tfile = root / "torch.pt"
        if layout == "ddp" and rank == 0:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tfile)
        dist.barrier()
        names = ["stalwart", "stalwart-gloo", "stalwart-solo", "dcp"]
        names += ["torch"] if layout == "ddp" else []
        times: dict[str, list[float]] = {n: [] for n in names}
        node_bytes: list[int] = []

        for r in range(rounds):
            for i in range(len(names)):
                name = names[(i + r) % len(names)]
                _zero(model, opt)
                fn = functools.partial(_load, name, model, opt, sroot, droot, tfile)
                t, read = _timed(rank, fn)
                times[name].append(max(g.all_gather(t)))
                if name == "stalwart":
                    node_bytes.append(sum(g.all_gather(read)))
                _check(model, opt, want)
        shared_read.SHARED_READS = shared_read.SHM_READS = True
        m = Manifest.from_bytes((sroot / manifest_key(1)).read_bytes())
        unique = sum({(c.pack, c.offset): c.length for c in _chunks(m)}.values())
        comps = [_components(rank, world, sroot, g) for _ in range(rounds)]
        out[layout] = {
            "times": times,
            "node_bytes": node_bytes,
            "unique": unique,
            "components": {k: [max(g.all_gather(c[k])) for c in comps] for k in comps[0]},
        }
        out[layout]["save_async"] = _first_vs_steady(rank, model, opt, root / "async", rounds)
        del model, opt, want
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
    return out


def _chunks(m: Any) -> list[Any]:
    return [c for e in m.tensors.values() for s in e.shards for c in s.chunks]


def _first_vs_steady(
    rank: int, model: nn.Module, opt: torch.optim.Optimizer, root: Path, rounds: int
) -> dict[str, list[float]]:
    """Wall time of the save_async call: a new Checkpointer each save vs one reused.

    The new one's figure includes building it (its root already exists from round 1).
    """
    state = {"model": model, "optim": opt}
    reused = Checkpointer(root / "reused")
    reused.save_async(0, state).wait()  # its own first save, not counted
    res: dict[str, list[float]] = {"first (new Checkpointer)": [], "steady (reused)": []}
    for r in range(rounds):
        for kind in sorted(res, reverse=r % 2 == 1):
            dist.barrier()
            t0 = time.perf_counter()  # the call's wall time (listing, group, copy)
            if kind.startswith("first"):
                ck = Checkpointer(root / "per_save")  # a new object for the same root
                p = ck.save_async(r + 1, state)
            else:
                ck, p = reused, reused.save_async(r + 1, state)
            res[kind].append(time.perf_counter() - t0)
            p.wait()
            if ck is not reused:
                ck.close()
    reused.close()
    return res


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def report(res: dict[str, Any], rounds: int) -> None:
    for layout, r in res.items():
        print(f"\n== {layout}: load, cold cache, slowest rank, median [range] of {rounds} (s)")
        meds = {n: statistics.median(ts) for n, ts in r["times"].items()}
        for n, ts in r["times"].items():
            print(f"  {n:14s} {_fmt(ts)}   x{meds[n] / meds['stalwart']:.2f} of stalwart")
        peers = [n for n in meds if not n.startswith("stalwart")]
        best = min(peers, key=meds.__getitem__)
        print(f"  stalwart / fastest peer ({best}): {meds['stalwart'] / meds[best]:.2f}x")
        nb = r["node_bytes"]
        print(
            f"  bytes read per node: {statistics.median(nb) / 1e9:.3f} GB vs unique "
            f"{r['unique'] / 1e9:.3f} GB = {statistics.median(nb) / r['unique']:.3f}x"
        )
        for k, ts in r["components"].items():
            print(f"  component {k:6s} (each rank its half) {_fmt(ts)}")
        for k, ts in r["save_async"].items():
            print(f"  save_async blocking, {k:26s} {_fmt(ts)}")
        sa = list(r["save_async"].values())
        print(f"  first / steady: {statistics.median(sa[0]) / statistics.median(sa[1]):.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=21)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    a = ap.parse_args()
    base = tempfile.mkdtemp(prefix="dist_load_", dir=a.dir)
    try:
        res = run_ranks(
            rank_body, 2, base, a.layers, a.dim, a.rounds, timeout_s=3600, pg_timeout_s=1800
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    drop = os.access("/proc/sys/vm/drop_caches", os.W_OK)
    print(f"page cache dropped before each timed load: {drop}; cores: {os.cpu_count()}")
    report(res[0], a.rounds)


if __name__ == "__main__":
    main()
