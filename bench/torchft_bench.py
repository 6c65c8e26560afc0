"""torchft-nightly as the peer: healthy per-step time against plain gloo DDP and stalwart.elastic.

Same model, data and optimizer as ``bench/elastic_bench.py`` (imported from it: the MLP
512→512→512→10, AdamW, batch 32 per worker), gloo on CPU, ``OMP_NUM_THREADS=1``:

* ``ddp`` and ``stalwart``: exactly ``elastic_bench.py``'s runs (torchrun + DDP; ``stalwart run``);
* ``torchft``: torchft's documented DDP configuration (its ``train_ddp.py``): one replica group
  of one process per worker, a ``torchft_lighthouse`` started by this bench (``--quorum_tick_ms
  100 --join_timeout_ms 10000``), ``Manager(timeout=30 s)`` with ``ProcessGroupGloo(timeout=5
  s)``, a ``PGTransport`` for live recovery, ``torchft.DistributedDataParallel`` and
  ``torchft.Optimizer``; async quorum (the default). Each replica hosts its own ``TCPStore``
  (what torchrun would give it). One change from the example: ``min_replicas`` is the number of
  workers in healthy runs (every timed step a full all-reduce, as DDP's) and 2 of 3 in kill
  cycles, where the example's 1 lets a replica step alone.

Runs alternate between contenders (order rotating); each times ``--steps`` steps after
``--warmup`` on worker 0; the table gives the median and range of the per-run medians and the
difference from DDP in the same run. torchft steps not committed by all workers, if any, are left
out of its median and counted in the output.

    nice -n 10 .venv/bin/python bench/torchft_bench.py --runs 3 --steps 100

``--kills N``: N torchft cycles of 3 replicas (same configuration); replica 2
SIGKILLs itself inside backward (gradient all-reduce in flight) at a seeded step; the bench
starts a replacement at once. Reports whether the survivors kept going, lost steps (survivor
iterations that did not commit), kill → survivors' next commit, replacement launch → its first
commit, and whether the final parameters of all 3 replicas are bitwise equal.

torchft is a bench-only peer: ``.venv/bin/pip install -q -c constraints.txt torchft-nightly``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import elastic_bench as eb  # the same model, data and DDP/stalwart runs

INSTALL = ".venv/bin/pip install -q -c constraints.txt torchft-nightly"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for v in model.state_dict().values():
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _manager(
    model,
    opt,
    replica: int,
    min_replicas: int,
    *,
    pg_s: float = 5,
    transport_s: float = 10,
    manager_s: float = 30,
    name: str = "bench",
):  # type: ignore[no-untyped-def]
    """torchft's documented DDP setup (train_ddp.py), one process per replica group
    (timeouts in seconds: the example's by default)."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=pg_s))

    def load_state_dict(sd: dict) -> None:  # type: ignore[type-arg]
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    manager = Manager(
        pg=pg, min_replica_size=min_replicas, load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        replica_id=f"{name}_{replica}", timeout=timedelta(seconds=manager_s),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=transport_s),
                                         device=torch.device("cpu")),
        store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
    )  # fmt: skip
    return manager, store


def worker_torchft(a: argparse.Namespace) -> None:
    """One torchft replica group; writes its iteration log as JSON."""
    from torchft import DistributedDataParallel, Optimizer

    t_launch = float(os.environ.get("BENCH_LAUNCH_T", time.time()))
    model = eb._model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager, _store = _manager(model, opt, a.replica, a.min_replicas)
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, opt)
    log = []  # [step before, committed, seconds, wall clock at end, participants]
    while manager.current_step() < a.total:
        s = manager.current_step()
        if s == a.kill_at:
            _kill_in_backward(model, Path(str(a.out) + ".killed"))
        t0 = time.perf_counter()
        optimizer.zero_grad()
        x, y = eb._batch(s, a.replica)
        F.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        dt = time.perf_counter() - t0
        log.append([s, manager.current_step() > s, dt, time.time(), manager.num_participants()])
        time.sleep(a.step_sleep)
    tmp = a.out.with_suffix(".part")
    tmp.write_text(json.dumps({"log": log, "digest": _digest(model), "launch": t_launch}))
    tmp.rename(a.out)
    # A replica that finishes first leaves its peers' next quorum waiting (60 s, then an error),
    # and the manager's threads can keep the process alive: the bench ends the run once every
    # replica has written its log; exit hard here.
    sys.stdout.flush()
    os._exit(0)


