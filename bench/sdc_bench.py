"""Silent data corruption while training: flips in one member's parameters and gradients, clean
chaos for false suspects, and the cost of the default cadence.

Claim 1 (detection, ``--seeds``): real ``stalwart run`` jobs of the tests' worker script
(``tests/distributed/elastic_worker.py``: an 8-16-1 MLP, SGD with momentum, 40 steps, digests
compared every 5 steps), one bit of one parameter element of one member flipped by the chaos
``BitFlip`` after a seeded step in 11..14, the bit drawn from its class (sign, exponent,
mantissa, low-mantissa). Per class: the share of flips detected within the cadence (an
``sdc-suspect`` naming the flipped member and the flipped tensor at the next check), the steps
from flip to detection, and the share of runs whose final digests equal the fault-free run's.
``--members 2`` runs the same flips on two members: nothing may be decided by rank (both are
named, both roll back), and the final state must still equal the fault-free one.

Claim 2 (cost, ``--cost-runs``): the mean step time (all steps, so the checks' spikes count)
of the 0.53 M parameter MLP of ``bench/elastic_bench.py`` on 2 members with the default
cadence (50) against parity off (0), in interleaved pairs (the order alternates); per pair
the ratio, and within each verify-50 run the checks' share (steps with a digest against
steps without: the same load weighs on both).

Claim 3 (gradient flips, ``--grad-seeds``): the same job on 3 members, one bit of one element
of one member's *local gradient* flipped (chaos ``GradFlip``, seeded, per bit class) while a
step in 11..14 is attempted, before the all-reduce. The reduction spreads it to every replica
alike, so parity cannot see it (the parity mismatches are counted to show it): which
in-reduction rule names the member (non-finite: the step is discarded and retried; gradient
norm: named, the step kept), and for the flips whose step was kept the final model's
held-out loss against the fault-free run's (relative).

Claim 5 (replica groups, ``--groups``): 2 groups x 2 ranks (FSDP2), a seeded flip in one
rank's shard: named on that shard, every rank rolls back, final per-shard digests equal the
fault-free run's (two 4-process runs per case: too slow for the test suite on 2 cores).

Claim 4 (false suspects, ``--clean-runs``): seeded kills, hangs (SIGSTOP) and raises
(``KillSchedule.mixed``, 2 faults per run, replacements rejoin), no flips; every
``sdc-suspect`` would be false. Seeds 0-9 are for tuning, report seeds from 100.

    .venv/bin/python bench/sdc_bench.py --seeds 2 --cost-runs 2          # short
    .venv/bin/python bench/sdc_bench.py --seeds 10 --members 3
    .venv/bin/python bench/sdc_bench.py --seeds 10 --members 2 --cost-runs 0
    .venv/bin/python bench/sdc_bench.py --seeds 0 --cost-runs 0 --grad-seeds 10
    .venv/bin/python bench/sdc_bench.py --seeds 0 --cost-runs 0 --clean-runs 50 --first-seed 100
    .venv/bin/python bench/sdc_bench.py --seeds 0 --cost-runs 0 --groups 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.elastic import read_events
from stalwart.testing.bitflip import BIT_CLASSES
from stalwart.testing.chaos import BitFlip, GradFlip, KillSchedule

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed" / "elastic_worker.py"
COST_WORKER = ROOT / "bench" / "elastic_bench.py"
STEPS, VERIFY = 40, 5
FLIPPED = re.compile(r"worker (\d+) flipped bit (\d+) of (\S+)\[(\d+)\]: (\S+) -> (\S+)")


def _env(schedule: KillSchedule | None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("STALWART_ELASTIC_STORE", None)
    env.pop("STALWART_CHAOS", None)
    return {**env, **(schedule.to_env() if schedule else {})}


def _run(tmp: Path, members: int, schedule: KillSchedule | None, steps: int = STEPS,
         launcher: tuple[str, ...] = ()) -> tuple[dict[str, Any], str]:  # fmt: skip
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", str(members), "--max-restarts",
           "2", "--events", str(tmp / "events"), "--timeout", "20", "--hang-timeout", "5",
           *launcher, "--json", str(WORKER), "--steps", str(steps), "--verify-every",
           str(VERIFY), "--out", str(tmp / "out")]  # fmt: skip
    done = subprocess.run(cmd, env=_env(schedule), capture_output=True, text=True, timeout=300)
    doc = json.loads(done.stdout) if done.stdout.strip() else {"exit_code": done.returncode}
    doc["events"] = read_events(tmp / "events") if (tmp / "events").exists() else {}
    return doc, done.stderr


def _trial(tmp: Path, members: int, bit_class: str, seed: int, reference: Any) -> dict[str, Any]:
    rng = random.Random(f"{bit_class}-{seed}")
    worker, step = rng.randrange(members), rng.randint(11, 14)
    flip = BitFlip(worker, step, bit_class=bit_class, seed=seed)
    doc, err = _run(tmp, members, KillSchedule(flips=(flip,)))
    m = FLIPPED.search(err)
    tensor = m.group(3) if m else None
    suspects = [e for lines in doc["events"].values() for e in lines
                if e["kind"] == "sdc-suspect"]  # fmt: skip
    named = [e for e in suspects if e["suspect"] == worker and e["tensor"] == tensor]
    by_rank = members == 2 and any(
        e["kind"] == "state-received" and e["step"] > 0
        for lines in doc["events"].values() for e in lines
    )  # fmt: skip
    return {
        "class": bit_class, "worker": worker, "step": step, "tensor": tensor,
        "values": (m.group(5), m.group(6)) if m else None,
        "detected": bool(named), "latency": min(e["step"] for e in named) - step if named else None,
        "in_cadence": bool(named) and min(e["step"] for e in named) - step <= VERIFY,
        "equal": doc.get("summary", {}).get("final_digests") == reference,
        "by_rank": by_rank, "rc": doc.get("exit_code"),
    }  # fmt: skip


def detection(seeds: int, members: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        clean, _ = _run(Path(tmp) / "clean", members, None)
        reference = clean["summary"]["final_digests"]
        assert not any(e["kind"] == "sdc-suspect" for v in clean["events"].values() for e in v)
        rows = []
        for seed in range(seeds):
            for c in BIT_CLASSES:
                r = _trial(Path(tmp) / f"{c}-{seed}", members, c, seed, reference)
                rows.append(r)
                print(json.dumps(r), flush=True)
    print(f"\n{members} members, verify every {VERIFY}, {STEPS} steps, {seeds} seeds per class")
    print("| bit class | flips | detected in cadence | steps flip->detection (median, range) "
          "| final == fault-free | decided by rank |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for c in BIT_CLASSES:
        rs = [r for r in rows if r["class"] == c]
        lat = [r["latency"] for r in rs if r["latency"] is not None]
        lat_s = f"{statistics.median(lat)} ({min(lat)}-{max(lat)})" if lat else "-"
        n, found = len(rs), sum(r["in_cadence"] for r in rs)
        equal, by_rank = sum(r["equal"] for r in rs), sum(r["by_rank"] for r in rs)
        print(f"| {c} | {n} | {found}/{n} | {lat_s} | {equal}/{n} | {by_rank} |")


GRAD_FLIPPED = re.compile(r"worker (\d+) flipped bit (\d+) of (\S+)\.grad\[(\d+)\]: (\S+) -> (\S+)")
_SIGNAL_RULES = ("nonfinite-count", "grad-norm")


def _kinds(doc: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for lines in doc["events"].values() for e in lines if e["kind"] == kind]


def final_loss(out: Path) -> float:
    """MSE of a run's final model (any final member's ``final-*.pt``: they are equal) on 50
    held-out global batches of the worker's task (steps 10000-10049; training uses 0-39)."""
    files = sorted(out.glob("final-*.pt"))
    if not files:
        return float("nan")
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model.load_state_dict(torch.load(files[0], weights_only=True)["params"])
    losses = []
    with torch.no_grad():
        for step in range(10_000, 10_050):
            g = torch.Generator().manual_seed(1000 + step)
            x = torch.randn(12, 8, generator=g)
            losses.append(float(F.mse_loss(model(x), torch.sin(x.sum(dim=1, keepdim=True)))))
    return statistics.fmean(losses)


