"""Validate ``stalwart.plan``'s goodput model against measured chaos runs under ``stalwart run``.

Each run is a real elastic job (``bench/plan_chaos_worker.py``: 2 or 3 members, or 4 ranks in 2
replica groups of 2 with FSDP2 inside each (``GROUP_OF``), a 12.6 MB state, a durable tier every
K steps) hit by a seeded Poisson schedule (``KillSchedule.poisson``) of
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
save; the median of all probes), and one probe with the interval configurations' stalled save
(every 10 steps) gives that save's cost. One run with faults at fixed times per member count
gives the detection, resume, heal and restart times (means: the model wants expected costs)
and every process's start time (their spread, over their mean, is the model's
``start_factors``): 2 members: kill, hang, all, kill, hang, all, all, all (14 s apart, each
rank struck), then twice a kill and 1 s later a hang of the survivor (the last live holder
lost while a replacement starts, measured apart and set beside the model's cost for it);
3 members: a kill and a hang of each rank, then four all-holder losses; 2 groups of 2: a kill
of a rank of each group and four all-holder losses. The save's commit lag
and a load are timed in this process. ``--calibration FILE`` reuses a calibration (the probe and
fault runs beside it are read again), ``--refit-faults`` fits the fault runs again (running
those not beside it, with the probes of member counts the calibration lacks),
``--rescore`` evaluates the model again for the runs in ``--out/runs.json`` (and writes
``runs-rescored.json``); a cut-short validation goes on from its ``runs.json``;
``--report a.json,b.json`` prints the tables of several sweeps together.

**Quiet measurement**: each ``stalwart run`` (probe, calibration or scored run) holds the
box's exclusive quiet lock (``flock -x /tmp/quiet.lock``; ``PLAN_VALIDATE_LOCK``, empty: none)
for itself alone, released between runs so other work goes in between; each row records the
box's load average (``uptime``) as its run ended.

**Scored twice**: the rate-level prediction above, and the run's own fault trace replayed
(``trace``): every fault the run took, at the time it was taken on the job's clock, its kind,
and whether the job had every member then, replayed in the same simulation with the same
calibrated costs (``simulate(schedule=...)``). Most of one run's spread is *when* its faults
fall (against saves, heals and process starts), which a rate cannot know; the replay keeps
only what the model is meant to predict, the cost of each fault. Its replications differ in
the process starts drawn from the calibration's.

**Faults on a starting process**: the chaos schedule acts at step boundaries, so it cannot
strike a process before its first one: a fault due while the job restarts strikes nobody, and
one drawn for the member whose replacement is still starting strikes nobody
(``stalwart.testing.poisson``). The model is run the same way (``simulate(...,
strike_starting=False)``); ``stalwart plan`` keeps the default (a host fails whatever it runs).

**Mapping to the model**: N accelerators, one per node, one rack of N nodes, group size 1 (N
live replicas; 4 members: group size 2, 2 replicas, a killed rank's group out while it heals);
a kill is a ``crash``, a hang a ``hang``, an all-holder loss a ``rack`` loss (every host of the
job at once); the durable tier is the model's ``remote`` tier (the tier that survives the loss
of every host; the ``disk`` tier is switched off with a capacity of ~0);
strategy ``stalwart-no-memory``; the fault costs of the run's member count, the restart after
an all-holder loss as the model's ``restart_s`` (a rollback's launch: no replacement waits for a
survivor's boundary, so it is shorter than a heal); faults are taken at step boundaries
(``simulate(at_boundaries=True)``: a fault due during a save's stall strikes after it, the save
written). An all-holder loss that left a member alive (one that had joined the epoch but not yet
reached a boundary in it passes the fault: ``stalwart.testing.poisson``) is replayed as the
crash it was. The prediction
scored is the simulated ETTR at each run's realised rate of each kind (the schedule's arrivals
in its window, those that struck a starting process included, over the window: the Poisson
count's sampling noise in a 40 s run is larger than the goal); beside it the ETTR at the
schedule's rate (``nominal``), and where the run falls among 400 modelled runs of its window
at that rate (``percentile``: how likely a run that far from the mean is).

The interval configurations (``stall*``) make the interval matter: each save stalls training
0.4 s (``plan_chaos_worker.py --save-stall-s``) and every member is lost every 8 s on average;
they run at 0.5x, 1x and 2x the planner's recommended interval with the same failure times per
seed (common random numbers), so a seed's three runs compare paired.

    OMP_NUM_THREADS=1 .venv/bin/python bench/plan_validate.py --out /tmp/plan-validate

Writes ``calibration.json`` and ``runs.json`` under ``--out`` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
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
STALL_EVERY = 10  # steps between saves in the probe of a stalled save's cost
STEPS = 200
HORIZON_S = 600.0
QUIET_LOCK = os.environ.get("PLAN_VALIDATE_LOCK", "/tmp/quiet.lock")  # "": no lock
SAVE_STALL_S = 0.4  # the interval configurations' save: a noticeable share of the interval
GROUP_OF = {4: 2}
"""Ranks per replica group by member count: 4 members run as 2 groups of 2 ranks (FSDP2 inside
each, ``stalwart run --group-size 2``); other counts, groups of one rank."""
MEMBERS = (2, 3, 4)


def _group(members: int) -> int:
    """Ranks per replica group of a job of ``members`` (``GROUP_OF``)."""
    return GROUP_OF.get(members, 1)


@dataclass(frozen=True)
class Config:
    name: str
    members: int
    rate_per_s: float
    kinds: tuple[str, ...]
    interval: str | int  # whole steps, or "rec" / "0.5x" / "2x" of the recommended interval
    steps: int = STEPS
    save_stall_s: float = 0.0  # plan_chaos_worker.py --save-stall-s
    seeds: int = 2  # --seeds (the main configurations) or --interval-seeds (save-stall > 0)


CONFIGS = (
    Config("kill-2", 2, 1 / 8, ("kill",), 20),
    Config("kill-3", 3, 1 / 8, ("kill",), 20),
    Config("kill-2-fast", 2, 1 / 4, ("kill",), 10),
    Config("hang-2", 2, 1 / 10, ("stop",), 20),
    Config("hang-3", 3, 1 / 10, ("stop",), 40),
    Config("mix-2", 2, 1 / 8, ("kill", "stop", "all"), "rec"),
    Config("mix-3", 3, 1 / 8, ("kill", "stop", "all"), "rec"),
    Config("all-10s", 2, 1 / 10, ("all",), "rec"),
    Config("kill-g2", 4, 1 / 8, ("kill",), 20),  # a killed rank takes its group out
    Config("all-g2", 4, 1 / 10, ("all",), "rec"),
    # where the interval matters: a save stalls 0.4 s (over 3 steps) and every member is lost
    # every 8 s on average, so saves and lost work both cost several percent of goodput (the
    # model: 1x ahead of 0.5x and 2x by ~3 pp, in ~60 % of single runs of this length)
    Config("stall", 2, 1 / 8, ("all",), "rec", 300, SAVE_STALL_S, 3),
    Config("stall-half", 2, 1 / 8, ("all",), "0.5x", 300, SAVE_STALL_S, 3),
    Config("stall-double", 2, 1 / 8, ("all",), "2x", 300, SAVE_STALL_S, 3),
)


# -- one run --------------------------------------------------------------------------------


def _env(schedule: Any) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **schedule.to_env()}
    env.pop("STALWART_ELASTIC_STORE", None)
    return env


def fault_free_step_s(commits: list[dict[str, Any]], members: int, every: int,
                      stalled: bool = False) -> float:  # fmt: skip
    """The run's own fault-free, save-free step time: the mean time from one commit to the
    next of the same worker within one epoch of every member, leaving out the step that saves
    and the two after it (its pause and its background write) when saves are 10 or more steps
    apart, or 4 or more with a stalled save (``stalled``). The shared box's speed drifts by
    +-15 % between runs, more than the goal; measured goodput and the model both take it."""
    last: dict[Any, dict[str, Any]] = {}
    gaps = []
    for e in sorted(commits, key=lambda e: e["t"]):
        before = last.get(e["wid"])
        last[e["wid"]] = e
        if (
            before is None
            or before["step"] + 1 != e["step"]
            or ((every >= 10 or (stalled and every >= 4)) and e["step"] % every < 3)
        ):
            continue
        if before["epoch"] == e["epoch"] and len(e["members"]) == members:
            gaps.append(e["t"] - before["t"])
    return statistics.fmean(gaps)


class Unscorable(RuntimeError):
    """A run that stopped as designed but cannot be scored: its schedule killed every holder
    before the first durable save, so the job had nothing to resume (issue 24's rule)."""


def launch(tmp: Path, members: int, steps: int, every: int, timed: tuple[Any, ...] = (),
           stall_s: float = 0.0) -> dict[str, Any]:  # fmt: skip
    """One ``stalwart run``; returns what its event files and the chaos records say."""
    from stalwart.testing import KillSchedule

    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    schedule = KillSchedule(timed=timed, clock=str(tmp / "clock"), members=members)
    # each run alone on the box: the exclusive quiet lock for this run only, released after
    # it so others' tests go between runs (the lock's wait is outside the job's clock)
    lock = ["flock", "-x", QUIET_LOCK] if QUIET_LOCK else []
    group = ["--group-size", str(_group(members))]
    cmd = [*lock, sys.executable, "-m", "stalwart", "run", "--nproc", str(members), *group,
           "--max-restarts", "200", "--events", str(tmp / "events"), "--timeout",
           str(TIMEOUT_S), str(WORKER),
           "--steps", str(steps), "--batch-s", str(BATCH_S), "--members", str(members),
           "--ckpt", str(tmp / "ckpt"),
           "--ckpt-every", str(every), "--save-stall-s", str(stall_s), *group]  # fmt: skip
    started = time.time()
    done = subprocess.run(cmd, env=_env(schedule), capture_output=True, text=True, timeout=1800)
    load = os.getloadavg()  # the box's load as the run ends (uptime's three figures)
    if done.returncode != 0 and "Nothing can be resumed" in done.stderr:
        raise Unscorable("every holder was lost before the first durable save")
    if done.returncode != 0:
        raise RuntimeError(f"stalwart run failed ({done.returncode}): {done.stderr[-3000:]}")
    shutil.rmtree(tmp / "ckpt", ignore_errors=True)  # the events stay, for a later look
    return {"wall_s": time.time() - started, "uptime": list(load),
            **read_run(tmp, members, steps, every, stall_s > 0)}  # fmt: skip


def read_run(tmp: Path, members: int, steps: int, every: int, stalled: bool = False
             ) -> dict[str, Any]:  # fmt: skip
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
            "step_s": fault_free_step_s(commits, members, every if every > 0 else 10**9,
                                        stalled),
            "final_step": max(e["step"] for e in commits), "claims": claims,
            "events": sorted(lines, key=lambda e: e["t"])}  # fmt: skip


