"""Root cause over a simulated fleet: does ``stalwart rca FOLDER`` rank the planted causes of each
kind of fault first, and how long does it take?

    .venv/bin/python bench/rca_fleet_bench.py --runs 200 1000 --seeds 10 \
        --json bench/results/rca_fleet.json

For each fleet size and seed, ``stalwart.testing.simulate_fleet`` writes the runs (48 hosts in
6 racks; 3 bad hosts and one driver version raise SDC suspects, a rack crashes, a kernel hangs,
a CPU model straggles; background faults everywhere), then:

- ``stalwart rca FOLDER --json-out`` runs as a fresh process (wall time from the command line:
  interpreter start, imports, reading the rows, four analyses, JSON), and ``analyze_fleet`` runs
  in this process (the analysis alone, imports warm);
- for each kind, with k planted causes, precision at k: the share of the first k findings that
  are a planted cause on its own; "first" when that share is 1 (the test's criterion); and
  "confused" when a first-k finding names a cause planted for another kind.

The peers rank single attribute values the way an operator's GROUP BY would, over the same table
(``read_fleet``): by lift among values holding at least 1 % of the incarnations, and by the
binomial likelihood ratio of the value's rate against the overall rate (Kulldorff's scan
statistic over single values; the stronger of the two). Printed: medians and ranges over seeds,
interleaved (one seed: simulate, CLI, in-process, peers), and the load average (the machine is
shared: wall times are noisy, precision is not).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stalwart.diagnose import analyze_fleet
from stalwart.diagnose.fleet import FaultKind, read_fleet
from stalwart.testing.fleet import simulate_fleet

Item = tuple[str, str]


def _score(ranked: list[tuple[Item, ...]], truth: dict[str, tuple[Item, ...]], kind: str) -> dict:
    planted = set(truth[kind])
    others = {i for k, p in truth.items() if k != kind for i in p}
    top = ranked[: len(planted)]
    hits = sum(1 for f in top if len(f) == 1 and f[0] in planted)
    return {
        "precision": hits / len(planted),
        "first": hits == len(planted),
        "confused": any(set(f) & others for f in top),
    }


def _peers(folder: Path, kind: str) -> dict[str, list[tuple[Item, ...]]]:
    """Single attribute values ranked by lift (values of >= 1 % of the rows) and by LLR."""
    log = read_fleet(folder)
    rows = log.table.to_pylist()
    n, f = len(rows), sum(r[kind] for r in rows)
    base = f / n
    stats: dict[Item, list[int]] = {}
    for r in rows:
        for a in log.attributes:
            s = stats.setdefault((a, str(r[a])), [0, 0])
            s[0] += 1
            s[1] += r[kind]
    lift, llr = [], []
    for item, (rows_in, fails) in stats.items():
        rate = fails / rows_in
        if rows_in >= 0.01 * n:
            lift.append((rate / base if base else 0.0, item))
        llr.append((_llr(fails, rows_in, base), item))
    return {
        "groupby-lift": [(i,) for _, i in sorted(lift, reverse=True)],
        "groupby-llr": [(i,) for _, i in sorted(llr, reverse=True)],
    }


def _llr(f: int, n: int, r: float) -> float:
    p = f / n
    if p <= r or r <= 0:
        return 0.0
    out = f * math.log(p / r)
    if n > f:
        out += (n - f) * math.log((1 - p) / (1 - r))
    return out


def _cli(folder: Path, out: Path) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "stalwart", "rca", str(folder), "--json-out", str(out)],
        check=True,
        capture_output=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    return time.perf_counter() - start


def _one(runs: int, seed: int, scratch: Path) -> dict[str, Any]:
    folder = scratch / f"fleet-{runs}-{seed}"
    truth = simulate_fleet(folder, runs=runs, seed=seed)
    cli_s = _cli(folder, scratch / "rca.json")
    start = time.perf_counter()
    found = analyze_fleet(folder)
    lib_s = time.perf_counter() - start
    row: dict[str, Any] = {
        "runs": runs,
        "seed": seed,
        "members": truth.members,
        "faults": truth.faults,
        "cli_s": cli_s,
        "analyze_s": lib_s,
        "kinds": {},
    }
    for kind in FaultKind:
        ranked = [tuple(f.items.items()) for f in found.kinds[kind].findings]
        scores = {"stalwart": _score(ranked, truth.causes, kind)}
        for name, peer in _peers(folder, kind).items():
            scores[name] = _score(peer, truth.causes, kind)
        row["kinds"][kind.value] = scores
    return row


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}, {max(xs):.2f}]"


def _report(rows: list[dict[str, Any]]) -> None:
    for runs in sorted({r["runs"] for r in rows}):
        mine = [r for r in rows if r["runs"] == runs]
        members = [r["members"] for r in mine]
        print(
            f"\n{runs} runs x {len(mine)} seeds ({statistics.median(members):.0f} incarnations, "
            f"median): stalwart rca (CLI, cold process) {_spread([r['cli_s'] for r in mine])} s; "
            f"analyze_fleet in process {_spread([r['analyze_s'] for r in mine])} s"
        )
        print(f"{'kind':12s} {'method':13s} {'precision@k':>22s} {'first':>7s} {'confused':>9s}")
        for kind in FaultKind:
            for method in ("stalwart", "groupby-llr", "groupby-lift"):
                s = [r["kinds"][kind.value][method] for r in mine]
                prec = [x["precision"] for x in s]
                first = sum(x["first"] for x in s)
                confused = sum(x["confused"] for x in s)
                print(
                    f"{kind.value:12s} {method:13s} {_spread(prec):>22s} "
                    f"{first:>3d}/{len(s):<3d} {confused:>5d}/{len(s):<3d}"
                )
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, nargs="+", default=[200, 1000])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None, help="write every number here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="stalwart-fleet-") as tmp:
        for seed in range(args.seeds):
            for runs in args.runs:
                rows.append(_one(runs, seed, Path(tmp)))
                r = rows[-1]
                ok = sum(r["kinds"][k.value]["stalwart"]["first"] for k in FaultKind)
                print(
                    f"runs={runs} seed={seed}: {r['members']} incarnations, "
                    f"CLI {r['cli_s']:.2f} s, in process {r['analyze_s']:.2f} s, "
                    f"kinds with causes first {ok}/4",
                    flush=True,
                )
    _report(rows)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
