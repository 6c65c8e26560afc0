"""Erasure-coded in-memory redundancy: codec speed, memory overhead, recovery vs local disk.

Three parts, on the same data size (``--mib`` per rank, default 64):

1. **Codecs**, one process, one thread: encode and decode GB/s (bytes of *data* per second,
   medians and ranges of ``--reps``, codecs interleaved) of ``k`` pieces of ``mib / k`` MiB:
   XOR (``m = 1``) and Reed-Solomon through pyeclib (ISA-L Cauchy and Vandermonde) for
   ``m = 1, 2``. Decode loses ``m`` *data*
   pieces, the worst case.
2. **Memory** per rank, relative to the snapshot alone: ``k+m`` erasure coding against
   keeping full replicas on 1 and 2 peers; the erasure rows are measured (parity and indexes
   a protected snapshot really holds) for the codecs run in part 3, computed for the others.
3. **Recovery**, ``run_ranks`` world of ``k + 1`` gloo processes (default 5, one 4+1 group),
   each rank holding ``--mib`` MiB of fp32 under its own names: capture a snapshot, protect
   it (XOR and RS), lose rank 2's memory, rebuild it and restore it into the state, against
   every rank reloading the same state from a local-disk stalwart checkpoint
   (``Checkpointer(root).save`` once, then ``load`` in place), with the page cache dropped
   (``/proc/sys/vm/drop_caches``, root only; else ``posix_fadvise(DONTNEED)`` on the files) and
   warm. Contenders are interleaved (their order rotates every repetition); times are the
   slowest rank's in each repetition, quoted as median [min-max] of ``--reps`` (>= 5), and
   the disk / recovery ratios are taken per repetition.

Ranks share the machine's cores, so on a small machine the gloo transfers and the codecs
compete for CPU; the printed load average says how busy the machine was.

Run:  .venv/bin/python bench/ec_bench.py --mib 64 --reps 5 [--dir /tmp/x] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from stalwart.checkpoint import Checkpointer
from stalwart.checkpoint.capture import HostBuffer
from stalwart.checkpoint.memory.erasure import ErasureGroup
from stalwart.checkpoint.memory.erasure_codec import ErasureCodec, ReedSolomonCodec, XorCodec
from stalwart.checkpoint.memory.snapshot import Snapshot
from stalwart.testing import run_ranks

MiB = 1 << 20
LOST_RANK = 2


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# -- part 1: codecs ----------------------------------------------------------------------------


def codec_bench(mib: int, k: int, reps: int) -> list[dict[str, Any]]:
    size = mib * MiB // k
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(k)]
    codecs: list[tuple[str, ErasureCodec]] = [(f"xor {k}+1", XorCodec(k))]
    for m in (1, 2):
        for backend in ("isa_l_rs_cauchy", "isa_l_rs_vand"):
            codecs.append((f"rs {k}+{m} {backend}", ReedSolomonCodec(k, m, backend)))
    enc: dict[str, list[float]] = {name: [] for name, _ in codecs}
    dec: dict[str, list[float]] = {name: [] for name, _ in codecs}
    parity = {name: [np.empty(size, dtype=np.uint8) for _ in range(c.m)] for name, c in codecs}
    for _ in range(reps):  # codecs interleaved within each repetition
        for name, codec in codecs:
            t = time.perf_counter()
            meta = codec.encode(data, parity[name])
            enc[name].append(time.perf_counter() - t)
            lost = list(range(codec.m))  # data pieces: the worst case
            have = {i: p for i, p in enumerate(data + parity[name]) if i not in lost}
            t = time.perf_counter()
            got = codec.decode(have, meta, lost)
            dec[name].append(time.perf_counter() - t)
            for i in lost:
                assert np.array_equal(got[i], data[i]), f"{name}: piece {i} rebuilt wrong"
    total = k * size
    rows = [
        {
            "codec": name,
            "encode_gbps": total / median(enc[name]) / 1e9,
            "decode_gbps": total / median(dec[name]) / 1e9,
            "encode_gbps_range": [total / max(enc[name]) / 1e9, total / min(enc[name]) / 1e9],
            "decode_gbps_range": [total / max(dec[name]) / 1e9, total / min(dec[name]) / 1e9],
        }
        for name, _ in codecs
    ]
    return rows


# -- part 3: recovery, one body per rank -------------------------------------------------------


def _state(rank: int, mib: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rank)
    n = 8
    per = mib * MiB // 4 // n  # fp32 elements per tensor
    return {f"rank{rank}": {f"t{i}": torch.randn(per, generator=g) for i in range(n)}}


def _drop_cache(root: Path) -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def _ec_round(
    eg: ErasureGroup,
    rank: int,
    mib: int,
    snap: Snapshot,
    state: dict[str, Any],
    bufs: tuple[HostBuffer, HostBuffer],
    pg: Any,
) -> dict[str, float]:
    """Protect, lose rank ``LOST_RANK``, rebuild it and restore it into a zeroed state."""
    rebuilt_buf, parity_buf = bufs
    dist.barrier(pg)
    ps = eg.protect(snap, parity_buffer=parity_buf)
    assert eg.last_protect is not None
    rec = {
        "protect_s": eg.last_protect.total_s,
        "encode_s": eg.last_protect.codec_s,
        "protect_sent": float(eg.last_protect.bytes_sent),
        "redundancy_nbytes": float(ps.redundancy_nbytes),
    }
    survivor = None if rank == LOST_RANK else ps
    target = _state(rank, mib) if rank == LOST_RANK else None
    if target is not None:
        for t_ in target[f"rank{rank}"].values():
            t_.zero_()
    dist.barrier(pg)
    t = time.perf_counter()
    rebuilt = eg.rebuild([LOST_RANK], survivor, buffer=rebuilt_buf)
    t_restore = time.perf_counter()
    if rebuilt is not None:
        rebuilt.restore_into(target)
    end = time.perf_counter()
    assert eg.last_rebuild is not None
    rec |= {
        "rebuild_s": t_restore - t,
        "restore_s": end - t_restore,
        "decode_s": eg.last_rebuild.codec_s,
        "rebuild_sent": float(eg.last_rebuild.bytes_sent),
        "rebuild_received": float(eg.last_rebuild.bytes_received),
    }
    if target is not None:
        for name, t_ in target[f"rank{rank}"].items():
            assert torch.equal(t_, state[f"rank{rank}"][name]), name
    return rec


def _disk_round(
    ckpt: Checkpointer, rank: int, mib: int, cold: bool, root: str
) -> tuple[float, str]:
    """Every rank reloads its state from the local checkpoint; seconds on this rank."""
    target = _state(rank, mib)
    for t_ in target[f"rank{rank}"].values():
        t_.zero_()
    cache = ""
    if cold and rank == 0:
        cache = _drop_cache(Path(root))
    dist.barrier()
    t = time.perf_counter()
    ckpt.load(target, 1)
    took = time.perf_counter() - t
    dist.barrier()
    src = _state(rank, mib)[f"rank{rank}"]
    for name, t_ in target[f"rank{rank}"].items():
        assert torch.equal(t_, src[name]), name
    return took, cache


def rank_body(
    rank: int, world: int, mib: int, k: int, codecs: list[str], reps: int, root: str
) -> dict[str, Any]:
    """One rank: every repetition runs each contender once, in an order rotating per rep."""
    pg = dist.new_group(backend="gloo")  # a dedicated group, as the checkpointer would use
    state = _state(rank, mib)
    out: dict[str, Any] = {"capture_first_s": 0.0, "capture_reused_s": [], "ec": {}}
    buf = HostBuffer()
    t = time.perf_counter()
    snap = Snapshot.capture(state, 1, buffer=buf)
    out["capture_first_s"] = time.perf_counter() - t
    for _ in range(reps):
        t = time.perf_counter()
        snap = Snapshot.capture(state, 1, buffer=buf)
        out["capture_reused_s"].append(time.perf_counter() - t)
    out["snapshot_nbytes"] = snap.nbytes
    bufs = (HostBuffer(), HostBuffer())
    groups = {c: ErasureGroup(k, 1 if c == "xor" else world - k, pg, c) for c in codecs}
    ckpt = Checkpointer(root)
    ckpt.save(1, state)
    out["ec"] = {c: {} for c in codecs}
    out["disk"] = {"cold_s": [], "warm_s": [], "cache": ""}
    contenders = [*codecs, "cold", "warm"]
    for rep in range(reps):
        shift = rep % len(contenders)
        for c in contenders[shift:] + contenders[:shift]:
            if c in groups:
                rec = _ec_round(groups[c], rank, mib, snap, state, bufs, pg)
                for key, v in rec.items():
                    out["ec"][c].setdefault(key, []).append(v)
            else:
                took, cache = _disk_round(ckpt, rank, mib, c == "cold", root)
                out["disk"][f"{c}_s"].append(took)
                out["disk"]["cache"] = cache or out["disk"]["cache"]
    return out


# -- report ------------------------------------------------------------------------------------


def per_rep(per_rank: list[dict[str, Any]], get: Any) -> list[float]:
    """The slowest rank's value in each repetition."""
    reps = len(get(per_rank[0]))
    return [max(get(r)[i] for r in per_rank) for i in range(reps)]