def process_starts(run: dict[str, Any]) -> list[float]:
    """How long each process of the run took to start: launched (``spawned``) to its first
    event (``start``: Python and torch imported, the job being made). On this shared box it
    swings from 2 to 16 s with the load, and it is most of a heal and of a restart."""
    spawned = {e["wid"]: e["t"] for e in run["events"] if e["kind"] == "spawned"}
    return [e["t"] - spawned[e["wid"]] for e in run["events"]
            if e["kind"] == "start" and e["wid"] in spawned]  # fmt: skip


def process_start_s(run: dict[str, Any]) -> float:
    return statistics.fmean(process_starts(run))


# -- calibration ----------------------------------------------------------------------------


def _first(events: list[dict[str, Any]], after: float, pred: Any) -> dict[str, Any] | None:
    return next((e for e in events if e["t"] > after and pred(e)), None)


def fault_costs(run: dict[str, Any], step_s: float, members: int) -> dict[str, list[float]]:
    """Detection, resume, heal and restart times around each fault of a calibration run."""
    ev = run["events"]
    out: dict[str, list[float]] = {
        k: [] for k in ("crash_detect_s", "hang_detect_s", "resume_s", "heal_s", "restart_s",
                        "rejoin_s", "overlap_s", "overlap_left_s")
    }  # fmt: skip
    for claim in run["claims"]:
        t = claim["t"]
        # the first step begun after the fault and committed (one in flight may commit still)
        began = _first(ev, t, lambda e, t=t: e["kind"] == "step" and e["committed"]
                       and e["t"] - e["dt"] > t)  # fmt: skip
        if began is None:
            print(f"calibration: no 'began' event after the fault at {t:.2f} s; left out")
            continue
        if claim["kind"] == "all":
            # to the first commit of every member, less the steps since the resume: the first
            # member back trains alone until the others join (the model restarts them at once)
            res = _first(ev, t, lambda e: e["kind"] == "resumed")
            whole = res and _first(ev, res["t"], lambda e: e["kind"] == "step" and e["committed"]
                                   and len(e["members"]) == members)  # fmt: skip
            if began["t"] - began["dt"] - t > 1.0 and whole:  # else a member that joined lived
                out["restart_s"].append(whole["t"] - t - (whole["step"] - res["step"]) * step_s)
            continue
        if claim["rank"] >= claim["size"]:
            continue  # it struck the member still starting: nobody died
        if claim["size"] == _group(members) < members:  # one group left
            # it struck the last live holder while a replacement was starting: the job stands
            # still until training begins again (from the tier); the replacement's start left
            spawns = [e for e in ev if e["kind"] == "spawned" and e["t"] < t]
            up = _first(ev, spawns[-1]["t"], lambda e, w=spawns[-1]["wid"]: e["wid"] == w
                        and e["kind"] == "start")  # fmt: skip
            out["overlap_s"].append(began["t"] - began["dt"] - t)
            out["overlap_left_s"].append(max(up["t"] - t, 0.0) if up else math.nan)
            continue
        found = _first(ev, t, lambda e: e["kind"] == "fault-detected")
        if found is None:
            print(f"calibration: no 'found' event after the fault at {t:.2f} s; left out")
            continue
        key = "crash_detect_s" if claim["kind"] == "kill" else "hang_detect_s"
        out[key].append(found["t"] - t)
        resumed = _first(ev, found["t"], lambda e: e["kind"] == "step" and e["committed"])
        if resumed is None:
            print(f"calibration: no 'resumed' event after the fault at {t:.2f} s; left out")
            continue
        # detection to the survivors' first commit, less that step (paced for the members
        # left): a survivor that waits out the collective timeout holds the others back
        paced = step_s * members / (members - _group(members))
        out["resume_s"].append(max(resumed["t"] - found["t"] - paced, 0.0))
        if any(0 < c["t"] - t < 10.0 for c in run["claims"]):
            continue  # the next fault strikes during the heal (an overlap, measured apart)
        spawn = _first(ev, found["t"] - 1, lambda e: e["kind"] == "spawned")
        if spawn is None:
            print(f"calibration: no 'spawn' event after the fault at {t:.2f} s; left out")
            continue
        wid = spawn["wid"]
        healed = _first(ev, spawn["t"], lambda e, w=wid: e["wid"] == w and e["kind"] == "step"
                        and e["committed"])  # fmt: skip
        if healed is None:
            print(f"calibration: no 'healed' event after the fault at {t:.2f} s; left out")
            continue
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
    cal: dict[str, Any] = {"io": io_costs(), "step_s": {}, "save_s": {}, **(probes or {})}
    for n in [m for m in MEMBERS if m not in (probes or {}).get("step_s", {})]:
        # a save's cost, within each probe: its window less its fault-free, save-free steps
        steps_s, saves_s = [], []
        for i in range(PROBE_REPEATS):
            run = launch(out / f"probe-{n}-{i}", n, PROBE_STEPS, SAVE_EVERY)
            steps_s.append(run["step_s"])
            saves_s.append((run["end_s"] / run["final_step"] - run["step_s"]) * SAVE_EVERY)
        cal["step_s"][n], cal["save_s"][n] = statistics.median(steps_s), statistics.median(saves_s)
        cal["probe_samples"] = {**cal.get("probe_samples", {}), n: [steps_s, saves_s]}
        print(f"probe {n} members: step {steps_s} s, save {saves_s} s", flush=True)
    if not probes or "stall_s" not in cal:
        run = launch(out / "probe-stall", 2, PROBE_STEPS, STALL_EVERY, stall_s=SAVE_STALL_S)
        cal["stall_s"] = (run["end_s"] / run["final_step"] - run["step_s"]) * STALL_EVERY
        print(f"probe stall {SAVE_STALL_S} s: save {cal['stall_s']:.3f} s", flush=True)
    (out / "calibration.json").write_text(json.dumps(cal, indent=1))  # the probes, kept
    cal["faults"], cal["fault_samples"] = {}, {}
    for n, (timed, steps) in FAULT_RUNS.items():
        faults = out / f"faults-{n}"
        if probes and (faults / "events").exists():  # measured with these probes: read again
            _fit_faults(cal, n, read_run(faults, n, steps, 20))
        else:
            _fit_faults(cal, n, launch(faults, n, steps, 20, timed))
    return cal


