"""Distributed loads from an S3 store: bytes fetched at the wire and load time, against DCP.

A moto S3 server (``python -m moto.server``, its own process) on loopback, behind a small
counting TCP proxy in this process (two threads per connection forwarding bytes; it counts
what the server sends to the clients). Every contender talks to the proxy, so the bytes each
one fetched are measured at the wire (HTTP headers, listings and manifests included), the
same way for all. ``--world`` gloo ranks (``run_ranks``) hold the same DDP-replicated state:
``--layers`` x ``Linear(dim, dim)`` + AdamW after one step (12 x 2048 is 0.60 GB).

Each contender saves once to its own prefix of one bucket; then ``--rounds`` rounds, the
loads interleaved (the order rotates each round), each into a zeroed state and checked
bit-exact against the saved values (untimed). The time is the slowest rank's, barrier to
barrier, and covers opening the checkpoint (listing, manifest or metadata) and the load.

Contenders: ``stalwart`` (``Checkpointer(url, storage_options=...).load``, defaults: shared
reads decided by the store, on for S3, so replicated boxes are fetched once by the group and
passed through /dev/shm), ``stalwart-solo`` (the same with ``shared_read.SHARED_READS =
False``: every rank fetches all it holds), ``dcp`` (``dcp.save`` with ``FsspecWriter`` and
``dcp.load`` with ``FsspecReader`` on the same bucket and options, ``get_state_dict`` /
``set_state_dict``: its documented remote configuration; its default planner deduplicates
replicated tensors at save, and every rank reads all it loads).

Bounded by: moto is a Python server (one process, a thread per request) and the proxy is
Python threads, on the same 2 cores as the ranks; moto answers a ranged GET by reading the
whole object and slicing it, so the server's work grows with requests x object size.

Run:  OMP_NUM_THREADS=1 flock /tmp/bigmem.lock \
          .venv/bin/python bench/remote_load_bench.py --layers 12 --dim 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stalwart.checkpoint import Checkpointer
from stalwart.checkpoint.durable import shared_read
from stalwart.testing import run_ranks

NAMES = ("stalwart", "stalwart-solo", "dcp")


class CountingProxy:
    """Forward TCP connections on loopback to ``upstream``; count server-to-client bytes.

    ``control_port`` answers each connection with the count so far (ASCII) and closes.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.down = 0
        self._lock = threading.Lock()
        self._listen = socket.create_server(("127.0.0.1", 0))
        self._control = socket.create_server(("127.0.0.1", 0))
        self.port = self._listen.getsockname()[1]
        self.control_port = self._control.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._answer, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self._listen.accept()
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        try:
            while n := src.recv_into(buf):
                dst.sendall(view[:n])
                if count:
                    with self._lock:
                        self.down += n
        except OSError:
            pass
        finally:
            for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
                with contextlib.suppress(OSError):
                    s.shutdown(how)

    def _answer(self) -> None:
        while True:
            conn, _ = self._control.accept()
            with conn:
                with self._lock:
                    n = self.down
                conn.sendall(f"{n}\n".encode())


def wire_bytes(control_port: int) -> int:
    """Bytes the proxy has carried from the server to the clients so far."""
    with socket.create_connection(("127.0.0.1", control_port)) as s:
        return int(s.makefile().readline())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto() -> tuple[subprocess.Popen[bytes], int]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.1)


def storage_options(port: int) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
    }


def _model(layers: int, dim: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same on every rank: replicated, as under DDP
    model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, dim)).sum().backward()
    opt.step()
    return model, opt


def _tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach() for p in model.parameters()]
    for st in opt.state.values():
        out += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out


