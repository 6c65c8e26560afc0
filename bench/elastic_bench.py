"""Healthy per-step overhead of ``stalwart.elastic`` against plain gloo DDP, in the same run.

Both contenders train the same MLP (512→512→512→10, ≈0.53 M parameters, AdamW, batch 32 per
worker) on 2 worker processes with gloo on CPU:

* ``ddp``: ``torchrun`` + ``init_process_group("gloo")`` + ``DistributedDataParallel``;
* ``stalwart``: ``stalwart run --nproc 2`` + ``stalwart.elastic.Job`` (one all-reduce per
  step carrying gradients, votes and the change flag; rank 0 reads the coordinator's epoch
  each step; digests compared every ``--verify-every`` steps, default 50 as in the library).

Each run times ``--steps`` steps after ``--warmup`` steps on rank 0 and reports the median
step; runs alternate between contenders (order rotating), and the table gives the median and
range of the per-run medians, and the difference.

    .venv/bin/python bench/elastic_bench.py --runs 5 --steps 200

``--campaign N`` instead runs N seeded kill/rejoin cycles (3 workers of the tests' worker
script, one SIGKILL inside the all-reduce at a random step and delay, a replacement that
heals, digests compared after every step) and counts bitwise divergences.

    .venv/bin/python bench/elastic_bench.py --campaign 8
    .venv/bin/python bench/elastic_bench.py --campaign 10 --mixed     # kill/stop/raise/delay
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))  # fmt: skip


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(32, 512, generator=g), torch.randint(0, 10, (32,), generator=g)


def _time_loop(step_fn, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        step_fn(i)
        times.append(time.perf_counter() - t0)
    return times


def worker_ddp(total: int, out: Path) -> None:
    """One DDP rank (under torchrun)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        opt.zero_grad()
        x, y = _batch(i, rank)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    times = _time_loop(step, total)
    if rank == 0:
        out.write_text(json.dumps(times))
    dist.destroy_process_group()


def worker_stalwart(total: int, out: Path, verify_every: int) -> None:
    """One elastic member (under stalwart run)."""
    import stalwart
    from stalwart.elastic import Job

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    job = Job(stalwart.TrainingState(model=model, optimizer=opt), verify_every=verify_every)
    model = job.data_parallel(model)
    optimizer = job.optimizer(opt)

    def step(i: int) -> None:
        optimizer.zero_grad()
        x, y = _batch(job.step, job.rank)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    times = _time_loop(step, total)
    job.close()
    if job.rank == 0:
        out.write_text(json.dumps(times))