def _fit_faults(cal: dict[str, Any], n: int, run: dict[str, Any]) -> None:
    """The fault costs of ``n`` members, from one fixed-time fault run, into ``cal``."""
    costs = fault_costs(run, cal["step_s"][n], n)
    cal["faults"][n] = {k: statistics.fmean(v) if v else 0.0 for k, v in costs.items()}
    cal["faults"][n]["process_start_s"] = process_start_s(run)
    costs["process_start_s"] = process_starts(run)
    cal["fault_samples"][n] = costs
    print(f"fault costs, {n} members (means):", json.dumps(cal["faults"][n]), flush=True)


def _fault_runs() -> dict[int, tuple[tuple[Any, ...], int]]:
    """The calibration's fault runs, per member count: each kind striking every rank, a loss
    of every member, and (2 members) a hang of the survivor 1 s after its partner's kill."""
    from stalwart.testing.poisson import Timed

    two = [("kill", 0.0), ("stop", 0.75), ("all", 0.0), ("kill", 0.75), ("stop", 0.0),
           ("all", 0.0), ("all", 0.0), ("all", 0.0)]  # fmt: skip
    timed2 = [Timed(3.0 + 14.0 * i, k, slot=s) for i, (k, s) in enumerate(two)]
    for t0, slot in ((118.0, 0.0), (136.0, 0.75)):  # kill, then the survivor (rank 0 of 1) hangs
        timed2 += [Timed(t0, "kill", slot=slot), Timed(t0 + 1.0, "stop", slot=0.0)]
    three = [("kill", 0.0), ("kill", 0.4), ("kill", 0.8), ("stop", 0.0), ("stop", 0.4),
             ("stop", 0.8), ("all", 0.0), ("all", 0.0), ("all", 0.0), ("all", 0.0)]  # fmt: skip
    timed3 = [Timed(3.0 + 14.0 * i, k, slot=s) for i, (k, s) in enumerate(three)]
    groups = [("kill", 0.0), ("kill", 0.5), ("all", 0.0), ("kill", 0.75), ("all", 0.0),
              ("kill", 0.25), ("all", 0.0), ("all", 0.0)]  # fmt: skip  # a kill: its group out
    timed4 = [Timed(3.0 + 14.0 * i, k, slot=s) for i, (k, s) in enumerate(groups)]
    return {2: (tuple(timed2), 1050), 3: (tuple(timed3), 1050), 4: (tuple(timed4), 1050)}