def _grad_trial(tmp: Path, bit_class: str, seed: int, ref: tuple[Any, float]) -> dict[str, Any]:
    rng = random.Random(f"grad-{bit_class}-{seed}")
    worker, step = rng.randrange(3), rng.randint(11, 14)
    flip = GradFlip(worker, step, index=-1, bit_class=bit_class, seed=seed)
    doc, err = _run(tmp, 3, KillSchedule(grad_flips=(flip,)))
    m = GRAD_FLIPPED.search(err)
    caught = sorted({e["decided_by"] for e in _kinds(doc, "sdc-suspect")
                     if e["suspect"] == worker and e["step"] == step})  # fmt: skip
    loss = final_loss(tmp / "out")
    return {
        "class": bit_class, "worker": worker, "step": step, "tensor": m.group(3) if m else None,
        "values": (m.group(5), m.group(6)) if m else None, "caught": caught,
        "other_suspects": sum(e["step"] != step or e["suspect"] != worker
                              for e in _kinds(doc, "sdc-suspect")),
        "parity_mismatches": len(_kinds(doc, "parity-mismatch")),
        "equal": doc.get("summary", {}).get("final_digests") == ref[0],
        "rel_loss": abs(loss - ref[1]) / ref[1] if math.isfinite(loss) else float("inf"),
        "rc": doc.get("exit_code"),
    }  # fmt: skip


