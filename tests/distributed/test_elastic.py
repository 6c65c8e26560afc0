"""Elastic training in real processes: ``stalwart run`` with gloo on CPU, workers SIGKILLed.

The worker script (``elastic_worker.py``) trains a tiny MLP on a global batch that is fixed
per step and split among the members, so whatever the membership the averaged gradient is
the full batch's: the final parameters of every run are compared (to float tolerance) with a
plain one-process run of the same script, and the members' digests with each other (bit for
bit). Timing only bounds liveness (generous timeouts); nothing asserts a duration.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from torch.distributed import TCPStore

import stalwart
from stalwart.elastic import Job, launch, protocol, read_events, recoveries, summarize
from stalwart.elastic.events import (
    EventKind,
    EventLog,
    FaultDetected,
    StepCommitted,
    StepDiscarded,
)
from stalwart.elastic.heartbeat import Heartbeat, HeartbeatWatch
from stalwart.elastic.job import World
from stalwart.elastic.stats import StepStats, StragglerWatch, percentile
from stalwart.errors import ConfigError
from stalwart.testing import Kill, KillSchedule, run_ranks
from stalwart.testing.chaos import Delay, Raise

from . import elastic_worker

pytestmark = pytest.mark.timeout(120)

WORKER = Path(__file__).with_name("elastic_worker.py")
STEPS = 40
VERIFY_EVERY = 5
RUN_TIMEOUT_S = 100


def _env(schedule: KillSchedule | None = None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("STALWART_ELASTIC_STORE", None)
    return {**env, **(schedule.to_env() if schedule else {})}


def _launch(
    tmp: Path, nproc: int, schedule: KillSchedule | None = None, *extra: str,
    timeout_s: int = 20, hang_s: float = 5.0, launcher: tuple[str, ...] = (),
) -> str:  # fmt: skip
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", str(nproc), "--max-restarts", "2",
           "--events", str(tmp / "events"), "--timeout", str(timeout_s),
           "--hang-timeout", str(hang_s), *launcher, str(WORKER),
           "--steps", str(STEPS), "--verify-every", str(VERIFY_EVERY),
           "--out", str(tmp / "out"), *extra]  # fmt: skip
    done = subprocess.run(
        cmd, env=_env(schedule), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert done.returncode == 0, f"stalwart run failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout


def _launcher_log(events: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (events / "launcher.jsonl").read_text().splitlines()]


def _finals(out: Path) -> dict[str, dict[str, Any]]:
    return {p.stem.removeprefix("final-"): torch.load(p) for p in sorted(out.glob("final-*.pt"))}


def _assert_close_to(reference: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> None:
    for name, ref in reference.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-4, atol=1e-5, msg=name)


def _periodic_digests_agree(events: dict[int, list[dict[str, Any]]]) -> int:
    """Every digest logged at a step is the same on every worker; returns how many steps had one."""
    by_step: dict[int, set[str]] = {}
    for lines in events.values():
        for e in lines:
            if e["kind"] == EventKind.STEP and e.get("digest"):
                by_step.setdefault(e["step"], set()).add(e["digest"])
    assert all(len(d) == 1 for d in by_step.values()), by_step
    return len(by_step)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The script run as one plain process (no launcher, no torchrun): world of one."""
    out = tmp_path_factory.mktemp("single")
    subprocess.run(
        [sys.executable, str(WORKER), "--steps", str(STEPS), "--out", str(out)],
        env=_env(), check=True, capture_output=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    final = _finals(out)["single"]
    assert final["step"] == STEPS
    return final["params"]


def test_single_process_trains_the_script_unchanged(reference: dict[str, torch.Tensor]) -> None:
    first = elastic_worker.batch(0, 0, 1)[1]
    assert first.shape == (elastic_worker.GLOBAL_BATCH, 1)
    assert all(torch.isfinite(t).all() for t in reference.values())
    assert reference["0.weight"].shape == (16, 8)


def test_three_healthy_workers_keep_equal_digests(tmp_path: Path, reference: Any) -> None:
    # --json: one JSON document on stdout; the workers' own prints went to stderr.
    doc = json.loads(_launch(tmp_path, 3, launcher=("--json",)))
    assert doc["ok"] and doc["exit_code"] == 0 and doc["restarts"] == 0
    assert doc["summary"]["final_step"] == STEPS and doc["summary"]["workers"] == 3
    assert doc["final_digests_equal"] and len(doc["summary"]["final_digests"]) == 3
    assert 0 < doc["summary"]["goodput"] <= 1 and doc["recoveries"] == []
    events = read_events(tmp_path / "events")
    assert sorted(events) == [0, 1, 2]
    assert _periodic_digests_agree(events) == STEPS // VERIFY_EVERY
    assert not any(
        e["kind"] == EventKind.FAULT_DETECTED for lines in events.values() for e in lines
    )
    finals = _finals(tmp_path / "out")
    assert len({f["digest"] for f in finals.values()}) == 1
    assert {f["step"] for f in finals.values()} == {STEPS}
    _assert_close_to(reference, finals["0"]["params"])


@pytest.mark.parametrize(
    "kill",
    [
        Kill(worker=1, step=8, where="boundary"),
        Kill(worker=2, step=8, where="collective", delay_s=0.001),
        Kill(worker=1, step=8, where="boundary", signal="STOP"),
    ],
    ids=["at-step-boundary", "inside-allreduce", "hung-sigstop"],
)
def test_killed_worker_is_replaced_and_healed(tmp_path: Path, reference: Any, kill: Kill) -> None:
    # Survivors go on alone from step 8, then wait at step 20 until the replacement joined.
    # A hung worker stops beating: the launcher kills it after the hang timeout (3 s), far
    # below the gloo timeout (60 s), which closes its sockets under the survivors' all-reduce.
    hang = kill.signal == "STOP"
    timeout_s = 60 if hang else 20
    schedule = KillSchedule((kill,))
    stdout = _launch(
        tmp_path, 3, schedule, "--hold-at", "20", "--hold-size", "3", timeout_s=timeout_s,
        hang_s=3.0,
    )  # fmt: skip
    events = read_events(tmp_path / "events")
    survivors = [w for w in (0, 1, 2) if w != kill.worker]
    assert sorted(events) == [0, 1, 2, 3], "one replacement, with a fresh worker id"
    for w in survivors:  # never restarted: one start, one finish, a detected fault
        kinds = [e["kind"] for e in events[w]]
        assert kinds.count(EventKind.START) == 1 and kinds.count(EventKind.FINISH) == 1
        assert EventKind.FAULT_DETECTED in kinds
        assert sum(e["kind"] == EventKind.STEP and not e["committed"] for e in events[w]) <= 1
        # the launcher publishes the 2-member epoch as soon as it reaps the dead worker,
        # seconds before its replacement (a fresh interpreter) can be ready
        assert any(e["kind"] == EventKind.STEP and e["committed"] and len(e["members"]) == 2
                   for e in events[w])  # fmt: skip
    healed = [e for e in events[3] if e["kind"] == EventKind.STATE_RECEIVED]
    assert healed and healed[0]["step"] >= kill.step, "the newcomer received committed state"
    assert any(e["kind"] == EventKind.FIRST_COMMIT_AFTER_CHANGE for e in events[3])
    _periodic_digests_agree(events)
    finals = _finals(tmp_path / "out")
    assert sorted(finals) == sorted([str(w) for w in survivors] + ["3"])
    assert len({f["digest"] for f in finals.values()}) == 1, "bit parity at the end"
    assert {f["step"] for f in finals.values()} == {STEPS}
    _assert_close_to(reference, finals["3"]["params"])
    assert "restarts" in stdout and "recoveries" in stdout
    (rec,) = recoveries(tmp_path / "events")
    assert (rec.worker, rec.exit_code, rec.replacement) == (kill.worker, -9, 3)
    assert rec.lost_steps <= 1 and rec.detect_s is not None and rec.resume_s is not None
    assert rec.rejoin_s is not None and rec.rejoin_s > 0
    if hang:  # excluded by heartbeats, not by gloo's timeout (liveness bound, not a benchmark)
        launcher = [e for e in _launcher_log(tmp_path / "events") if e["kind"] == EventKind.HUNG]
        assert [e["wid"] for e in launcher] == [kill.worker]
        assert rec.resume_s < timeout_s / 2


def test_raising_worker_is_replaced_and_a_delayed_one_is_a_straggler(
    tmp_path: Path, reference: Any
) -> None:
    # Worker 1 raises inside step 8 (an uncaught exception: it dies, exit code 1); worker 2
    # sleeps 80 ms before every all-reduce: the launcher reports it, and only it, a straggler.
    schedule = KillSchedule(
        raises=(Raise(worker=1, step=8),), delays=(Delay(worker=2, delay_s=0.08),)
    )
    stdout = _launch(
        tmp_path, 3, schedule, "--hold-at", "20", "--hold-size", "3", "--stats-window", "5"
    )
    events = read_events(tmp_path / "events")
    assert sorted(events) == [0, 1, 2, 3]
    for w in (0, 2):
        kinds = [e["kind"] for e in events[w]]
        assert kinds.count(EventKind.START) == 1 and EventKind.FAULT_DETECTED in kinds
        assert sum(e["kind"] == EventKind.STEP and not e["committed"] for e in events[w]) <= 1
        stats = [e for e in events[w] if e["kind"] == EventKind.STEP_STATS]
        assert [e["step"] for e in stats] == list(range(5, STEPS + 1, 5))
    (rec,) = recoveries(tmp_path / "events")
    assert (rec.worker, rec.exit_code, rec.replacement) == (1, 1, 3) and rec.lost_steps <= 1
    finals = _finals(tmp_path / "out")
    assert sorted(finals) == ["0", "2", "3"] and len({f["digest"] for f in finals.values()}) == 1
    _assert_close_to(reference, finals["3"]["params"])
    stragglers = [e for e in _launcher_log(tmp_path / "events") if e["kind"] == EventKind.STRAGGLER]
    windows = {w: [(e["step"], round(e["own_median"], 4)) for e in lines
                   if e["kind"] == EventKind.STEP_STATS]
               for w, lines in events.items()}  # fmt: skip
    assert [e["wid"] for e in stragglers] == [2], (stragglers, windows)
    assert stragglers[0]["ratio"] > 2
    assert "worker 2 (" in stdout


def test_parity_policy_ahead_wins_then_majority() -> None:
    results = run_ranks(elastic_worker.reconcile_policies, 3, timeout_s=60)
    steps, digests, received, sources = zip(*(r["ahead"] for r in results), strict=True)
    assert steps == (1, 1, 1) and len(set(digests)) == 1
    assert received == (False, True, True) and set(sources) == {0}
    steps, digests, received, mismatch, sources = zip(
        *(r["majority"] for r in results), strict=True
    )
    assert steps == (2, 2, 2) and len(set(digests)) == 1
    assert received == (False, True, False)
    assert all(mismatch) and set(sources) == {0}


# -- the pieces around the processes (no processes) ----------------------------------------


def test_kill_schedules_are_seeded_and_travel_in_the_environment() -> None:
    a = KillSchedule.seeded(7, workers=3, steps=range(5, 20), count=2)
    assert a == KillSchedule.seeded(7, workers=3, steps=range(5, 20), count=2)
    assert len({k.worker for k in a.kills}) == 2
    assert KillSchedule.from_env(a.to_env()) == a
    assert KillSchedule.from_env({}) == KillSchedule()
    with pytest.raises(ConfigError, match="where must be"):
        Kill(worker=0, step=1, where="sometime")
    mixed = KillSchedule.mixed(3, workers=3, steps=range(5, 20), count=3)
    assert mixed == KillSchedule.mixed(3, workers=3, steps=range(5, 20), count=3)
    assert KillSchedule.from_env(mixed.to_env()) == mixed
    faults = [*mixed.kills, *mixed.raises, *mixed.delays]
    assert len({f.worker for f in faults}) == 3
    kinds = {
        type(f).__name__ + getattr(f, "signal", "")
        for seed in range(40)
        for f in (lambda m: [*m.kills, *m.raises, *m.delays])(
            KillSchedule.mixed(seed, workers=3, steps=range(5, 20), count=2)
        )
    }
    assert kinds == {"KillKILL", "KillSTOP", "Raise", "Delay"}
    legacy = {"STALWART_CHAOS": '[{"worker": 1, "step": 3}]'}  # a plain list is a list of kills
    assert KillSchedule.from_env(legacy) == KillSchedule((Kill(worker=1, step=3),))
    with pytest.raises(ConfigError, match="count"):
        KillSchedule.mixed(0, workers=2, steps=range(5), count=3)
    assert Delay(worker=0, delay_s=0.1, start=2, stop=4).covers(3)
    assert not Delay(worker=0, delay_s=0.1, start=2, stop=4).covers(4)


def test_worker_environment_is_read_in_one_place() -> None:
    assert protocol.from_env({}) is None
    env = protocol.from_env(
        {protocol.ENV_STORE: "127.0.0.1:4242", protocol.ENV_WORKER: "3", protocol.ENV_TIMEOUT: "2"}
    )
    assert env is not None and (env.port, env.worker_id, env.timeout_s) == (4242, 3, 2.0)
    with pytest.raises(ConfigError, match=protocol.ENV_WORKER):
        protocol.from_env({protocol.ENV_STORE: "127.0.0.1:4242"})


def test_summary_counts_faults_discards_heals_and_goodput(tmp_path: Path) -> None:
    log = EventLog(tmp_path, 0)
    log.write(EventKind.START, t=100.0)
    log.write(EventKind.STEP, t=101.0, step=1, committed=True, epoch=1, members=[0, 1], dt=0.5)
    log.write(EventKind.FAULT_DETECTED, t=101.1, step=1, epoch=1)
    log.write(EventKind.STEP, t=101.4, step=1, committed=False, epoch=1, members=[0, 1], dt=0.25)
    log.write(EventKind.STATE_RECEIVED, t=101.5, step=1, epoch=2)
    log.write(EventKind.FINISH, t=102.0, step=1, epoch=2, digest="ab")
    log.close()
    (tmp_path / "worker1.jsonl").write_text('{"t": 1, "wid": 1, "kind": "start"}\n{"t": 2, "wi')
    s = summarize(tmp_path)
    assert (s.workers, s.final_step, s.faults, s.discarded_steps, s.heals) == (2, 1, 1, 1, 1)
    assert s.final_digests == {0: "ab"}
    assert s.goodput == pytest.approx(0.5 / 2.0)  # committed time / summed lifetimes


def test_typed_events_write_the_same_lines_as_kind_and_fields(tmp_path: Path) -> None:
    typed, plain = EventLog(tmp_path, 0, "typed.jsonl"), EventLog(tmp_path, 0, "plain.jsonl")
    typed.record(StepCommitted(step=2, epoch=1, members=[0, 1], dt=0.5, digest=None))
    plain.write(EventKind.STEP, step=2, committed=True, epoch=1, members=[0, 1], dt=0.5,
                digest=None)  # fmt: skip
    typed.record(StepDiscarded(step=2, epoch=1, members=[0, 1], dt=0.25))
    plain.write(EventKind.STEP, step=2, committed=False, epoch=1, members=[0, 1], dt=0.25)
    typed.record(FaultDetected(step=2, epoch=1, members=[0, 1], error="closed"))
    plain.write(EventKind.FAULT_DETECTED, step=2, epoch=1, members=[0, 1], error="closed")
    typed.close()
    plain.close()

    def lines(name: str) -> list[dict[str, Any]]:
        rows = [json.loads(r) for r in (tmp_path / name).read_text().splitlines()]
        return [{k: v for k, v in r.items() if k != "t"} for r in rows]

    assert lines("typed.jsonl") == lines("plain.jsonl")
    assert list(lines("typed.jsonl")[0]) == [
        "wid", "kind", "step", "committed", "epoch", "members", "dt", "digest"
    ]  # fmt: skip
    assert lines("typed.jsonl")[1]["kind"] == EventKind.STEP == "step"


def test_job_world_is_explicit_or_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (protocol.ENV_STORE, "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert World.detect() is World.SINGLE
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert World.detect() is World.TORCHRUN
    model = torch.nn.Linear(2, 2)
    state = stalwart.TrainingState(model=model, optimizer=torch.optim.SGD(model.parameters()))
    job = Job(state, world="single")  # explicit wins over the environment
    assert (job.world, job.size, job.elastic) == (World.SINGLE, 1, False)
    job.close()
    with pytest.raises(ConfigError, match="stalwart run"):
        Job(state, world="elastic")


def test_launch_refuses_impossible_sizes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="min_size"):
        launch(WORKER, nproc=2, min_size=3, events_dir=tmp_path)


def test_step_stats_close_a_window_every_n_steps() -> None:
    stats = StepStats(4)
    assert [stats.add(own, 2 * own, step) for own, step in ((0.1, 1), (0.3, 2), (0.2, 3))] == [
        None,
        None,
        None,
    ]
    window = stats.add(0.4, 0.8, 4)
    assert window is not None and window["step"] == 4 and window["window"] == 4
    assert window["own_median"] == pytest.approx(0.25) and window["own_p90"] == 0.4
    assert window["step_median"] == pytest.approx(0.5)
    assert stats.add(0.1, 0.1, 5) is None, "a new window starts empty"
    assert StepStats(0).add(1.0, 1.0, 1) is None
    assert percentile([5.0, 1.0, 3.0], 0.5) == 3.0


def test_straggler_is_reported_once_after_persistent_windows() -> None:
    watch = StragglerWatch(factor=2.0, persist=3, min_excess_s=0.005)

    def windows(step: int, slow: float) -> dict[int, dict[str, Any]]:
        own = {0: 0.010, 1: slow, 2: 0.012}
        return {w: {"step": step, "own_median": t} for w, t in own.items()}

    assert watch.update(windows(5, 0.050)) == []
    assert watch.update(windows(5, 0.050)) == [], "the same window again is no new evidence"
    assert watch.update(windows(10, 0.015)) == [], "a normal window resets the count"
    assert watch.update(windows(15, 0.050)) == [] and watch.update(windows(20, 0.050)) == []
    (report,) = watch.update(windows(25, 0.050))
    assert report["wid"] == 1 and report["ratio"] == pytest.approx(0.050 / 0.011)
    assert watch.update(windows(30, 0.050)) == [] and list(watch.reported) == [1]
    quiet = StragglerWatch(factor=2.0, persist=1)  # 3x slower but only 2 ms: noise
    assert (
        quiet.update({0: {"step": 1, "own_median": 0.001}, 1: {"step": 1, "own_median": 0.003}})
        == []
    )


def test_heartbeat_watch_names_the_silent_worker(tmp_path: Path) -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = protocol.WorkerEnv("127.0.0.1", store.port, 0, None, timeout_s=5, hang_s=0.25)
    beating = Heartbeat(env)
    store.add(protocol.keys.beat(1), 1)  # worker 1 beat once, then went silent
    watch = HeartbeatWatch(store, hang_s=0.25)
    assert watch.hung([2]) == {}, "a worker that never beat is still starting"
    hung: dict[int, float] = {}
    deadline = time.monotonic() + 30  # liveness bound only
    while not hung and time.monotonic() < deadline:
        hung = watch.hung([0, 1, 2])
        time.sleep(0.02)
    beating.stop()
    assert list(hung) == [1] and hung[1] > 0.25
    assert HeartbeatWatch(store, hang_s=0).hung([1]) == {}


def test_demo_section_heals_a_killed_and_a_paused_worker(tmp_path: Path) -> None:
    from stalwart.demos.elastic import run_elastic_demo

    out = io.StringIO()
    assert run_elastic_demo(Console(file=out, width=200), events_dir=tmp_path)
    text = out.getvalue()
    assert "digests equal on every member after 2 heals" in text
    assert "SIGSTOP" in text and "healed from" in text
    assert [e["wid"] for e in _launcher_log(tmp_path) if e["kind"] == EventKind.HUNG] == [2]