FAULT_RUNS = _fault_runs()


# -- the model ------------------------------------------------------------------------------


def save_cost_s(cal: dict[str, Any], stall_s: float = 0.0) -> float:
    """One durable save's cost: the median over every probe (one rank writes, whatever the
    member count; a single probe's estimate swings by tens of ms on the loaded box); with a
    stall, the stalled probe's."""
    if stall_s:
        return float(cal["stall_s"])
    samples = [x for _, saves in cal["probe_samples"].values() for x in saves]
    return max(statistics.median(samples), 0.0)


def inputs_for(cal: dict[str, Any], members: int, rates: dict[str, float], every: int,
               step_s: float, stall_s: float = 0.0, start_shift_s: float = 0.0
               ) -> Any:  # fmt: skip
    """PlanInputs for ``members`` at the given rates per second of each kind (module docstring),
    with the fault costs calibrated for that member count; ``start_shift_s`` moves the heal
    and the restart by a process start's difference from the calibration's."""
    from stalwart.plan import PlanInputs

    io, f = cal["io"], cal["faults"][members]
    gb = io["state_gb"]
    heal, rack_detect = max(f["heal_s"] + start_shift_s, 0.0), f["crash_detect_s"]
    restart = max(f["restart_s"] + start_shift_s - rack_detect - io["load_s"], 0.0)
    return PlanInputs().replace(**{
        "job.accelerators": members, "job.group_size": _group(members),
        "job.state_gb": gb,
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
        "costs.remote_background_s_per_gb": save_cost_s(cal, stall_s) / gb,
        "costs.crash_detect_s": f["crash_detect_s"], "costs.hang_detect_s": f["hang_detect_s"],
        "costs.node_detect_s": rack_detect, "costs.resume_s": f["resume_s"] + f["rejoin_s"],
        "costs.heal_s": heal, "costs.restart_s": restart, "costs.spare_s": 0.0,
        "costs.verify_every_steps": 50,
    })  # fmt: skip


def start_factors(cal: dict[str, Any], members: int) -> list[float]:
    """The calibration's process starts over their mean: the spread of a heal's and a
    restart's start (``simulate(start_factors=...)``)."""
    starts = cal["fault_samples"][members]["process_start_s"]
    mean = statistics.fmean(starts)
    return [x / mean for x in starts]


def predict(cal: dict[str, Any], members: int, rates: dict[str, float], every: int,
            step_s: float, stall_s: float = 0.0, start_shift_s: float = 0.0,
            window_s: float | None = None, spread: bool = True, whole: bool = False
            ) -> Any:  # fmt: skip
    """The simulated ETTR; failures strike running processes only (``strike_starting``
    False), as the chaos schedule does, and a process's start is drawn from the calibration's
    (``spread``; docs/plan.md says why). With ``window_s``: the ETTR of 400 runs that long
    (their spread), not their mean; with ``whole``: the ``SimResult``, not its ETTR."""
    from stalwart.plan import simulate

    inputs = inputs_for(cal, members, rates, every, step_s, stall_s, start_shift_s)
    if sum(rates.values()) <= 0:
        return 1.0 / (1.0 + save_cost_s(cal, stall_s) / (every * step_s))
    interval = {"remote": inputs.tiers.remote.interval_s}
    factors = start_factors(cal, members) if spread else ()
    if window_s is not None:
        n = 400
        failures = max(int(sum(rates.values()) * window_s * n), n)
        return simulate(inputs, "stalwart-no-memory", interval, failures=failures,
                        replications=n, seed=2, strike_starting=False, start_factors=factors,
                        at_boundaries=True).replications  # fmt: skip
    result = simulate(inputs, "stalwart-no-memory", interval, failures=2000, seed=1,
                      strike_starting=False, start_factors=factors, at_boundaries=True)  # fmt: skip
    return result if whole else result.ettr


_TRACE_KIND = {"kill": "crash", "stop": "hang", "all": "rack"}


def trace_of(run: dict[str, Any], members: int, window_s: float) -> list[Any]:
    """The run's faults as they happened, for the model to replay (``simulate(schedule=...)``):
    every fault recorded in the window that struck a running process (a kill or hang of a rank
    past the live ones struck the member still starting: nobody), at the time it was taken on
    the job's clock, with whether the job had every member then (``TracedFault.whole``). An
    all-holder loss after which the job did not resume from its durable tier before the next
    fault left a member alive (one that joined the epoch and had not reached a boundary in it
    passes the fault): it is replayed as the crash it was."""
    from stalwart.plan.trace import TracedFault

    claims = sorted(run["claims"], key=lambda c: c["t"])
    resumes = [e["t"] for e in run["events"] if e["kind"] == "resumed"]
    out = []
    for i, c in enumerate(claims):
        if not (0 <= c["t"] <= window_s and (c["kind"] == "all" or c["rank"] < c["size"])):
            continue
        kind = _TRACE_KIND[c["kind"]]
        if c["kind"] == "all":
            until = claims[i + 1]["t"] if i + 1 < len(claims) else math.inf
            if not any(c["t"] < t < until for t in resumes):
                kind = "crash"  # a holder lived: the job healed it instead of rolling back
        out.append(TracedFault(c["t"], kind, whole=c["size"] == members))
    return out