def _run(contender: str, a: argparse.Namespace, tmp: Path) -> float:
    out = tmp / f"{contender}-{time.monotonic_ns()}.json"
    total = a.warmup + a.steps
    me = [str(Path(__file__).resolve()), "--worker", contender, "--total", str(total),
          "--out", str(out), "--verify-every", str(a.verify_every)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if contender == "ddp":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", *me]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "2", *me]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=600)
    times = json.loads(out.read_text())[a.warmup :]
    return statistics.median(times) * 1e3


def _cycle(seed: int, mixed: bool, worker: Path) -> dict:  # type: ignore[type-arg]
    """One seeded cycle: run the job, compare the digests of every step, time the recoveries."""
    from stalwart.elastic import read_events, recoveries
    from stalwart.testing import KillSchedule

    if mixed:
        sched = KillSchedule.mixed(seed, workers=3, steps=range(3, 18), count=2)
    else:
        sched = KillSchedule.seeded(seed, workers=3, steps=range(3, 18), max_delay_s=0.004)
    kind = {k.worker: k.signal.lower() for k in sched.kills} | {
        r.worker: "raise" for r in sched.raises
    }
    with tempfile.TemporaryDirectory() as tmp:
        ev, out = Path(tmp) / "events", Path(tmp) / "out"
        cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "3", "--events", str(ev),
               str(worker), "--steps", "40", "--verify-every", "1", "--out", str(out),
               "--hold-at", "25", "--hold-size", "3"]  # fmt: skip
        if mixed:  # a SIGSTOPped worker is excluded after 2 s of silent heartbeats
            cmd[4:4] = ["--hang-timeout", "2", "--max-restarts", "3"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", **sched.to_env()}
        done = subprocess.run(cmd, env=env, capture_output=True, timeout=600)
        digests: dict[int, set[str]] = {}
        events = read_events(ev)
        for lines in events.values():
            for e in lines:
                if e["kind"] == "step" and e.get("digest"):
                    digests.setdefault(e["step"], set()).add(e["digest"])
        finals = {torch.load(f)["digest"] for f in out.glob("final-*.pt")}
        bad = sum(len(d) > 1 for d in digests.values()) + (len(finals) != 1)
        healed = sum(e["kind"] == "state-received" and e["step"] > 0
                     for w, ls in events.items() if w < 3 for e in ls)  # fmt: skip
        rec = recoveries(ev)
        failed = done.returncode != 0 or sorted(r.worker for r in rec) != sorted(kind)
        if failed or bad:  # keep the evidence
            keep = Path(tempfile.gettempdir()) / f"stalwart-campaign-seed{seed}"
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(tmp, keep)
            (keep / "output.txt").write_bytes(done.stdout + done.stderr)
    return {"seed": seed, "faults": str(sched), "rc": done.returncode, "failed": failed,
            "divergent_steps": bad, "survivor_rolled_forward": healed,
            "recoveries": [{"kind": kind.get(r.worker, "?"), "lost_steps": r.lost_steps,
                            "detect_s": r.detect_s, "resume_s": r.resume_s,
                            "rejoin_s": r.rejoin_s} for r in rec]}  # fmt: skip


def campaign(n: int, mixed: bool = False, first_seed: int = 0) -> None:
    """Seeded kill/rejoin cycles; prints one JSON line per cycle and the totals.

    ``mixed``: two faults per cycle drawn by ``KillSchedule.mixed`` (SIGKILL, SIGSTOP, an
    exception in the step, a delay before every all-reduce) instead of one SIGKILL.
    """
    worker = Path(__file__).resolve().parents[1] / "tests" / "distributed" / "elastic_worker.py"
    divergent = partial = failed = 0
    by_kind: dict[str, dict[str, list[float]]] = {}
    for seed in range(first_seed, first_seed + n):
        c = _cycle(seed, mixed, worker)
        print(json.dumps(c), flush=True)
        divergent += c["divergent_steps"] > 0
        partial += c["survivor_rolled_forward"] > 0
        failed += c["failed"]
        for r in c["recoveries"]:
            for key in ("detect_s", "resume_s", "lost_steps", "rejoin_s"):
                if r[key] is not None:
                    by_kind.setdefault(r["kind"], {}).setdefault(key, []).append(r[key])
    print(
        f"\n{n} cycles: {divergent} with a bitwise divergence; {failed} runs failed "
        f"(launcher exit != 0 or not exactly the scheduled deaths); "
        f"{partial} where a survivor was behind after a partial all-reduce and rolled forward"
    )
    print("\n| fault | n | detect (s) | survivors commit (s) | lost steps | rejoin (s) |")
    print("|---|---|---|---|---|---|")
    for kind, st in sorted(by_kind.items()):
        cells = [
            f"{statistics.median(xs):.2f} ({min(xs):.2f} to {max(xs):.2f})" if xs else "-"
            for xs in (st.get(k, []) for k in ("detect_s", "resume_s", "lost_steps", "rejoin_s"))
        ]
        print(f"| {kind} | {len(st.get('lost_steps', []))} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--verify-every", type=int, default=50)
    p.add_argument("--worker", choices=["ddp", "stalwart"])
    p.add_argument("--total", type=int)
    p.add_argument("--out", type=Path)
    p.add_argument("--campaign", type=int, default=0, help="kill/rejoin cycles instead")
    p.add_argument("--mixed", action="store_true", help="campaign: mixed seeded faults")
    p.add_argument("--first-seed", type=int, default=0, help="campaign: first seed")
    a = p.parse_args()
    if a.campaign:
        campaign(a.campaign, a.mixed, a.first_seed)
        return
    if a.worker == "ddp":
        worker_ddp(a.total, a.out)
        return
    if a.worker == "stalwart":
        worker_stalwart(a.total, a.out, a.verify_every)
        return
    medians: dict[str, list[float]] = {"ddp": [], "stalwart": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.runs):
            order = ["ddp", "stalwart"] if r % 2 == 0 else ["stalwart", "ddp"]
            for c in order:
                medians[c].append(_run(c, a, Path(tmp)))
            print(f"run {r}: " + ", ".join(f"{c} {medians[c][-1]:.2f} ms" for c in order))
    print("\n| contender | median step (ms) | range of run medians (ms) |")
    print("|---|---|---|")
    for c, m in medians.items():
        print(f"| {c} | {statistics.median(m):.2f} | {min(m):.2f} to {max(m):.2f} |")
    diffs = [s - d for s, d in zip(medians["stalwart"], medians["ddp"], strict=True)]
    print(f"\nstalwart minus ddp per run (ms): median {statistics.median(diffs):+.2f}, "
          f"range {min(diffs):+.2f} to {max(diffs):+.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
