"""Validate ``stalwart.plan``'s goodput model against measured chaos runs under ``stalwart run``.

Each run is a real elastic job (``bench/plan_chaos_worker.py``: 2 or 3 members, a 12.6 MB state,
a durable tier every K steps) hit by a seeded Poisson schedule (``KillSchedule.poisson``) of
kills (one member SIGKILLed), hangs (one member SIGSTOPped; the launcher replaces it) and
all-holder losses (every member killed at once: the job resumes from the durable tier).

**Goodput, one definition for model and runs**: kept training progress times the fault-free
step time, over wall time. Measured: ``steps x step_s / (t_last_commit - t_origin)``, where
the job's clock starts when the first member reaches its first step boundary (process start
and the launcher's exit are outside the window: the model has no start-up either) and
``step_s`` is the run's own fault-free, save-free step time (:func:`fault_free_step_s`); the
model is given the same ``step_s``, and its ETTR is the same ratio (docs/plan.md).

**Calibration, never on the validation runs**: two fault-free probes per member count with a
save every 5 steps give the cost of one durable save (the window less the fault-free steps, per
save; the median of all probes); one run with faults at fixed times (kill, hang, all, kill,
hang, all; 20 s apart; 2 members) gives the detection, resume, heal and restart times (means:
the model wants expected costs, and a process's start on the shared box takes 2 to 9 s); the
save's commit lag and a load are timed in this process. The 3-member configurations get the
2-member fault costs (an extrapolation). ``--calibration FILE`` reuses a calibration (the probe
and fault runs beside it are read again), ``--refit-faults`` runs the fault run again,
``--rescore`` evaluates the model again for the runs in ``--out/runs.json``; a cut-short
validation goes on from its ``runs.json``.

**Mapping to the model**: N accelerators, one per node, one rack of N nodes, group size 1 (N
live replicas); a kill is a ``crash``, a hang a ``hang``, an all-holder loss a ``rack`` loss
(every host of the job at once); the durable tier is the model's ``remote`` tier (the tier that
survives the loss of every host; the ``disk`` tier is switched off with a capacity of ~0);
strategy ``stalwart-no-memory``. The prediction is the simulated ETTR, at the schedule's rate
(``nominal``) and at each run's realised rate of each kind (faults taken in its window / the
window: the Poisson count's sampling noise in a 30 s run is larger than the goal).

    OMP_NUM_THREADS=1 .venv/bin/python bench/plan_validate.py --seeds 2 --out /tmp/plan-validate

Writes ``calibration.json`` and ``runs.json`` under ``--out`` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
WORKER = ROOT / "plan_chaos_worker.py"
BATCH_S = 0.12  # the full job's step, paced (the members' natural step is ~0.07-0.09 s)
TIMEOUT_S = 6.0  # stalwart run --timeout: the hang timeout is 3 s
PROBE_STEPS = 150
PROBE_REPEATS = 2
SAVE_EVERY = 5  # steps between saves in the probe of the save's cost
STEPS = 200
HORIZON_S = 400.0


@dataclass(frozen=True)
class Config:
    name: str
    members: int
    rate_per_s: float
    kinds: tuple[str, ...]
    interval: str | int  # whole steps, or "rec" / "0.5x" / "2x" of the recommended interval


CONFIGS = (
    Config("kill-2", 2, 1 / 8, ("kill",), 20),
    Config("kill-3", 3, 1 / 8, ("kill",), 20),
    Config("kill-2-fast", 2, 1 / 4, ("kill",), 10),
    Config("hang-2", 2, 1 / 10, ("stop",), 20),
    Config("hang-3", 3, 1 / 10, ("stop",), 40),
    Config("mix-2", 2, 1 / 8, ("kill", "stop", "all"), "rec"),
    Config("mix-3", 3, 1 / 8, ("kill", "stop", "all"), "rec"),
    Config("all-10s", 2, 1 / 10, ("all",), "rec"),
    Config("all-20s", 2, 1 / 20, ("all",), "rec"),
    Config("all-20s-half", 2, 1 / 20, ("all",), "0.5x"),
    Config("all-20s-double", 2, 1 / 20, ("all",), "2x"),
)


# -- one run --------------------------------------------------------------------------------


def _env(schedule: Any) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **schedule.to_env()}
    env.pop("STALWART_ELASTIC_STORE", None)
    return env


def fault_free_step_s(commits: list[dict[str, Any]], members: int, every: int) -> float:
    """The run's own fault-free, save-free step time: the mean time from one commit to the
    next of the same worker within one epoch of every member, leaving out the step that saves
    and the two after it (its pause and its background write) when saves are 10 or more steps
    apart. The shared box's speed drifts
    by +-15 % between runs, more than the goal; measured goodput and the model both take it."""
    last: dict[Any, dict[str, Any]] = {}
    gaps = []
    for e in sorted(commits, key=lambda e: e["t"]):
        before = last.get(e["wid"])
        last[e["wid"]] = e
        if (
            before is None
            or before["step"] + 1 != e["step"]
            or (every >= 10 and e["step"] % every < 3)
        ):
            continue
        if before["epoch"] == e["epoch"] and len(e["members"]) == members:
            gaps.append(e["t"] - before["t"])
    return statistics.fmean(gaps)


def launch(tmp: Path, members: int, steps: int, every: int, timed: tuple[Any, ...] = ()
           ) -> dict[str, Any]:  # fmt: skip
    """One ``stalwart run``; returns what its event files and the chaos records say."""
    from stalwart.testing import KillSchedule

    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    schedule = KillSchedule(timed=timed, clock=str(tmp / "clock"), members=members)
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", str(members), "--max-restarts",
           "200", "--events", str(tmp / "events"), "--timeout", str(TIMEOUT_S), str(WORKER),
           "--steps", str(steps), "--batch-s", str(BATCH_S), "--members", str(members),
           "--ckpt", str(tmp / "ckpt"),
           "--ckpt-every", str(every)]  # fmt: skip
    started = time.time()
    done = subprocess.run(cmd, env=_env(schedule), capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"stalwart run failed ({done.returncode}): {done.stderr[-3000:]}")
    shutil.rmtree(tmp / "ckpt", ignore_errors=True)  # the events stay, for a later look
    return {"wall_s": time.time() - started, **read_run(tmp, members, steps, every)}


def read_run(tmp: Path, members: int, steps: int, every: int) -> dict[str, Any]:
    from stalwart.elastic import read_events
    from stalwart.elastic.events import launcher_lines
    from stalwart.testing.poisson import read_claims, read_origin

    origin = read_origin(tmp / "clock")
    lines = [e for ls in read_events(tmp / "events").values() for e in ls if "t" in e]
    lines += [e for e in launcher_lines(tmp / "events") if "t" in e]
    for e in lines:
        e["t"] -= origin
    commits = [e for e in lines if e["kind"] == "step" and e["committed"]]
    claims = [{**c, "t": float(c["t"]) - origin} for c in read_claims(tmp / "clock")]
    return {"origin": origin, "end_s": max(e["t"] for e in commits), "steps": steps,
            "step_s": fault_free_step_s(commits, members, every if every > 0 else 10**9),
            "final_step": max(e["step"] for e in commits), "claims": claims,
            "events": sorted(lines, key=lambda e: e["t"])}  # fmt: skip


# -- calibration ----------------------------------------------------------------------------


def _first(events: list[dict[str, Any]], after: float, pred: Any) -> dict[str, Any] | None:
    return next((e for e in events if e["t"] > after and pred(e)), None)


def fault_costs(run: dict[str, Any], step_s: float) -> dict[str, list[float]]:
    """Detection, resume, heal and restart times around each fault of a calibration run."""
    ev, out = run["events"], {"crash_detect_s": [], "hang_detect_s": [], "resume_s": [],
                              "heal_s": [], "restart_s": [], "rejoin_s": []}  # fmt: skip
    for claim in run["claims"]:
        t = claim["t"]
        # the first step begun after the fault and committed (one in flight may commit still)
        began = _first(ev, t, lambda e, t=t: e["kind"] == "step" and e["committed"]
                       and e["t"] - e["dt"] > t)  # fmt: skip
        assert began is not None
        if claim["kind"] == "all":
            if began["t"] - began["dt"] - t > 1.0:  # else a member that joined after it lived
                out["restart_s"].append(began["t"] - began["dt"] - t)
            continue
        if claim["rank"] >= claim["size"]:
            continue  # it struck the member still starting: nobody died
        found = _first(ev, t, lambda e: e["kind"] == "fault-detected")
        assert found is not None
        key = "crash_detect_s" if claim["kind"] == "kill" else "hang_detect_s"
        out[key].append(found["t"] - t)
        resumed = _first(ev, found["t"], lambda e: e["kind"] == "step" and e["committed"])
        assert resumed is not None
        out["resume_s"].append(max(resumed["t"] - resumed["dt"] - found["t"], 0.0))
        spawn = _first(ev, found["t"] - 1, lambda e: e["kind"] == "spawned")
        assert spawn is not None
        wid = spawn["wid"]
        healed = _first(ev, spawn["t"], lambda e, w=wid: e["wid"] == w and e["kind"] == "step"
                        and e["committed"])  # fmt: skip
        assert healed is not None
        out["heal_s"].append(healed["t"] - spawn["t"])
        # the survivors' stall when the replacement joins: reconfigure to commit, less a step
        conf = _first(ev, spawn["t"], lambda e, w=wid: e["wid"] != w
                      and e["kind"] == "reconfigured" and w in e.get("members", ()))  # fmt: skip
        joined = conf and _first(ev, conf["t"], lambda e, c=conf: e["wid"] == c["wid"]
                                 and e["kind"] == "first-commit-after-change")  # fmt: skip
        if joined and conf:
            out["rejoin_s"].append(max(joined["t"] - conf["t"] - step_s, 0.0))
    return out


def io_costs() -> dict[str, float]:
    """State size, the durable save's commit lag and a load's time, timed in this process."""
    import tempfile

    import torch
    from torch import nn

    import stalwart
    from stalwart.checkpoint import Checkpointer

    model = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(),
                          nn.Linear(1024, 256))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.ones(2, 256)).sum().backward()
    opt.step()
    state = stalwart.TrainingState(model=model, optimizer=opt)
    gb = 2 * sum(p.numel() * 4 for p in model.parameters()) / 1e9  # weights + momentum
    lags, loads = [], []
    with tempfile.TemporaryDirectory() as d:
        ck = Checkpointer(d)
        for step in range(1, 6):
            t0 = time.perf_counter()
            ck.save_async(step, state).wait()
            lags.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ck.load(state, step=step)
            loads.append(time.perf_counter() - t0)
        ck.close()
    return {"state_gb": gb, "lag_s": statistics.median(lags), "load_s": statistics.median(loads)}


def calibrate(out: Path, probes: dict[str, Any] | None = None) -> dict[str, Any]:
    from stalwart.testing.poisson import Timed

    cal: dict[str, Any] = {"io": io_costs(), "step_s": {}, "save_s": {}, **(probes or {})}
    for n in () if probes else (2, 3):
        # a save's cost, within each probe: its window less its fault-free, save-free steps
        steps_s, saves_s = [], []
        for i in range(PROBE_REPEATS):
            run = launch(out / f"probe-{n}-{i}", n, PROBE_STEPS, SAVE_EVERY)
            steps_s.append(run["step_s"])
            saves_s.append((run["end_s"] / run["final_step"] - run["step_s"]) * SAVE_EVERY)
        cal["step_s"][n], cal["save_s"][n] = statistics.median(steps_s), statistics.median(saves_s)
        cal["probe_samples"] = {**cal.get("probe_samples", {}), n: [steps_s, saves_s]}
        print(f"probe {n} members: step {steps_s} s, save {saves_s} s", flush=True)
    kinds = ("kill", "stop", "all", "kill", "stop", "all")
    timed = tuple(Timed(3.0 + 20.0 * i, k, slot=0.75) for i, k in enumerate(kinds))
    faults = launch(out / "faults", 2, 1000, 20, timed)
    costs = fault_costs(faults, cal["step_s"][2])
    cal["faults"] = {k: statistics.fmean(v) if v else 0.0 for k, v in costs.items()}
    cal["fault_samples"] = costs
    print("fault costs (means):", json.dumps(cal["faults"]), flush=True)
    return cal


# -- the model ------------------------------------------------------------------------------


def save_cost_s(cal: dict[str, Any]) -> float:
    """One durable save's cost: the median over every probe (one rank writes, whatever the
    member count; a single probe's estimate swings by tens of ms on the loaded box)."""
    samples = [x for _, saves in cal["probe_samples"].values() for x in saves]
    return max(statistics.median(samples), 0.0)