def rollbacks_lost_steps(run: dict[str, Any]) -> list[int]:
    """The steps each resume from the durable tier redid (``resumed`` events, one a resume
    however many members logged it)."""
    seen: dict[tuple[int, int], int] = {}
    for e in run["events"]:
        if e["kind"] == "resumed" and e.get("tier") == "durable":
            key = (e["step"], e.get("last_known", -1))
            seen[key] = max(seen.get(key, 0), int(e.get("steps_lost", 0)))
    return list(seen.values())


def predict_trace(cal: dict[str, Any], members: int, trace: list[Any], window_s: float,
                  every: int, step_s: float, stall_s: float = 0.0) -> Any:  # fmt: skip
    """The simulated ETTR of the run's own fault trace over its window (``SimResult``: its
    replications differ only in the process starts drawn from the calibration's); a fault
    the run took struck a running process, so it strikes in the model too
    (``strike_starting``)."""
    from stalwart.plan import simulate

    inputs = inputs_for(cal, members, {}, every, step_s, stall_s)
    return simulate(inputs, "stalwart-no-memory", {"remote": inputs.tiers.remote.interval_s},
                    replications=64, seed=1, strike_starting=True,
                    start_factors=start_factors(cal, members), schedule=trace,
                    horizon_s=window_s, at_boundaries=True)  # fmt: skip


def recommended_steps(cal: dict[str, Any], c: Config) -> int:
    from stalwart.plan.model import recommend_intervals

    rates = {k: c.rate_per_s / len(c.kinds) for k in c.kinds}
    step_s = cal["step_s"][c.members]
    inputs = inputs_for(cal, c.members, rates, 1, step_s, c.save_stall_s).replace(
        **{"tiers.remote.interval_s": None}
    )
    return max(1, round(recommend_intervals(inputs, "stalwart-no-memory")["remote"] / step_s))


def steps_for(cal: dict[str, Any], c: Config) -> int:
    if isinstance(c.interval, int):
        return c.interval
    rec = recommended_steps(cal, c)
    return {"rec": rec, "0.5x": max(1, round(rec / 2)), "2x": 2 * rec}[c.interval]


# -- validation -----------------------------------------------------------------------------


def score(cal: dict[str, Any], r: dict[str, Any], run: dict[str, Any]) -> None:
    """The model's figures for run row ``r``, in place: at the schedule's rate (``nominal``),
    at the run's realised rates (the figure scored), the same with every start at the mean
    (``mean_start``) or shifted to the run's own mean start (``own_start``), the run's own
    fault trace replayed (``trace``, with the 5-95 % range the starts alone leave), and where the
    measured goodput falls among 400 modelled runs of the same window (``percentile``)."""
    n, every, stall, step_s = r["members"], r["every"], r.get("save_stall_s", 0.0), r["step_s"]
    nominal = {k: r["rate_per_s"] / len(r["kinds"]) for k in r["kinds"]}
    r["process_start_s"] = process_start_s(run)
    shift = r["process_start_s"] - cal["faults"][n]["process_start_s"]
    r["model_nominal"] = predict(cal, n, nominal, every, step_s, stall)
    realised = predict(cal, n, r["realised"], every, step_s, stall, whole=True)
    faultless = isinstance(realised, float)  # no fault in the window: saves alone, no sim
    r["model_realised"] = realised if faultless else realised.ettr
    r["rollbacks_lost_steps"] = rollbacks_lost_steps(run)
    r["model_lost_steps"] = 0.0 if faultless else realised.lost_work_s / step_s
    r["model_mean_start"] = predict(cal, n, r["realised"], every, step_s, stall, spread=False)
    r["model_own_start"] = predict(cal, n, r["realised"], every, step_s, stall, shift)
    trace = trace_of(run, n, r["window_s"])
    replay = predict_trace(cal, n, trace, r["window_s"], every, step_s, stall)
    r["trace"] = [[f.t_s, f.kind, f.whole] for f in trace]
    r["model_trace"] = replay.ettr
    q = statistics.quantiles(replay.replications, n=20)
    r["model_trace_p05"], r["model_trace_p95"] = q[0], q[-1]
    runs = predict(cal, n, nominal, every, step_s, stall, window_s=r["window_s"])
    r["percentile"] = sum(x < r["measured"] for x in runs) / len(runs)
    q = statistics.quantiles(runs, n=20)
    r["model_run_p05"], r["model_run_p95"] = q[0], q[-1]