def grad_flips(seeds: int, first: int = 0) -> None:
    """Claim 3: one bit of one element of one member's local gradient (3 members), before
    the all-reduce: which in-reduction rule names it, and what the kept ones cost."""
    with tempfile.TemporaryDirectory() as tmp:
        clean, _ = _run(Path(tmp) / "clean", 3, None)
        ref = (clean["summary"]["final_digests"], final_loss(Path(tmp) / "clean" / "out"))
        rows = []
        for seed in range(first, first + seeds):
            for c in BIT_CLASSES:
                rows.append(_grad_trial(Path(tmp) / f"g-{c}-{seed}", c, seed, ref))
                print(json.dumps(rows[-1]), flush=True)
    print(f"\n3 members, gradient bit flips before the all-reduce, seeds {first}-"
          f"{first + seeds - 1} per class; "
          f"fault-free held-out loss {ref[1]:.5f}")  # fmt: skip
    print("| bit class | flips | named: non-finite (step discarded, retried) | named: grad-norm "
          "(step kept) | not named | parity mismatches | final == fault-free | "
          "kept flips: final loss vs fault-free, relative (median, max) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for c in BIT_CLASSES:
        rs = [r for r in rows if r["class"] == c]
        nonfinite = sum("nonfinite-count" in r["caught"] for r in rs)
        norm = sum(r["caught"] == ["grad-norm"] for r in rs)
        kept = [r["rel_loss"] for r in rs if "nonfinite-count" not in r["caught"]]
        dist = f"{statistics.median(kept):.2e}, {max(kept):.2e}" if kept else "-"
        n = len(rs)
        print(f"| {c} | {n} | {nonfinite}/{n} | {norm}/{n} | {sum(not r['caught'] for r in rs)}/{n}"
              f" | {sum(r['parity_mismatches'] for r in rs)} | {sum(r['equal'] for r in rs)}/{n}"
              f" | {dist} |")  # fmt: skip


def _clean_trial(tmp: Path, seed: int) -> dict[str, Any]:
    schedule = KillSchedule.mixed(seed, workers=3, steps=range(4, 26), count=2,
                                  kinds=("kill", "stop", "raise"))  # fmt: skip
    doc, _ = _run(tmp, 3, schedule, steps=30)
    suspects = _kinds(doc, "sdc-suspect")
    kinds = [("stop" if k.signal == "STOP" else "kill", k.where) for k in schedule.kills]
    return {
        "seed": seed, "faults": kinds + [("raise", r.where) for r in schedule.raises],
        "rc": doc.get("exit_code"), "restarts": doc.get("restarts"),
        "suspects": len({(e["step"], e["suspect"], e["decided_by"]) for e in suspects}),
        "norm_suspects": len({(e["step"], e["suspect"]) for e in suspects
                              if e["decided_by"] == "grad-norm"}),
        "mismatches": len(_kinds(doc, "parity-mismatch")),
        "equal": doc.get("final_digests_equal"),
    }  # fmt: skip


def clean_runs(runs: int, first_seed: int) -> None:
    """Claim 4: seeded kills, hangs (SIGSTOP) and raises with replacements rejoining, no flips:
    every ``sdc-suspect`` is a false one."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(first_seed, first_seed + runs):
            rows.append(_clean_trial(Path(tmp) / f"c{seed}", seed))
            print(json.dumps(rows[-1]), flush=True)
    ok = sum(r["rc"] == 0 and r["equal"] for r in rows)
    print(
        f"\n{runs} clean chaos runs (seeds {first_seed}-{first_seed + runs - 1}; 3 members, "
        "30 steps, 2 faults each from kill / SIGSTOP / raise, replacements rejoin):"
    )
    print(f"finished with equal final digests: {ok}/{runs}; restarts: "
          f"{sum(r['restarts'] or 0 for r in rows)}; sdc-suspect (distinct step, member, rule): "
          f"{sum(r['suspects'] for r in rows)}, of which grad-norm: "
          f"{sum(r['norm_suspects'] for r in rows)}; parity mismatches: "
          f"{sum(r['mismatches'] for r in rows)}")  # fmt: skip


GROUPS_WORKER = ROOT / "tests" / "distributed" / "groups_worker.py"


def _groups_run(tmp: Path, schedule: KillSchedule | None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "4", "--group-size", "2",
           "--max-restarts", "0", "--events", str(tmp / "events"), "--timeout", "20", "--json",
           str(GROUPS_WORKER), "--steps", "12", "--verify-every", "4"]  # fmt: skip
    done = subprocess.run(cmd, env=_env(schedule), capture_output=True, text=True, timeout=300)
    doc = json.loads(done.stdout) if done.stdout.strip() else {"exit_code": done.returncode}
    doc["events"] = read_events(tmp / "events") if (tmp / "events").exists() else {}
    return doc


def groups(runs: int) -> None:
    """Claim 5: replica groups (2 groups x 2 ranks, FSDP2, ``groups_worker.py``), one bit of
    one rank's shard flipped after step 5 or 6 (seeded: worker, bit class, element): the check
    at step 8 names that shard's ranks of both groups (two groups: no majority, ``rollback``),
    all four ranks roll back to step 4, and every rank's final digest equals the fault-free
    run's (per shard). Two 4-process runs per case: too slow for the test suite on 2 cores."""
    with tempfile.TemporaryDirectory() as tmp:
        ref = _groups_run(Path(tmp) / "clean", None)["summary"]["final_digests"]
        ok = 0
        for seed in range(runs):
            rng = random.Random(f"groups-{seed}")
            worker, step = rng.randrange(4), rng.choice([5, 6])
            c = BIT_CLASSES[seed % len(BIT_CLASSES)]
            doc = _groups_run(Path(tmp) / f"g{seed}", KillSchedule(flips=(
                BitFlip(worker, step, bit_class=c, seed=seed),)))  # fmt: skip
            shard = worker % 2  # the flipped rank's shard; its peer in the other group
            named = {(e["wid"], e["suspect"], e["step"]) for e in _kinds(doc, "sdc-suspect")}
            rolled = {(e["wid"], e["rolled_back_from"], e["step"])
                      for e in _kinds(doc, "parity-mismatch")}  # fmt: skip
            row = {
                "seed": seed, "worker": worker, "step": step, "class": c, "rc": doc["exit_code"],
                "named_right": named == {(w, s, 8) for w in (shard, shard + 2)
                                         for s in (shard, shard + 2)},
                "all_rolled_back": rolled == {(w, 8, 4) for w in range(4)},
                "equal": doc.get("summary", {}).get("final_digests") == ref,
            }  # fmt: skip
            ok += row["named_right"] and row["all_rolled_back"] and row["equal"]
            print(json.dumps(row), flush=True)
    print(
        f"\nreplica groups (2 x 2, FSDP2), {runs} seeded shard flips: named on the flipped "
        f"shard, every rank rolled back, final per-shard digests == fault-free: {ok}/{runs}"
    )


def _cost_run(verify_every: int, tmp: Path, total: int, warmup: int) -> tuple[float, float]:
    """Mean step (ms, the worker's own clock) and the checks' share of it from the ``step``
    events of the same run (steps with a digest against the rest: paired, so the load of
    the shared machine weighs on both alike)."""
    out, events = tmp / f"cost-{time.monotonic_ns()}.json", tmp / f"ev-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "2", "--events", str(events),
           str(COST_WORKER), "--worker", "stalwart", "--total", str(total), "--out", str(out),
           "--verify-every", str(verify_every)]  # fmt: skip
    subprocess.run(cmd, env=_env(None), check=True, capture_output=True, timeout=600)
    times = json.loads(out.read_text())[warmup:]
    steps = [e for e in read_events(events)[0] if e["kind"] == "step" and e["step"] > warmup]
    checked = [e["dt"] for e in steps if e.get("digest")]
    plain = [e["dt"] for e in steps if not e.get("digest")]
    share = 0.0
    if checked and plain:
        base = statistics.median(plain)
        share = (statistics.median(checked) - base) * len(checked) / (base * len(steps))
    return statistics.fmean(times) * 1e3, share