def inputs_for(cal: dict[str, Any], members: int, rates: dict[str, float], every: int,
               step_s: float) -> Any:  # fmt: skip
    """PlanInputs for ``members`` at the given rates per second of each kind (module docstring)."""
    from stalwart.plan import PlanInputs

    io, f = cal["io"], cal["faults"]
    gb = io["state_gb"]
    heal, rack_detect = f["heal_s"], f["crash_detect_s"]
    spare = max(f["restart_s"] - rack_detect - heal - io["load_s"], 0.0)
    return PlanInputs().replace(**{
        "job.accelerators": members, "job.group_size": 1, "job.state_gb": gb,
        "job.step_s": step_s, "job.accelerators_per_node": 1,
        "fleet.crash_per_hour": rates.get("kill", 0.0) / members * 3600,
        "fleet.hang_per_hour": rates.get("stop", 0.0) / members * 3600,
        "fleet.rack_loss_per_hour": rates.get("all", 0.0) * 3600,
        "fleet.node_loss_per_hour": 0.0, "fleet.sdc_per_hour": 0.0,
        "fleet.nodes_per_rack": members, "fleet.network_gbps": 1e6,
        "tiers.disk.capacity_gb": 1e-12,
        "tiers.remote.write_gbps": gb / io["lag_s"], "tiers.remote.read_gbps": gb / io["load_s"],
        "tiers.remote.interval_s": every * step_s,
        "costs.remote_stall_s_per_gb": 0.0,
        "costs.remote_background_s_per_gb": save_cost_s(cal) / gb,
        "costs.crash_detect_s": f["crash_detect_s"], "costs.hang_detect_s": f["hang_detect_s"],
        "costs.node_detect_s": rack_detect, "costs.resume_s": f["resume_s"] + f["rejoin_s"],
        "costs.heal_s": heal, "costs.spare_s": spare, "costs.verify_every_steps": 50,
    })  # fmt: skip