def _dcp_sd(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _save(name: str, model: nn.Module, opt: torch.optim.Optimizer, url: str, opts: Any) -> None:
    if name == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        dcp.save(_dcp_sd(model, opt), storage_writer=FsspecWriter(url, **opts))
        return
    with Checkpointer(url, storage_options=opts) as ck:
        ck.save(1, {"model": model, "optim": opt})


def _load(name: str, model: nn.Module, opt: torch.optim.Optimizer, url: str, opts: Any) -> int:
    """One contender's load; stalwart's returns its ``LoadResult.bytes_read`` (else 0)."""
    if name == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        from torch.distributed.checkpoint.state_dict import set_state_dict

        sd = _dcp_sd(model, opt)
        dcp.load(sd, storage_reader=FsspecReader(url, **opts))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return 0
    shared_read.SHARED_READS = False if name == "stalwart-solo" else None
    with Checkpointer(url, storage_options=opts) as ck:
        ck.load({"model": model, "optim": opt})
        assert ck.last_load is not None
        return ck.last_load.bytes_read


def rank_body(
    rank: int, world: int, port: int, control: int, bucket: str, layers: int, dim: int, rounds: int
) -> dict[str, Any]:
    torch.set_num_threads(1)
    from stalwart.checkpoint.collective import resolve_group

    g = resolve_group()
    opts = storage_options(port)
    model, opt = _model(layers, dim)
    want = [t.clone() for t in _tensors(model, opt)]
    urls = {"stalwart": f"s3://{bucket}/stalwart", "dcp": f"s3://{bucket}/dcp"}
    urls["stalwart-solo"] = urls["stalwart"]
    for name in ("stalwart", "dcp"):
        _save(name, model, opt, urls[name], opts)
        dist.barrier()
    times: dict[str, list[float]] = {n: [] for n in NAMES}
    wire: dict[str, list[int]] = {n: [] for n in NAMES}
    read: dict[str, list[int]] = {n: [] for n in NAMES}
    for r in range(rounds):
        for i in range(len(NAMES)):
            name = NAMES[(i + r) % len(NAMES)]
            with torch.no_grad():
                for t in _tensors(model, opt):
                    t.zero_()
            dist.barrier()
            before = wire_bytes(control) if rank == 0 else 0
            dist.barrier()
            t0 = time.perf_counter()
            n = _load(name, model, opt, urls[name], opts)
            dist.barrier()
            t = time.perf_counter() - t0
            after = wire_bytes(control) if rank == 0 else 0
            times[name].append(max(g.all_gather(t)))
            read[name].append(sum(g.all_gather(n)))
            wire[name].append(after - before)
            got = _tensors(model, opt)
            ok = len(got) == len(want) and all(
                torch.equal(a, b) for a, b in zip(got, want, strict=True)
            )
            assert ok, f"{name}: a load did not restore the saved values"
    unique = sum(t.numel() * t.element_size() for t in want)
    return {"times": times, "wire": wire, "read": read, "unique": unique}


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def report(res: dict[str, Any], world: int, rounds: int) -> None:
    unique = res["unique"]
    meds = {n: statistics.median(ts) for n, ts in res["times"].items()}
    print(f"\n== {world} ranks, DDP-replicated state of {unique / 1e9:.3f} GB (tensor bytes)")
    print(f"load from S3 (moto via counting proxy), slowest rank, median [range] of {rounds}")
    for n in NAMES:
        w = [b / unique for b in res["wire"][n]]
        line = (
            f"  {n:14s} {_fmt(res['times'][n])} s   x{meds[n] / meds['dcp']:.2f} of dcp   "
            f"wire {statistics.median(w):.3f}x unique [{min(w):.3f}-{max(w):.3f}]"
        )
        if n != "dcp":
            rd = statistics.median(res["read"][n]) / unique
            line += f"   bytes_read (all ranks) {rd:.3f}x unique"
        print(line)
    for n in NAMES:
        rounds_s = ", ".join(f"{t:.2f}" for t in res["times"][n])
        print(f"  per round, {n:14s} {rounds_s}")
    per_round = [s / d for s, d in zip(res["times"]["stalwart"], res["times"]["dcp"], strict=True)]
    print(f"  stalwart / dcp in each round: {', '.join(f'{x:.2f}' for x in per_round)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args()
    proc, moto_port = start_moto()
    try:
        proxy = CountingProxy(moto_port)
        import boto3

        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        o = storage_options(proxy.port)
        boto3.client(
            "s3",
            endpoint_url=o["client_kwargs"]["endpoint_url"],
            aws_access_key_id=o["key"],
            aws_secret_access_key=o["secret"],
            region_name="us-east-1",
        ).create_bucket(Bucket=bucket)
        res = run_ranks(
            rank_body,
            a.world,
            proxy.port,
            proxy.control_port,
            bucket,
            a.layers,
            a.dim,
            a.rounds,
            timeout_s=3600,
            pg_timeout_s=1800,
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"cores: {os.cpu_count()}; load average at the end: {os.getloadavg()}")
    report(res[0], a.world, a.rounds)


if __name__ == "__main__":
    main()