def slowest(per_rank: list[dict[str, Any]], get: Any) -> float:
    """Median over reps of the slowest rank's value."""
    return median(per_rep(per_rank, get))


def spread(xs: list[float], fmt: str = ".3f") -> str:
    """``median [min-max]``."""
    return f"{median(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]"


def report_recovery(dist_res: list[dict[str, Any]], k: int, mib: int, reps: int) -> dict[str, Any]:
    """Print the recovery table (median [min-max] over interleaved reps) and return it."""
    print(
        f"\n## Recovery of rank {LOST_RANK} in a world of {k + 1} ({mib} MiB per rank; slowest "
        f"rank per repetition; median [min-max] of {reps} interleaved repetitions)\n"
    )
    cap_first = max(r["capture_first_s"] for r in dist_res)
    cap = slowest(dist_res, lambda r: r["capture_reused_s"])
    print(f"snapshot capture: first {cap_first:.3f} s (fresh buffer), reused buffer {cap:.3f} s\n")
    cold = per_rep(dist_res, lambda r: r["disk"]["cold_s"])
    warm = per_rep(dist_res, lambda r: r["disk"]["warm_s"])
    cache = dist_res[0]["disk"]["cache"]
    print(
        "| path | protect s | rebuild s | restore s | recovery s "
        "| disk cold / recovery | disk warm / recovery |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    table: dict[str, Any] = {}
    for codec in dist_res[0]["ec"]:
        lost = dist_res[LOST_RANK]["ec"][codec]
        rebuild = per_rep(dist_res, lambda r, c=codec: r["ec"][c]["rebuild_s"])
        recovery = [b + r for b, r in zip(rebuild, lost["restore_s"], strict=True)]
        ratio_cold = [c / r for c, r in zip(cold, recovery, strict=True)]
        ratio_warm = [w / r for w, r in zip(warm, recovery, strict=True)]
        row = {
            "protect_s": per_rep(dist_res, lambda r, c=codec: r["ec"][c]["protect_s"]),
            "encode_s": per_rep(dist_res, lambda r, c=codec: r["ec"][c]["encode_s"]),
            "decode_s": per_rep(dist_res, lambda r, c=codec: r["ec"][c]["decode_s"]),
            "rebuild_s": rebuild,
            "restore_s": lost["restore_s"],
            "recovery_s": recovery,
            "disk_cold_over_recovery": ratio_cold,
            "disk_warm_over_recovery": ratio_warm,
            "protect_sent_per_rank": median(dist_res[0]["ec"][codec]["protect_sent"]),
            "rebuild_received_lost": median(lost["rebuild_received"]),
        }
        table[codec] = row
        name = f"EC {k}+1 xor" if codec == "xor" else f"EC {k}+1 rs"
        print(
            f"| {name} | {spread(row['protect_s'])} | {spread(rebuild)} "
            f"| {spread(lost['restore_s'])} | {spread(recovery)} "
            f"| {spread(ratio_cold, '.1f')}x | {spread(ratio_warm, '.1f')}x |"
        )
    print(
        f"| local disk, all ranks reload ({cache}) | | | | cold {spread(cold)}, "
        f"warm {spread(warm)} | | |"
    )
    print("\n(ratios are per repetition: that repetition's disk time over its recovery time)")
    for codec, row in table.items():
        print(
            f"{codec}: protect sends {row['protect_sent_per_rank'] / MiB:.1f} MiB per "
            f"rank; the lost rank receives {row['rebuild_received_lost'] / MiB:.1f} MiB"
        )
    return {
        "ec": table,
        "disk_cold_s": cold,
        "disk_warm_s": warm,
        "cache": cache,
        "capture_first_s": cap_first,
        "capture_reused_s": cap,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="MiB of state per rank")
    ap.add_argument("--k", type=int, default=4, help="data members per group")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (>= 5 for quoted figures)")
    ap.add_argument("--dir", default=None, help="scratch folder for the disk checkpoint")
    ap.add_argument("--json", default=None, help="write every number here")
    ap.add_argument("--no-dist", action="store_true", help="skip part 3 (multi-process)")
    args = ap.parse_args()
    k = args.k
    results: dict[str, Any] = {"mib_per_rank": args.mib, "k": k, "reps": args.reps}
    print(
        f"# ec_bench: {args.mib} MiB per rank, k={k}, reps={args.reps}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"
    )

    codecs = codec_bench(args.mib, k, args.reps)
    results["codecs"] = codecs
    print(
        "\n## Codecs (one thread; GB/s of data, median [min-max] of interleaved reps; decode "
        "loses m data pieces)\n"
    )
    print("| codec | encode GB/s | decode GB/s |\n|---|---:|---:|")
    for r in codecs:
        lo_e, hi_e = r["encode_gbps_range"]
        lo_d, hi_d = r["decode_gbps_range"]
        print(
            f"| {r['codec']} | {r['encode_gbps']:.2f} [{lo_e:.2f}-{hi_e:.2f}] "
            f"| {r['decode_gbps']:.2f} [{lo_d:.2f}-{hi_d:.2f}] |"
        )

    dist_res: list[dict[str, Any]] | None = None
    if not args.no_dist:
        world = k + 1
        base = Path(args.dir or tempfile.gettempdir()) / f"ec-bench-{os.getpid()}"
        base.mkdir(parents=True, exist_ok=True)
        sys.path.insert(0, str(Path(__file__).parent))
        body = importlib.import_module("ec_bench").rank_body  # importable by spawned ranks
        try:
            dist_res = run_ranks(
                body,
                world,
                args.mib,
                k,
                ["xor", "rs"],
                args.reps,
                str(base / "ckpt"),
                timeout_s=1800,
            )
        finally:
            with contextlib.suppress(OSError):
                shutil.rmtree(base)
        results["ranks"] = dist_res

    print(f"\n## Memory per rank (snapshot = 1.00; {k}+m erasure coding vs full replicas)\n")
    print("| scheme | memory | tolerates | source |\n|---|---:|---:|---|")
    measured = {}
    if dist_res is not None:
        snap_n = dist_res[0]["snapshot_nbytes"]
        for codec, rec in dist_res[0]["ec"].items():
            measured[codec] = 1 + median(rec["redundancy_nbytes"]) / snap_n
    for m in (1, 2):
        key = "xor" if m == 1 else None
        if key in measured:
            print(f"| EC {k}+{m} ({key}) | {measured[key]:.3f}x | {m} | measured |")
        print(f"| EC {k}+{m} | {1 + m / k:.3f}x | {m} | (k+m)/k |")
    for r in (1, 2):
        print(f"| {r} full replica(s) | {1 + r:.3f}x | {r} | 1+r |")
    results["memory"] = {"measured": measured}

    if dist_res is not None:
        results["recovery"] = report_recovery(dist_res, k, args.mib, args.reps)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