def _kill_in_backward(model: torch.nn.Module, mark: Path) -> None:
    """SIGKILL this process once the first layer's gradient is ready (the last in backward)."""

    def die(_grad: torch.Tensor) -> None:
        mark.write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    next(model.parameters()).register_hook(die)


def _lighthouse(min_replicas: int, tries: int = 3) -> tuple[subprocess.Popen, str]:  # type: ignore[type-arg]
    """Start ``torchft_lighthouse`` on a free port (a new port if another process took it)."""
    exe = Path(sys.executable).with_name("torchft_lighthouse")
    port = _free_port()
    proc = subprocess.Popen([str(exe), "--min_replicas", str(min_replicas), "--quorum_tick_ms",
                             "100", "--join_timeout_ms", "10000", "--bind", f"127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    for _ in range(400):  # wait until it listens
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    if tries > 1:
        return _lighthouse(min_replicas, tries - 1)
    raise RuntimeError("torchft_lighthouse did not listen within 20 s on 3 ports; run it by hand")


def _spawn(replica: int, total: int, out: Path, lh: str, extra: list[str]) -> subprocess.Popen:  # type: ignore[type-arg]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--replica", str(replica),
           "--total", str(total), "--out", str(out), *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": lh,
           "BENCH_LAUNCH_T": str(time.time())}  # fmt: skip
    with open(out.with_suffix(".log"), "wb") as log:  # torchft logs a lot: a pipe would fill
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _finish(procs: list, outs: list[Path], timeout: float) -> list[str]:  # type: ignore[type-arg]
    """Wait until every replica wrote its log (or one failed); end the rest; their output."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(o.exists() for o in outs):
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    return [o.with_suffix(".log").read_text(errors="replace") for o in outs]


def _run_torchft(a: argparse.Namespace, tmp: Path) -> float:
    lh, addr = _lighthouse(a.nproc)
    try:
        outs = [tmp / f"tft-{time.monotonic_ns()}-{r}.json" for r in range(a.nproc)]
        procs = [_spawn(r, a.warmup + a.steps, outs[r], addr,
                        ["--step-sleep", "0", "--min-replicas", str(a.nproc)])
                 for r in range(a.nproc)]  # fmt: skip
        for o, text in zip(outs, _finish(procs, outs, 600), strict=True):
            if not o.exists():
                raise RuntimeError(f"a torchft worker failed:\n{text[-3000:]}")
        log = json.loads(outs[0].read_text())["log"][a.warmup :]
        full = [row[2] for row in log if row[1] and row[4] == a.nproc]
        if len(full) < len(log):  # a step committed without every replica
            print(f"torchft: {len(log) - len(full)} of {len(log)} timed steps not committed "
                  f"by all {a.nproc} replicas; left out of the median", flush=True)  # fmt: skip
        return statistics.median(full) * 1e3
    finally:
        lh.kill()
        lh.wait()


def healthy(a: argparse.Namespace) -> None:
    """Interleaved runs of the three contenders; prints the table and the differences."""
    names = ["ddp", "stalwart", "torchft"]
    medians: dict[str, list[float]] = {c: [] for c in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.runs):
            order = names[r % 3 :] + names[: r % 3]
            for c in order:
                ms = _run_torchft(a, Path(tmp)) if c == "torchft" else eb._run(c, a, Path(tmp))
                medians[c].append(ms)
            print(
                f"run {r}: " + ", ".join(f"{c} {medians[c][-1]:.2f} ms" for c in order), flush=True
            )
    print(f"\n{a.nproc} workers, {a.steps} timed steps after {a.warmup}, {a.runs} runs")
    print(
        "\n| contender | median step (ms) | range of run medians (ms) | minus ddp, median (range) |"
    )
    print("|---|---|---|---|")
    for c, m in medians.items():
        d = [x - y for x, y in zip(m, medians["ddp"], strict=True)]
        diff = (
            "-" if c == "ddp" else f"{statistics.median(d):+.2f} ({min(d):+.2f} to {max(d):+.2f})"
        )
        print(f"| {c} | {statistics.median(m):.2f} | {min(m):.2f} to {max(m):.2f} | {diff} |")


def _kill_cycle(seed: int, a: argparse.Namespace, tmp: Path) -> dict:  # type: ignore[type-arg]
    kill_at = random.Random(seed).randrange(10, 25)
    lh, addr = _lighthouse(2)
    base = tmp / f"kill{seed}"
    common = ["--step-sleep", str(a.step_sleep), "--min-replicas", "2"]
    try:
        procs = [_spawn(r, a.kill_total, Path(f"{base}-{r}.json"), addr,
                        common + (["--kill-at", str(kill_at)] if r == 2 else []))
                 for r in range(3)]  # fmt: skip
        procs[2].wait(timeout=600)
        killed = procs[2].returncode == -signal.SIGKILL
        t_kill = float(Path(f"{base}-2.json.killed").read_text()) if killed else None
        procs[2] = _spawn(2, a.kill_total, Path(f"{base}-2r.json"), addr, common)
        files = [Path(f"{base}-{tag}.json") for tag in ("0", "1", "2r")]
        texts = _finish(procs, files, 300)
        rcs = [p.returncode for p in procs]
    finally:
        lh.kill()
        lh.wait()
    res = [json.loads(f.read_text()) if f.exists() else None for f in files]
    out: dict = {"seed": seed, "kill_at": kill_at, "killed": killed, "rcs": rcs}  # type: ignore[type-arg]
    out["failed"] = None in res or t_kill is None
    if out["failed"]:  # keep the evidence
        keep = Path(tempfile.gettempdir()) / f"torchft-kill-seed{seed}"
        keep.mkdir(exist_ok=True)
        for name, text in zip(("0", "1", "2r"), texts, strict=True):
            (keep / f"replica-{name}.txt").write_text(text)
        out["evidence"] = str(keep)
    if None in res or t_kill is None:
        return out
    s0 = res[0]["log"]
    out["lost_steps"] = sum(not row[1] for row in s0)
    out["survivors_commit_s"] = min(row[3] for row in s0 if row[1] and row[3] > t_kill) - t_kill
    out["rejoin_s"] = min(row[3] for row in res[2]["log"] if row[1]) - res[2]["launch"]
    out["bitwise_equal"] = len({r["digest"] for r in res}) == 1
    return out


def kills(a: argparse.Namespace) -> None:
    """``a.kills`` seeded kill/replace cycles of torchft; one JSON line each, then totals."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(a.first_seed, a.first_seed + a.kills):
            c = _kill_cycle(seed, a, Path(tmp))
            print(json.dumps(c), flush=True)
            rows.append(c)
    ok = [c for c in rows if not c["failed"]]
    unequal = sum(not c["bitwise_equal"] for c in ok)
    print(f"\n{len(rows)} cycles: {len(rows) - len(ok)} failed (a worker exit != 0 or no log); "
          f"{unequal} with final parameters not bitwise equal")  # fmt: skip
    for key in ("lost_steps", "survivors_commit_s", "rejoin_s"):
        xs = [c[key] for c in ok]
        if xs:
            print(f"{key}: median {statistics.median(xs):.2f} ({min(xs):.2f} to {max(xs):.2f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--nproc", type=int, default=2, help="workers (healthy runs)")
    p.add_argument("--verify-every", type=int, default=50, help="stalwart's digest period")
    p.add_argument("--kills", type=int, default=0, help="torchft kill/replace cycles instead")
    p.add_argument("--first-seed", type=int, default=0, help="kill cycles: first seed")
    p.add_argument("--kill-total", type=int, default=60, help="steps per kill cycle")
    p.add_argument("--step-sleep", type=float, default=0.02, help="kill cycles: sleep per step")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--total", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--min-replicas", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--kill-at", type=int, default=-1, help=argparse.SUPPRESS)
    a = p.parse_args()
    try:
        import torchft  # noqa: F401
    except ImportError:
        sys.exit(f"torchft is not installed; this bench compares against it. Install: {INSTALL}")
    if a.worker:
        worker_torchft(a)
    elif a.kills:
        kills(a)
    else:
        if a.nproc != 2:
            sys.exit("--nproc: elastic_bench.py's ddp/stalwart runs use 2 workers; keep 2")
        healthy(a)


if __name__ == "__main__":
    main()