def predict(cal: dict[str, Any], members: int, rates: dict[str, float], every: int,
            step_s: float) -> float:  # fmt: skip
    from stalwart.plan import simulate

    inputs = inputs_for(cal, members, rates, every, step_s)
    if sum(rates.values()) <= 0:
        return 1.0 / (1.0 + save_cost_s(cal) / (every * step_s))
    interval = {"remote": inputs.tiers.remote.interval_s}
    return simulate(inputs, "stalwart-no-memory", interval, failures=2000, seed=1).ettr


def recommended_steps(cal: dict[str, Any], c: Config) -> int:
    from stalwart.plan.model import recommend_intervals

    rates = {k: c.rate_per_s / len(c.kinds) for k in c.kinds}
    step_s = cal["step_s"][c.members]
    inputs = inputs_for(cal, c.members, rates, 1, step_s).replace(
        **{"tiers.remote.interval_s": None}
    )
    return max(1, round(recommend_intervals(inputs, "stalwart-no-memory")["remote"] / step_s))


def steps_for(cal: dict[str, Any], c: Config) -> int:
    if isinstance(c.interval, int):
        return c.interval
    rec = recommended_steps(cal, c)
    return {"rec": rec, "0.5x": max(1, round(rec / 2)), "2x": 2 * rec}[c.interval]


