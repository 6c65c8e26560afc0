"""Loss with faults against the fault-free run at equal committed steps (issue 10, Measure).

The tests' elastic worker (``tests/distributed/elastic_worker.py``) logs no loss and has no
data seed, so this script is its own worker (``--worker``): the same MLP, SGD and
``stalwart.elastic.Job`` loop, with step ``s``'s global batch drawn from a generator seeded
``1000 + s + 100_000 * seed`` (seed 0 is exactly the tests' data). After each *committed*
step every member appends the loss of that step's full global batch under the parameters it
trained from (replicated, so every member logs the same number), and the loss on a fixed
evaluation batch (256 rows, the same for every seed) under the parameters just committed, to
``loss-<worker>.jsonl``. The training-batch loss is dominated by which batch a step draws; the
evaluation loss shows the trend. Both are compared.

For every data seed the bench runs, interleaved, under ``stalwart run --nproc 3``:

* a fault-free job; the spread across seeds of its loss at each committed step is the noise
  band;
* the same seed under a seeded fault schedule on the three original workers: a SIGKILL
  inside the gradient all-reduce, a SIGKILL at a step boundary, and a SIGSTOP hang (excluded
  after ``--hang-timeout``); each dead worker is replaced by a process that heals from a
  live member.

It prints per seed the largest |faulty - fault-free| over committed steps, the band width
there, the largest ratio of the two over all steps (< 1: within noise), the final losses, and
how many replacements started from step 0 because no live member held the state.

    nice -n 10 .venv/bin/python bench/elastic_loss_curve.py --seeds 4 --steps 40 --plot /tmp/lc.png
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

GLOBAL_BATCH = 12  # as in the tests' worker: divisible by every membership size 1..4
NAMES = {"loss": "the step's training batch, parameters before its update",
         "eval": "fixed evaluation batch, parameters after the committed step"}  # fmt: skip
_g = torch.Generator().manual_seed(7)
_x = torch.randn(256, 8, generator=_g)
EVAL = (_x, torch.sin(_x.sum(dim=1, keepdim=True)))


def _batch(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step + 100_000 * seed)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def worker(seed: int, steps: int, out: Path, step_sleep: float, hold: set[int]) -> None:
    """One elastic member (under ``stalwart run``): the tests' worker loop plus a loss log.

    At each step in ``hold`` the members first wait for all 3 (as the tests' ``--hold-at``),
    so a fault lands only after the previous one's replacement has joined.
    """
    import stalwart
    from stalwart.elastic import Job
    from stalwart.testing import chaos

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    job = Job(stalwart.TrainingState(model=net, optimizer=opt), verify_every=5)
    chaos.install(job)
    model = job.data_parallel(net)
    optimizer = job.optimizer(opt)
    out.mkdir(parents=True, exist_ok=True)
    tag = os.environ.get("STALWART_ELASTIC_WORKER", "single")
    with (out / f"loss-{tag}.jsonl").open("a") as log:
        while job.step < steps:
            while job.step in hold and job.size < 3:
                job.refresh()
            optimizer.zero_grad()  # a newcomer heals here: read the step after it
            step = job.step
            x, y = _batch(seed, step)
            with torch.no_grad():
                full = F.mse_loss(net(x), y).item()
            F.mse_loss(model(x[job.rank :: job.size]), y[job.rank :: job.size]).backward()
            time.sleep(step_sleep)
            optimizer.step()
            if job.step == step + 1:  # committed (a discarded step leaves job.step alone)
                with torch.no_grad():
                    ev = F.mse_loss(net(EVAL[0]), EVAL[1]).item()
                log.write(json.dumps({"step": step, "loss": full, "eval": ev}) + "\n")
                log.flush()
    job.close()


def schedule(seed: int, steps: int):  # type: ignore[no-untyped-def]
    """Three seeded faults, one per original worker, at distinct steps in the middle half."""
    from stalwart.testing import Kill, KillSchedule

    rng = random.Random(seed)
    lo, hi = steps // 5, steps - steps // 4
    at = sorted(rng.sample(range(lo, hi), 3))
    w = rng.sample(range(3), 3)
    return KillSchedule((
        Kill(w[0], at[0], "collective", rng.uniform(0, 0.003)),  # inside the all-reduce
        Kill(w[1], at[1], "boundary"),
        Kill(w[2], at[2], "collective", 0.0, "STOP"),  # a hang
    ))  # fmt: skip


def run_job(seed: int, a: argparse.Namespace, faulty: bool) -> dict:  # type: ignore[type-arg]
    """One ``stalwart run --nproc 3`` job; its loss curve, faults seen and wall time."""
    from stalwart.elastic import read_events, recoveries

    sched = schedule(seed, a.steps) if faulty else None
    hold = sorted(k.step for k in schedule(seed, a.steps).kills)  # same waits in both runs
    with tempfile.TemporaryDirectory() as tmp:
        ev, out = Path(tmp) / "events", Path(tmp) / "out"
        cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "3", "--events", str(ev),
               "--hang-timeout", str(a.hang_timeout), "--max-restarts", "3",
               str(Path(__file__).resolve()), "--worker", "--seed", str(seed),
               "--steps", str(a.steps), "--out", str(out),
               "--step-sleep", str(a.step_sleep), "--hold", *map(str, hold)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(sched.to_env() if sched else {})}
        t0 = time.monotonic()
        done = subprocess.run(cmd, env=env, capture_output=True, timeout=300)
        wall = time.monotonic() - t0
        seen: dict[str, dict[int, set[float]]] = {"loss": {}, "eval": {}}
        for path in out.glob("loss-*.jsonl"):
            for line in path.read_text().splitlines():
                e = json.loads(line)
                for key, by_step in seen.items():
                    by_step.setdefault(e["step"], set()).add(e[key])
        rec = recoveries(ev)
        scratch = sum(  # a replacement that committed without ever receiving state
            any(e["kind"] == "step" for e in ls)
            and not any(e["kind"] == "state-received" for e in ls)
            for w, ls in read_events(ev).items()
            if w >= 3
        )
    if done.returncode != 0:
        sys.stderr.write(done.stdout.decode()[-2000:] + done.stderr.decode()[-2000:])
    return {"rc": done.returncode, "wall_s": wall, "faults": str(sched) if sched else "",
            "loss": {s: min(v) for s, v in sorted(seen["loss"].items())},
            "eval": {s: min(v) for s, v in sorted(seen["eval"].items())},
            "disagree": sum(len(v) > 1 for by in seen.values() for v in by.values()),
            "recoveries": len(rec), "lost": sum(r.lost_steps or 0 for r in rec),
            "from_scratch": scratch}  # fmt: skip


def compare(clean: dict[int, dict], faulty: dict[int, dict], steps: int, key: str) -> list[dict]:  # type: ignore[type-arg]
    """Per seed: largest |faulty - clean| over committed steps against the band across seeds."""
    band = {s: [c[key][s] for c in clean.values() if s in c[key]] for s in range(steps)}
    rows = []
    for seed, f in faulty.items():
        c, fc = clean[seed][key], f[key]
        common = [s for s in range(steps) if s in c and s in fc]
        diffs = {s: abs(fc[s] - c[s]) for s in common}
        worst = max(diffs, key=diffs.__getitem__) if diffs else -1
        ratio = max((diffs[s] / (max(band[s]) - min(band[s])) for s in common), default=0.0)
        rows.append({"seed": seed, "steps": len(common), "max_abs_diff": diffs.get(worst, 0.0),
                     "at_step": worst, "band_there": max(band[worst]) - min(band[worst])
                     if worst >= 0 else 0.0, "ratio": ratio,
                     "final_clean": c.get(steps - 1), "final_faulty": fc.get(steps - 1),
                     "recoveries": f["recoveries"], "lost": f["lost"],
                     "disagree": f["disagree"] + clean[seed]["disagree"],
                     "from_scratch": f["from_scratch"]})  # fmt: skip
    return rows


def plot(path: Path, clean: dict[int, dict], faulty: dict[int, dict]) -> None:  # type: ignore[type-arg]
    """Fault-free curves (solid) and faulty ones (dashed markers), one colour per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, seed in enumerate(clean):
        col = f"C{i}"
        c, f = clean[seed]["eval"], faulty[seed]["eval"]
        ax.plot(list(c), list(c.values()), color=col, label=f"seed {seed} fault-free")
        ax.plot(list(f), list(f.values()), "x--", color=col, ms=4, label=f"seed {seed} faults")
    ax.set(xlabel="committed step", ylabel="eval loss after the step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(rows: list[dict], clean: dict[int, dict], steps: int, key: str) -> None:  # type: ignore[type-arg]
    """Print the markdown table and the band summary for ``key`` (``loss`` or ``eval``)."""
    print(f"\n{key}: {NAMES[key]}")
    print("| seed | steps | max abs(faulty - clean) | at step | band width there "
          "| max (abs diff / band width) | final clean | final faulty | recoveries "
          "| lost steps | replacements from step 0 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['steps']} | {r['max_abs_diff']:.3g} | {r['at_step']} "
              f"| {r['band_there']:.3g} | {r['ratio']:.2g} | {r['final_clean']:.6f} "
              f"| {r['final_faulty']:.6f} | {r['recoveries']} | {r['lost']} "
              f"| {r['from_scratch']} |")  # fmt: skip
    widths = []
    for s in range(steps):
        v = [c[key][s] for c in clean.values() if s in c[key]]
        if len(v) > 1:
            widths.append(max(v) - min(v))
    if widths:
        print(f"\nfault-free band width across seeds: median {statistics.median(widths):.3g}, "
              f"min {min(widths):.3g}; largest faulty-vs-clean difference "
              f"{max(r['max_abs_diff'] for r in rows):.3g}; members disagreeing on a logged "
              f"loss: {sum(r['disagree'] for r in rows)}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--hang-timeout", type=float, default=2.0)
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of the curves here")
    p.add_argument("--worker", action="store_true", help="(internal) run as one member")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    p.add_argument("--hold", type=int, nargs="*", default=[], help="(internal) wait for 3")
    a = p.parse_args()
    if a.worker:
        worker(a.seed, a.steps, a.out, a.step_sleep, set(a.hold))
        return
    clean: dict[int, dict] = {}  # type: ignore[type-arg]
    faulty: dict[int, dict] = {}  # type: ignore[type-arg]
    for seed in range(a.seeds):
        order = [False, True] if seed % 2 == 0 else [True, False]
        for f in order:
            r = run_job(seed, a, f)
            (faulty if f else clean)[seed] = r
            print(f"seed {seed} {'faults' if f else 'clean '}: rc {r['rc']}, "
                  f"{len(r['loss'])} committed steps, {r['wall_s']:.1f} s {r['faults']}",
                  flush=True)  # fmt: skip
    for key in NAMES:
        report(compare(clean, faulty, a.steps, key), clean, a.steps, key)
    if a.plot:
        plot(a.plot, clean, faulty)
        print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
