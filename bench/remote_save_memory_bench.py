"""Peak memory and time of a save to S3: a pack in one PUT against a pack uploaded in parts.

A pack is a rank's whole share of a save. Written to an object store in one PUT of the joined
buffers, the client held it about three times (the join, then the HTTP library's copies) and
could not pass S3's 5 GB limit for one PUT; above ``fsspec_storage.STREAM_BYTES`` (64 MiB) it
now goes up in parts of that size (S3 multipart upload; aborted on failure, so the object
appears whole or not at all). This saves ``--tensors`` x 64 MiB of float32 (one element of
every 16 MiB chunk changed before each save, so nothing deduplicates) to a moto S3 server in
its own process on loopback, one process, the two ways alternated (order flipping each round),
each save to a new bucket: the client's peak resident-set rise (sampled every 5 ms) and the
save's time. Medians [ranges] of ``--rounds``.

    OMP_NUM_THREADS=1 .venv/bin/python bench/remote_save_memory_bench.py --rounds 4

Bounded by: moto and the client sharing 2 cores over loopback (times are the server's as much
as the client's; the memory figure is the client's alone).
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable

import torch
from remote_load_bench import start_moto, storage_options
from scale_ckpt_bench import _peak

import stalwart
import stalwart.storage.fsspec_storage as fsspec_storage


def _peak_rise(fn: Callable[[], object]) -> tuple[float, float]:
    """(peak resident-set rise in MiB, seconds) of ``fn()``."""
    t0 = time.perf_counter()
    rise = _peak(fn)
    return rise / 2**20, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=8, help="64 MiB float32 tensors saved")
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    import boto3

    proc, port = start_moto()
    opts = storage_options(port)
    s3 = boto3.client(
        "s3",
        endpoint_url=opts["client_kwargs"]["endpoint_url"],
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(16 << 20) for i in range(a.tensors)}
    parts = fsspec_storage.STREAM_BYTES
    ways = {"one PUT (before)": 1 << 50, f"parts of {parts >> 20} MiB (now)": parts}
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in ways}
    try:
        for r in range(a.rounds):
            for name in list(ways) if r % 2 == 0 else list(ways)[::-1]:
                fsspec_storage.STREAM_BYTES = ways[name]
                bucket = f"save-{uuid.uuid4().hex[:12]}"
                s3.create_bucket(Bucket=bucket)
                for t in state.values():
                    t[:: 4 << 20] += 1.0
                with stalwart.Checkpointer(f"s3://{bucket}/run", storage_options=opts) as ck:
                    res[name].append(_peak_rise(lambda ck=ck: ck.save(1, state)))
    finally:
        fsspec_storage.STREAM_BYTES = parts
        proc.terminate()
    print(f"{a.tensors * 64} MiB saved to S3 (moto, loopback), {a.rounds} saves each way")
    print("| pack written as | client's peak memory rise (MiB) | save (s) |")
    print("|---|---|---|")
    for name, rows in res.items():
        cells = []
        for col in ([m for m, _ in rows], [s for _, s in rows]):
            cells.append(f"{statistics.median(col):.2f} [{min(col):.2f}-{max(col):.2f}]")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