# -- validation -----------------------------------------------------------------------------


def validate(cal: dict[str, Any], out: Path, seeds: int, only: set[str]) -> list[dict[str, Any]]:
    from stalwart.testing import KillSchedule

    done = out / "runs.json"
    rows = json.loads(done.read_text()) if done.exists() else []  # a run cut short goes on
    for seed in range(seeds):
        for c in CONFIGS:
            if (only and c.name not in only) or any(
                r["config"] == c.name and r["seed"] == seed for r in rows
            ):
                continue
            every = steps_for(cal, c)
            sched = KillSchedule.poisson(c.rate_per_s, seed=seed, horizon_s=HORIZON_S,
                                         clock="-", members=c.members, kinds=c.kinds)  # fmt: skip
            run = launch(out / f"{c.name}-s{seed}", c.members, STEPS, every, sched.timed)
            window, step_s = run["end_s"], run["step_s"]
            goodput = run["final_step"] * step_s / window
            taken = [x for x in run["claims"] if x["t"] <= window]
            realised = {k: sum(x["kind"] == k for x in taken) / window for k in c.kinds}
            nominal = {k: c.rate_per_s / len(c.kinds) for k in c.kinds}
            row = {"config": c.name, "seed": seed, "members": c.members, "every": every,
                   "rate_per_s": c.rate_per_s, "kinds": list(c.kinds), "window_s": window,
                   "faults": len(taken), "expected_faults": c.rate_per_s * window,
                   "realised": realised,
                   "measured": goodput, "step_s": step_s, "final_step": run["final_step"],
                   "model_nominal": predict(cal, c.members, nominal, every, step_s),
                   "model_realised": predict(cal, c.members, realised, every, step_s),
                   "wall_s": run["wall_s"]}  # fmt: skip
            rows.append(row)
            print(f"{c.name:15} seed {seed} every {every:3d} step {step_s * 1e3:.1f} ms: "
                  f"{len(taken)} faults "
                  f"(expected {row['expected_faults']:.1f}) measured {goodput:.1%}, model "
                  f"{row['model_realised']:.1%} (realised) {row['model_nominal']:.1%} (nominal)"
                  f"  [{run['wall_s']:.0f} s]", flush=True)  # fmt: skip
            (out / "runs.json").write_text(json.dumps(rows, indent=1))
    return rows


