"""torchft-nightly's live recovery at gigabyte size: what a heal costs survivor and newcomer.

The peer side of issue 24's heal measure ("side by side with torchft-nightly's live recovery on
the same state size"). torchft in the configuration of ``bench/torchft_bench.py`` (its
``train_ddp.py`` example: a lighthouse, one single-process replica group per worker,
``ProcessGroupGloo``, ``PGTransport`` for live recovery, its DDP wrapper and optimizer, async
quorum), with the timeouts raised for the state size (a 4 GiB transfer does not fit the example's
10 s): process group 120 s, transport and manager 300 s, stated.

The state is ``--gib`` GiB per replica: ``Linear(width, width)`` layers (no bias) + AdamW, so
parameters are a third of it. Two replicas (``min_replicas`` 1, so the survivor may step alone,
torchft's elastic mode); replica 1 SIGKILLs itself inside backward at ``--kill-at``; the bench
starts its replacement at once, which heals from the survivor. Reported per cycle:

* ``survivor_healthy_s``: the survivor's median step before the kill;
* ``survivor_heal_step_s``: its longest step between the replacement's launch and the
  replacement's first commit (torchft sends the checkpoint from the quorum thread and waits for
  it in ``should_commit``: the survivor does not commit while it sends);
* ``heal_s``: the replacement's manager ready (model built, imports done) → its first commit
  (quorum, transfer, load, one step); ``heal_gbps``: state bytes / ``heal_s`` (a lower bound
  on the transfer rate, since ``heal_s`` includes one step);
* ``loopback_gbps``: a raw TCP socket probe in the same run (1 GiB, 4 MiB writes), the bound;
* whether both replicas end bitwise equal.

    .venv/bin/pip install -q -c constraints.txt torchft-nightly     # the peer; bench only
    OMP_NUM_THREADS=1 .venv/bin/python bench/torchft_heal_bench.py --gib 4 --cycles 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torchft_bench as tb  # lighthouse, finish, digest, the kill hook

WIDTH = 4096


def big_model(gib: float, width: int = WIDTH) -> nn.Sequential:
    """Enough ``Linear(width, width)`` layers that parameters + AdamW's two moments are ``gib``."""
    per_layer = 3 * 4 * width * width
    layers = max(1, math.ceil(gib * 2**30 / per_layer))
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width, bias=False), nn.Tanh()]
    return nn.Sequential(*mods)