def validate(cal: dict[str, Any], out: Path, seeds: int, interval_seeds: int, only: set[str],
             first_seed: int = 0, steps: int | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Run every configuration for its seeds (from ``first_seed``); ``steps``: the main
    configurations' length instead of theirs."""
    from dataclasses import replace

    from stalwart.testing import KillSchedule

    done, skipped = out / "runs.json", out / "left-out.json"
    rows = json.loads(done.read_text()) if done.exists() else []  # a run cut short goes on
    left = json.loads(skipped.read_text()) if skipped.exists() else []
    for seed in range(first_seed, first_seed + max(seeds, interval_seeds)):
        for c in CONFIGS:
            if (
                (only and c.name not in only)
                or seed - first_seed >= (interval_seeds if c.save_stall_s else seeds)
                or any(r["config"] == c.name and r["seed"] == seed for r in rows + left)
            ):
                continue
            if steps and not c.save_stall_s:
                c = replace(c, steps=steps)
            every = steps_for(cal, c)
            sched = KillSchedule.poisson(c.rate_per_s, seed=seed, horizon_s=HORIZON_S,
                                         clock="-", members=c.members, kinds=c.kinds)  # fmt: skip
            try:
                run = launch(out / f"{c.name}-s{seed}", c.members, c.steps, every, sched.timed,
                             c.save_stall_s)  # fmt: skip
            except Unscorable as e:  # recorded, never scored; the sweep goes on
                left.append({"config": c.name, "seed": seed, "why": str(e)})
                skipped.write_text(json.dumps(left, indent=1))
                print(f"{c.name:15} seed {seed}: left out ({e})", flush=True)
                continue
            window, step_s = run["end_s"], run["step_s"]
            goodput = run["final_step"] * step_s / window
            # the realised rate: the schedule's arrivals in the window, those that struck a
            # process still starting (nobody) included, as the model draws them
            due = [f for f in sched.timed if f.at_s <= window]
            realised = {k: sum(f.kind == k for f in due) / window for k in c.kinds}
            struck = [x for x in run["claims"] if x["t"] <= window
                      and (x["kind"] == "all" or x["rank"] < x["size"])]  # fmt: skip
            stall = c.save_stall_s
            row = {"config": c.name, "seed": seed, "members": c.members, "every": every,
                   "rate_per_s": c.rate_per_s, "kinds": list(c.kinds), "window_s": window,
                   "faults": len(due), "struck": len(struck),
                   "expected_faults": c.rate_per_s * window, "realised": realised,
                   "save_stall_s": stall,
                   "measured": goodput, "step_s": step_s, "final_step": run["final_step"],
                   "steps": c.steps, "wall_s": run["wall_s"],
                   "load": run["uptime"][0], "uptime": run["uptime"]}  # fmt: skip
            score(cal, row, run)
            rows.append(row)
            print(f"{c.name:15} seed {seed} every {every:3d} step {step_s * 1e3:.1f} ms: "
                  f"{len(due)} faults ({len(struck)} struck a running process; expected "
                  f"{row['expected_faults']:.1f}) measured {goodput:.1%}, model "
                  f"{row['model_realised']:.1%} (realised) {row['model_nominal']:.1%} (nominal) "
                  f"{row['model_trace']:.1%} (trace)"
                  f"  [{run['wall_s']:.0f} s, load {row['load']:.2f}]", flush=True)  # fmt: skip
            (out / "runs.json").write_text(json.dumps(rows, indent=1))
    return rows


def report(rows: list[dict[str, Any]]) -> None:
    """The table: the model from the calibration alone (``model_realised``), where each run
    falls among the model's runs of its length, and the model with each run's own process
    start time in place of the calibration's (``model_own_start``)."""
    print(
        "\n| config | members | rate | interval (steps) | faults / run (struck) | process start "
        "(s) | measured goodput (median, range) | model, realised rate | mean diff | max abs "
        "diff | percentile among modelled runs (their 5-95 %) | model, the run's start time | "
        "mean diff |"
    )
    print("|---|---:|---|---:|---:|---:|---|---|---:|---:|---|---|---:|")
    for name in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == name]
        m = [r["measured"] for r in rs]
        cells = []
        for key in ("model_realised", "model_own_start"):
            got = [r.get(key, math.nan) for r in rs]
            diffs = [r["measured"] - g for r, g in zip(rs, got, strict=True)]
            cells.append(f"{statistics.median(got):.1%} ({min(got):.1%}-{max(got):.1%}) | "
                         f"{statistics.fmean(diffs) * 100:+.1f} pp")  # fmt: skip
            if key == "model_realised":
                cells[-1] += f" | {max(abs(d) for d in diffs) * 100:.1f} pp"
                cells[-1] += " | " + "/".join(f"{r.get('percentile', math.nan):.0%}" for r in rs)
                cells[-1] += " (" + "/".join(
                    f"{r.get('model_run_p05', math.nan):.0%}-{r.get('model_run_p95', math.nan):.0%}"
                    for r in rs) + ")"  # fmt: skip
        r0 = rs[0]
        stall = f", save {r0['save_stall_s']:g} s" if r0.get("save_stall_s") else ""
        counts = "/".join(f"{r['faults']} ({r.get('struck', '?')})" for r in rs)
        starts = "/".join(f"{r.get('process_start_s', math.nan):.1f}" for r in rs)
        print(f"| {name} | {r0['members']} | 1/{1 / r0['rate_per_s']:.0f} s "
              f"({'+'.join(r0['kinds'])}{stall}) | {r0['every']} | {counts} | {starts} | "
              f"{statistics.median(m):.1%} ({min(m):.1%}-{max(m):.1%}) | {cells[0]} | "
              f"{cells[1]} |")  # fmt: skip
    for key in ("model_realised", "model_mean_start", "model_own_start"):
        if not all(key in r for r in rows):
            continue
        diffs = [r["measured"] - r[key] for r in rows]
        means: dict[str, list[float]] = {}
        for r in rows:
            means.setdefault(r["config"], []).append(r["measured"] - r[key])
        inside = sum(abs(statistics.fmean(d)) <= 0.05 for d in means.values())
        print(f"\n{key}: runs within +-5 pp: {sum(abs(d) <= 0.05 for d in diffs)} of "
              f"{len(diffs)}; median |diff| {statistics.median(abs(d) for d in diffs) * 100:.1f}"
              f" pp, mean diff {statistics.fmean(diffs) * 100:+.1f} pp; configuration means "
              f"within +-5 pp: {inside} of {len(means)} ("
              + ", ".join(f"{n} {statistics.fmean(d) * 100:+.1f}" for n, d in means.items())
              + ")")  # fmt: skip
    if all("percentile" in r for r in rows):
        pct = sorted(r["percentile"] for r in rows)
        print(f"\nmeasured runs inside the model's 5-95 % range of runs of their length: "
              f"{sum(0.05 <= p <= 0.95 for p in pct)} of {len(pct)}; below it "
              f"{sum(p < 0.05 for p in pct)}, above {sum(p > 0.95 for p in pct)}; median "
              f"percentile {statistics.median(pct):.0%}")  # fmt: skip


def _pp(x: float) -> str:
    return f"{x * 100:+.1f}"


