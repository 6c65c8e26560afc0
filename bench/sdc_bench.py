"""Silent data corruption caught by parity: seeded single-bit flips in one member's parameters.

Claim 1 (detection): real ``stalwart run`` jobs of the tests' worker script
(``tests/distributed/elastic_worker.py``: an 8-16-1 MLP, SGD with momentum, 40 steps, digests
compared every 5 steps), one bit of one parameter element of one member flipped by the chaos
``BitFlip`` after a seeded step in 11..14, the bit drawn from its class (sign, exponent,
mantissa, low-mantissa). Per class: the share of flips detected within the cadence (an
``sdc-suspect`` naming the flipped member and the flipped tensor at the next check), the steps
from flip to detection, and the share of runs whose final digests equal the fault-free run's.
``--members 2`` runs the same flips on two members: nothing may be decided by rank (both are
named, both roll back), and the final state must still equal the fault-free one.

Claim 2 (cost): the mean step time (all steps, so the checks' spikes count) of the 0.53 M
parameter MLP of ``bench/elastic_bench.py`` on 2 members with the default cadence (50) against
parity off (0), runs alternating; ratio of medians of the per-run means.

    .venv/bin/python bench/sdc_bench.py --seeds 2 --cost-runs 2          # short
    .venv/bin/python bench/sdc_bench.py --seeds 10 --members 3
    .venv/bin/python bench/sdc_bench.py --seeds 10 --members 2 --cost-runs 0
"""

from __future__ import annotations

import argparse
import json
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

from stalwart.elastic import read_events
from stalwart.testing.bitflip import BIT_CLASSES
from stalwart.testing.chaos import BitFlip, KillSchedule

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


def _run(tmp: Path, members: int, schedule: KillSchedule | None) -> tuple[dict[str, Any], str]:
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", str(members), "--max-restarts",
           "2", "--events", str(tmp / "events"), "--timeout", "20", "--hang-timeout", "5",
           "--json", str(WORKER), "--steps", str(STEPS), "--verify-every", str(VERIFY)]  # fmt: skip
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
    means: dict[int, list[float]] = {50: [], 0: []}
    shares: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(runs):
            for v in [50, 0] if r % 2 == 0 else [0, 50]:
                mean, share = _cost_run(v, Path(tmp), warmup + steps, warmup)
                means[v].append(mean)
                shares += [share] if v else []
            print(f"run {r}: verify 50 {means[50][-1]:.3f} ms, off {means[0][-1]:.3f} ms, "
                  f"checks {100 * shares[-1]:.2f} % of the steps' time")  # fmt: skip
    on, off = statistics.median(means[50]), statistics.median(means[0])
    print(f"\nmean step over {steps} steps, 2 members, 0.53 M params, {runs} runs each:")
    print("| verify_every | median of run means (ms) | range (ms) |\n|---|---|---|")
    for v, m in means.items():
        print(f"| {v or 'off'} | {statistics.median(m):.3f} | {min(m):.3f} to {max(m):.3f} |")
    print(f"\ndefault cadence against off (A/B, unpaired): {100 * (on / off - 1):+.2f} %")
    print(f"checks' share of step time within the verify-50 runs (paired): median "
          f"{100 * statistics.median(shares):.2f} %, range {100 * min(shares):.2f} to "
          f"{100 * max(shares):.2f} %")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=2, help="flips per bit class")
    p.add_argument("--members", type=int, default=3, choices=[2, 3])
    p.add_argument("--cost-runs", type=int, default=2, help="0: skip the cost claim")
    p.add_argument("--cost-steps", type=int, default=200)
    p.add_argument("--cost-warmup", type=int, default=20)
    a = p.parse_args()
    if a.seeds:
        detection(a.seeds, a.members)
    if a.cost_runs:
        cost(a.cost_runs, a.cost_steps, a.cost_warmup)


if __name__ == "__main__":
    main()