def loopback_gbps(total: int = 2**30, chunk: int = 4 << 20) -> float:
    """A raw TCP socket's throughput over loopback: one sender thread, one receiver."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    payload = memoryview(bytearray(chunk))

    def send() -> None:
        with socket.create_connection(("127.0.0.1", port)) as c:
            for _ in range(total // chunk):
                c.sendall(payload)

    t = threading.Thread(target=send)
    t0 = time.perf_counter()
    t.start()
    conn, _ = srv.accept()
    buf = bytearray(chunk)
    got = 0
    with conn:
        while got < total:
            n = conn.recv_into(buf)
            if not n:
                break
            got += n
    t.join()
    srv.close()
    return got / (time.perf_counter() - t0) / 1e9


def worker(a: argparse.Namespace) -> None:
    """One replica: ``a.total`` steps; its log [step, committed, seconds, end wall clock]."""
    from torchft import DistributedDataParallel, Optimizer

    model = big_model(a.gib)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    manager, _store = tb._manager(
        model, opt, a.replica, 1, pg_s=120, transport_s=300, manager_s=300, name="heal"
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, opt)
    ready = time.time()
    log = []
    while manager.current_step() < a.total:
        s = manager.current_step()
        if s == a.kill_at:
            tb._kill_in_backward(model, Path(str(a.out) + ".killed"))
        t0 = time.perf_counter()
        optimizer.zero_grad()
        g = torch.Generator().manual_seed(s * 1000 + a.replica)
        ddp(torch.randn(a.batch, WIDTH, generator=g)).square().mean().backward()
        optimizer.step()
        log.append([s, manager.current_step() > s, time.perf_counter() - t0, time.time()])
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    nbytes += sum(v.numel() * v.element_size() for st in opt.state.values()
                  for v in st.values() if torch.is_tensor(v))  # fmt: skip
    tmp = a.out.with_suffix(".part")
    tmp.write_text(
        json.dumps(
            {
                "log": log,
                "digest": tb._digest(model),
                "ready": ready,
                "launch": float(os.environ["BENCH_LAUNCH_T"]),
                "bytes": nbytes,
            }
        )
    )
    tmp.rename(a.out)
    sys.stdout.flush()
    os._exit(0)  # torchft's threads can keep the process alive (see torchft_bench.py)


def _spawn(replica: int, out: Path, lh: str, a: argparse.Namespace, kill_at: int):  # type: ignore[no-untyped-def]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--replica", str(replica),
           "--total", str(a.steps), "--out", str(out), "--gib", str(a.gib), "--batch",
           str(a.batch), "--kill-at", str(kill_at)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": lh,
           "BENCH_LAUNCH_T": str(time.time())}  # fmt: skip
    with open(out.with_suffix(".log"), "wb") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def cycle(seed: int, a: argparse.Namespace, tmp: Path) -> dict:  # type: ignore[type-arg]
    """Two replicas; replica 1 dies at ``a.kill_at`` and is replaced at once."""
    lh, addr = tb._lighthouse(1)
    base = tmp / f"heal{seed}"
    files = [Path(f"{base}-0.json"), Path(f"{base}-1r.json")]
    try:
        procs = [_spawn(0, files[0], addr, a, -1),
                 _spawn(1, Path(f"{base}-1.json"), addr, a, a.kill_at)]  # fmt: skip
        procs[1].wait(timeout=1800)
        killed = procs[1].returncode == -signal.SIGKILL
        procs[1] = _spawn(1, files[1], addr, a, -1)
        texts = tb._finish(procs, files, 1800)
    finally:
        lh.kill()
        lh.wait()
    out: dict = {"seed": seed, "killed": killed}  # type: ignore[type-arg]
    if not all(f.exists() for f in files):
        keep = Path(tempfile.gettempdir()) / f"torchft-heal-seed{seed}"
        keep.mkdir(exist_ok=True)
        for name, text in zip(("survivor", "replacement"), texts, strict=True):
            (keep / f"{name}.txt").write_text(text)
        return {**out, "failed": True, "evidence": str(keep)}
    surv, new = (json.loads(f.read_text()) for f in files)
    first = min(row[3] for row in new["log"] if row[1])
    before = [row[2] for row in surv["log"][2:] if row[0] < a.kill_at and row[1]]
    during = [row[2] for row in surv["log"] if new["launch"] < row[3] <= first + 1e-3]
    heal_s = first - new["ready"]
    return {**out, "failed": False, "bytes": new["bytes"],
            "survivor_healthy_s": statistics.median(before),
            "survivor_heal_step_s": max(during) if during else None,
            "heal_s": heal_s, "heal_gbps": new["bytes"] / heal_s / 1e9,
            "rejoin_s": first - new["launch"],
            "bitwise_equal": surv["digest"] == new["digest"]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0, help="state per replica, GiB")
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--steps", type=int, default=14, help="steps per replica per cycle")
    p.add_argument("--kill-at", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--total", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    try:
        import torchft  # noqa: F401
    except ImportError:
        sys.exit(f"torchft is not installed; this bench measures it. Install: {tb.INSTALL}")
    if a.worker:
        a.steps = a.total
        worker(a)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(a.cycles):
            probe = loopback_gbps()
            row = {**cycle(seed, a, Path(tmp)), "loopback_gbps": probe}
            print(json.dumps(row), flush=True)
            rows.append(row)
    ok = [r for r in rows if not r["failed"]]
    print(f"\n{len(rows)} cycles at {a.gib} GiB per replica: {len(rows) - len(ok)} failed, "
          f"{sum(not r['bitwise_equal'] for r in ok)} not bitwise equal")  # fmt: skip
    for key in ("survivor_healthy_s", "survivor_heal_step_s", "heal_s", "heal_gbps",
                "rejoin_s", "loopback_gbps"):  # fmt: skip
        xs = [r[key] for r in ok if r[key] is not None]
        if xs:
            print(f"{key}: median {statistics.median(xs):.3f} ({min(xs):.3f} to {max(xs):.3f})")
    if ok:
        ratio = [r["survivor_heal_step_s"] / r["survivor_healthy_s"] for r in ok
                 if r["survivor_heal_step_s"]]  # fmt: skip
        share = [r["heal_gbps"] / r["loopback_gbps"] for r in ok]
        print(f"survivor's longest step during the heal / healthy step: median "
              f"{statistics.median(ratio):.2f}x; heal rate / loopback: median "
              f"{statistics.median(share):.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