def cost(runs: int, steps: int, warmup: int) -> None:
    """Interleaved pairs (the order alternates): per pair, the ratio of the mean step with the
    default cadence to the one without; and, within each verify-50 run, the checks' share."""
    means: dict[int, list[float]] = {50: [], 0: []}
    shares: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(runs):
            for v in [50, 0] if r % 2 == 0 else [0, 50]:
                mean, share = _cost_run(v, Path(tmp), warmup + steps, warmup)
                means[v].append(mean)
                shares += [share] if v else []
            print(f"pair {r}: verify 50 {means[50][-1]:.3f} ms, off {means[0][-1]:.3f} ms, "
                  f"checks {100 * shares[-1]:.2f} % of the steps' time", flush=True)  # fmt: skip
    ratios = [100 * (on / off - 1) for on, off in zip(means[50], means[0], strict=True)]
    print(f"\nmean step over {steps} steps, 2 members, 0.53 M params, {runs} interleaved pairs:")
    print("| verify_every | median of run means (ms) | range (ms) |\n|---|---|---|")
    for v, m in means.items():
        print(f"| {v or 'off'} | {statistics.median(m):.3f} | {min(m):.3f} to {max(m):.3f} |")
    print(f"\ndefault cadence against off, per pair: median {statistics.median(ratios):+.2f} %, "
          f"range {min(ratios):+.2f} to {max(ratios):+.2f} %")  # fmt: skip
    print(f"checks' share of step time within the verify-50 runs: median "
          f"{100 * statistics.median(shares):.2f} %, range {100 * min(shares):.2f} to "
          f"{100 * max(shares):.2f} %")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=2, help="parameter flips per bit class")
    p.add_argument("--grad-seeds", type=int, default=0, help="gradient flips per bit class")
    p.add_argument("--grad-first-seed", type=int, default=0)
    p.add_argument("--clean-runs", type=int, default=0, help="clean chaos runs (no flips)")
    p.add_argument("--first-seed", type=int, default=100, help="the clean runs' first seed")
    p.add_argument("--groups", type=int, default=0, help="replica-group shard flips")
    p.add_argument("--members", type=int, default=3, choices=[2, 3])
    p.add_argument("--cost-runs", type=int, default=2, help="0: skip the cost claim")
    p.add_argument("--cost-steps", type=int, default=200)
    p.add_argument("--cost-warmup", type=int, default=20)
    a = p.parse_args()
    if a.seeds:
        detection(a.seeds, a.members)
    if a.grad_seeds:
        grad_flips(a.grad_seeds, a.grad_first_seed)
    if a.clean_runs:
        clean_runs(a.clean_runs, a.first_seed)
    if a.groups:
        groups(a.groups)
    if a.cost_runs:
        cost(a.cost_runs, a.cost_steps, a.cost_warmup)


if __name__ == "__main__":
    main()