def report_trace(rows: list[dict[str, Any]]) -> None:
    """The table scored: per configuration, measured goodput beside the model with each run's
    own fault trace replayed (``model_trace``) and, for comparison, the rate-level model at the
    run's realised rates (``model_realised``); every run's difference (measured - model)."""
    rows = [r for r in rows if "model_trace" in r]
    if not rows:
        return
    print("\n| config | members | rate | interval (steps) | seeds | faults struck / run | load "
          "(1-min) | measured goodput (median, range) | trace-replayed model (median, range) | "
          "diff per run, trace (pp) | mean diff, trace | rate-level model (median, range) | "
          "mean diff, rate |")  # fmt: skip
    print("|---|---:|---|---:|---|---|---|---|---|---|---:|---|---:|")
    for name in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == name]
        r0 = rs[0]
        stall = f", save {r0['save_stall_s']:g} s" if r0.get("save_stall_s") else ""
        cells = []
        for key in ("measured", "model_trace", "model_realised"):
            got = [r[key] for r in rs]
            cells.append(f"{statistics.median(got):.1%} ({min(got):.1%}-{max(got):.1%})")
        d_trace = [r["measured"] - r["model_trace"] for r in rs]
        d_rate = [r["measured"] - r["model_realised"] for r in rs]
        loads = [r["load"] for r in rs]
        print(f"| {name} | {r0['members']} | 1/{1 / r0['rate_per_s']:.0f} s "
              f"({'+'.join(r0['kinds'])}{stall}) | {r0['every']} | "
              f"{','.join(str(r['seed']) for r in rs)} | "
              f"{'/'.join(str(len(r['trace'])) for r in rs)} | "
              f"{min(loads):.1f}-{max(loads):.1f} | {cells[0]} | {cells[1]} | "
              f"{' / '.join(_pp(d) for d in d_trace)} | {_pp(statistics.fmean(d_trace))} pp | "
              f"{cells[2]} | {_pp(statistics.fmean(d_rate))} pp |")  # fmt: skip
    for key, label in (("model_trace", "trace-replayed"), ("model_realised", "rate-level")):
        diffs = [r["measured"] - r[key] for r in rows]
        means: dict[str, list[float]] = {}
        for r in rows:
            means.setdefault(r["config"], []).append(r["measured"] - r[key])
        inside = sum(abs(statistics.fmean(d)) <= 0.05 for d in means.values())
        print(
            f"\n{label}: runs within +-5 pp: {sum(abs(d) <= 0.05 for d in diffs)} of "
            f"{len(diffs)}; median |diff| {statistics.median(abs(d) for d in diffs) * 100:.1f}"
            f" pp, mean diff {_pp(statistics.fmean(diffs))} pp; configuration means within "
            f"+-5 pp: {inside} of {len(means)}; every run of a configuration within +-5 pp: "
            f"{sum(all(abs(x) <= 0.05 for x in d) for d in means.values())} of {len(means)}"
        )
    inside = sum(r["model_trace_p05"] - 0.005 <= r["measured"] <= r["model_trace_p95"] + 0.005
                 for r in rows)  # fmt: skip
    width = statistics.median(r["model_trace_p95"] - r["model_trace_p05"] for r in rows)
    print(
        f"runs inside the trace replay's 5-95 % range (the process starts alone, +-0.5 pp): "
        f"{inside} of {len(rows)}; that range's median width {width * 100:.1f} pp"
    )


def report_overlaps(cal: dict[str, Any]) -> None:
    """The hang of the last live member while its partner's replacement starts, measured in
    the calibration, beside the model's cost for it (max(hang detection, the replacement's
    start left) + a load: the replacement resumes once both are done)."""
    f = cal["faults"].get(2) or {}
    samples = cal["fault_samples"].get(2) or {}
    for got, left in zip(samples.get("overlap_s", ()), samples.get("overlap_left_s", ()),
                         strict=True):  # fmt: skip
        model = max(f["hang_detect_s"], left) + cal["io"]["load_s"]
        print(
            f"hang of the last live member during a heal: measured {got:.2f} s to training "
            f"again (replacement up {left:.2f} s after it); model {model:.2f} s"
        )


def report_rollbacks(rows: list[dict[str, Any]]) -> None:
    """Steps redone per resume from the durable tier: the runs' against the rate-level model's
    (its training redone per failure), by configuration. Where the trace replay agrees with a
    run and the rate level does not, this tells whether the run's faults fell kindly."""
    rows = [r for r in rows if r.get("rollbacks_lost_steps")]
    if not rows:
        return
    print("\n| config | interval (steps) | resumes | steps redone per resume, measured (mean ± "
          "standard error) | the model (rate level) |")  # fmt: skip
    print("|---|---:|---:|---|---:|")
    for name in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == name]
        lost = [x for r in rs for x in r["rollbacks_lost_steps"]]
        se = statistics.stdev(lost) / math.sqrt(len(lost)) if len(lost) > 1 else math.nan
        model = statistics.fmean(r["model_lost_steps"] for r in rs)
        every = "/".join(sorted({str(r["every"]) for r in rs}))
        print(f"| {name} | {every} | {len(lost)} | {statistics.fmean(lost):.1f} ± {se:.1f} | "
              f"{model:.1f} |")  # fmt: skip


def _cell(got: dict[tuple[str, int], dict[str, Any]], name: str, seed: int, key: str) -> str:
    """One run's ``key`` as a percentage, or "-" where the sweep has no such run."""
    return f"{got[name, seed].get(key, math.nan):.1%}" if (name, seed) in got else "-"