def report(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| config | members | rate | interval (steps) | faults / run | measured goodput "
        "(median, range) | model, realised rate | model, nominal rate | max abs diff |"
    )
    print("|---|---:|---|---:|---:|---|---|---:|---:|")
    for name in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == name]
        m = [r["measured"] for r in rs]
        real = [r["model_realised"] for r in rs]
        diff = max(abs(r["measured"] - r["model_realised"]) for r in rs)
        r0 = rs[0]
        print(f"| {name} | {r0['members']} | 1/{1 / r0['rate_per_s']:.0f} s "
              f"({'+'.join(r0['kinds'])}) | {r0['every']} | "
              f"{'/'.join(str(r['faults']) for r in rs)} | {statistics.median(m):.1%} "
              f"({min(m):.1%}-{max(m):.1%}) | {statistics.median(real):.1%} "
              f"({min(real):.1%}-{max(real):.1%}) | {r0['model_nominal']:.1%} | "
              f"{diff * 100:.1f} pp |")  # fmt: skip


def report_intervals(rows: list[dict[str, Any]]) -> None:
    """Measured goodput at 0.5x, 1x and 2x the recommended interval, seed by seed (the seeds
    share their failure times across the three)."""
    for c in (c for c in CONFIGS if c.interval == "rec"):
        trio = [f"{c.name}-half", c.name, f"{c.name}-double"]
        got = {(r["config"], r["seed"]): r for r in rows if r["config"] in trio}
        seeds = sorted({s for _, s in got})
        if not seeds or not all((n, s) in got for n in trio for s in seeds):
            continue
        print(f"\n{c.name}: every {'/'.join(str(got[n, seeds[0]]['every']) for n in trio)} "
              "steps (0.5x / 1x / 2x the recommendation)")  # fmt: skip
        for s in seeds:
            cells = [f"{got[n, s]['measured']:.1%}" for n in trio]
            model = [f"{got[n, s]['model_nominal']:.1%}" for n in trio]
            print(f"  seed {s}: measured {' / '.join(cells)}; model {' / '.join(model)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("/tmp/plan-validate"))
    p.add_argument("--calibration", type=Path, help="reuse a calibration.json")
    p.add_argument(
        "--refit-faults",
        action="store_true",
        help="with --calibration: the probes from it, the fault run again",
    )
    p.add_argument(
        "--rescore",
        action="store_true",
        help="the model again for the runs in --out/runs.json (calibration: --calibration, "
        "else --out/calibration.json)",
    )
    p.add_argument("--only", default="", help="comma-separated config names")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.rescore and not a.calibration:
        a.calibration = a.out / "calibration.json"
    if a.calibration:
        cal = json.loads(a.calibration.read_text())
        cal["step_s"] = {int(k): v for k, v in cal["step_s"].items()}
        cal["save_s"] = {int(k): v for k, v in cal["save_s"].items()}
        for n in (2, 3):  # the probes read again, as this version reads them
            runs = [read_run(a.calibration.parent / f"probe-{n}-{i}", n, PROBE_STEPS, SAVE_EVERY)
                    for i in range(PROBE_REPEATS)]  # fmt: skip
            cal["probe_samples"][str(n)] = [
                [r["step_s"] for r in runs],
                [(r["end_s"] / r["final_step"] - r["step_s"]) * SAVE_EVERY for r in runs],
            ]
        faults = a.calibration.parent / "faults"
        if faults.exists() and not a.refit_faults:  # read again, as this version reads them
            costs = fault_costs(read_run(faults, 2, 1000, 20), cal["step_s"][2])
            cal["faults"] = {k: statistics.fmean(v) if v else 0.0 for k, v in costs.items()}
            cal["fault_samples"] = costs
            print("fault costs (means):", json.dumps(cal["faults"]), flush=True)
    if (not a.calibration or a.refit_faults) and not a.rescore:
        keep = ("step_s", "save_s", "probe_samples")
        probes = {k: cal[k] for k in keep} if a.calibration else None
        cal = calibrate(a.out, probes)
        (a.out / "calibration.json").write_text(json.dumps(cal, indent=1))
    if a.rescore:
        rows = json.loads((a.out / "runs.json").read_text())
        for r in rows:
            every, n = r["every"], r["members"]
            nominal = {k: r["rate_per_s"] / len(r["kinds"]) for k in r["kinds"]}
            r["model_nominal"] = predict(cal, n, nominal, every, r["step_s"])
            r["model_realised"] = predict(cal, n, r["realised"], every, r["step_s"])
    else:
        rows = validate(cal, a.out, a.seeds, {s for s in a.only.split(",") if s})
    report(rows)
    report_intervals(rows)


if __name__ == "__main__":
    main()