def report_intervals(rows: list[dict[str, Any]]) -> None:
    """Measured goodput at 0.5x, 1x and 2x the recommended interval, seed by seed (the seeds
    share their failure times across the three); a sweep may hold 1x and one neighbour only."""
    for c in (c for c in CONFIGS if c.interval == "rec"):
        trio = [f"{c.name}-half", c.name, f"{c.name}-double"]
        got = {(r["config"], r["seed"]): r for r in rows if r["config"] in trio}
        seeds = sorted({s for n, s in got if n == c.name})
        pairs = {o: [s for s in seeds if (o, s) in got] for o in (trio[0], trio[2])}
        if not any(pairs.values()):
            continue
        every = [str(got[n, s]["every"]) for n in trio for s in seeds[:1] if (n, s) in got]
        print(f"\n{c.name}: every {'/'.join(every)} steps (of 0.5x / 1x / 2x the recommendation)")
        for s in seeds:
            loads = "/".join(f"{got[n, s]['load']:.1f}" for n in trio if (n, s) in got)
            m, r, t = (" / ".join(_cell(got, n, s, k) for n in trio)
                       for k in ("measured", "model_realised", "model_trace"))  # fmt: skip
            print(f"  seed {s}: measured {m}; model (rate) {r}; model (trace) {t}; load {loads}")
        present = [n for n in trio if any((n, s) in got for s in seeds)]
        cols = [[got[n, s]["measured"] for s in seeds if (n, s) in got] for n in present]
        print("  median (range): " + " / ".join(
            f"{statistics.median(x):.1%} ({min(x):.1%}-{max(x):.1%})" for x in cols))  # fmt: skip
        full = [s for s in seeds if all((n, s) in got for n in trio)]
        if full:
            wins = sum(got[c.name, s]["measured"] > max(got[trio[0], s]["measured"],
                                                       got[trio[2], s]["measured"])
                       for s in full)  # fmt: skip
            print(f"  1x best in {wins} of {len(full)} seeds")
        for other, label in ((trio[0], "0.5x"), (trio[2], "2x")):
            both = pairs[other]
            if not both:
                continue
            d = [got[c.name, s]["measured"] - got[other, s]["measured"] for s in both]
            se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.nan
            m = [got[c.name, s]["model_realised"] - got[other, s]["model_realised"]
                 for s in both]  # fmt: skip
            mt = [got[c.name, s].get("model_trace", math.nan)
                  - got[other, s].get("model_trace", math.nan) for s in both]  # fmt: skip
            print(
                f"  1x - {label}, paired by seed: {statistics.fmean(d) * 100:+.1f} pp (standard "
                f"error {se * 100:.1f} pp, {sum(x > 0 for x in d)} of {len(d)} seeds > 0); the "
                f"model: {statistics.fmean(m) * 100:+.1f} pp (rate), "
                f"{statistics.fmean(mt) * 100:+.1f} pp (trace)"
            )


def _load_calibration(path: Path, refit: bool) -> dict[str, Any]:
    cal = json.loads(path.read_text())
    cal["step_s"] = {int(k): v for k, v in cal["step_s"].items()}
    cal["save_s"] = {int(k): v for k, v in cal["save_s"].items()}
    cal["faults"] = {int(k): v for k, v in cal.get("faults", {}).items()}
    cal["fault_samples"] = {int(k): v for k, v in cal.get("fault_samples", {}).items()}
    for n in cal["step_s"]:  # the probes read again, as this version reads them
        runs = [read_run(path.parent / f"probe-{n}-{i}", n, PROBE_STEPS, SAVE_EVERY)
                for i in range(PROBE_REPEATS)]  # fmt: skip
        cal["probe_samples"][str(n)] = [
            [r["step_s"] for r in runs],
            [(r["end_s"] / r["final_step"] - r["step_s"]) * SAVE_EVERY for r in runs],
        ]
    for n, (_, steps) in FAULT_RUNS.items():
        faults = path.parent / f"faults-{n}"
        if faults.exists() and not refit:
            _fit_faults(cal, n, read_run(faults, n, steps, 20))  # as this version reads it
    return cal


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=2, help="seeds of the main configurations")
    p.add_argument("--interval-seeds", type=int, default=3,
                   help="seeds of the interval configurations (0.5x, 1x, 2x)")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("/tmp/plan-validate"))
    p.add_argument("--calibration", type=Path, help="reuse a calibration.json")
    p.add_argument(
        "--refit-faults",
        action="store_true",
        help="with --calibration: the probes from it, the fault runs again",
    )
    p.add_argument(
        "--rescore",
        action="store_true",
        help="the model again for the runs in --out/runs.json (calibration: --calibration, "
        "else --out/calibration.json)",
    )
    p.add_argument("--only", default="", help="comma-separated config names")
    p.add_argument("--first-seed", type=int, default=0, help="seeds from this one on")
    p.add_argument("--steps", type=int, help="the main configurations' steps (default theirs)")
    p.add_argument("--report", default="", help="only print the tables of these runs files "
                   "(comma-separated; e.g. two sweeps' runs-rescored.json)")  # fmt: skip
    a = p.parse_args()
    if a.report:
        rows = [r for f in a.report.split(",") for r in json.loads(Path(f).read_text())]
        report(rows)
        report_trace(rows)
        report_intervals(rows)
        report_rollbacks(rows)
        return
    a.out.mkdir(parents=True, exist_ok=True)
    if a.rescore and not a.calibration:
        a.calibration = a.out / "calibration.json"
    if a.calibration:
        cal = _load_calibration(a.calibration, a.refit_faults)
    if (not a.calibration or a.refit_faults) and not a.rescore:
        keep = ("step_s", "save_s", "probe_samples", "stall_s")
        probes = {k: cal[k] for k in keep if k in cal} if a.calibration else None
        cal = calibrate(a.out, probes)
        (a.out / "calibration.json").write_text(json.dumps(cal, indent=1))
    report_overlaps(cal)
    if a.rescore:
        rows = json.loads((a.out / "runs.json").read_text())
        for r in rows:
            stall = r.get("save_stall_s", 0.0)
            run = read_run(a.out / f"{r['config']}-s{r['seed']}", r["members"], 0, r["every"],
                           stall > 0)  # fmt: skip
            # the run read again, as this version reads it (a save's stall left out of the
            # step time at every interval)
            r["step_s"] = run["step_s"]
            r["measured"] = run["final_step"] * run["step_s"] / run["end_s"]
            score(cal, r, run)
        (a.out / "runs-rescored.json").write_text(json.dumps(rows, indent=1))
    else:
        only = {s for s in a.only.split(",") if s}
        rows = validate(cal, a.out, a.seeds, a.interval_seeds, only, a.first_seed, a.steps)
    report(rows)
    report_trace(rows)
    report_intervals(rows)
    report_rollbacks(rows)


if __name__ == "__main__":
    main()
