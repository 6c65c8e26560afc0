"""Elastic jobs when the plumbing fails: the coordinator's store is lost, a collective is dropped.

Real ``stalwart run`` processes with gloo on CPU and the chaos harness
(:class:`~stalwart.testing.chaos.LoseCoordinator`, :class:`~stalwart.testing.chaos.Drop`). As
in ``test_elastic.py``, timing only bounds liveness; nothing asserts a duration.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from stalwart.elastic import read_events, recoveries
from stalwart.elastic.events import EventKind
from stalwart.testing.chaos import Drop, Kill, KillSchedule, LoseCoordinator

from .test_elastic import STEPS, WORKER, _env, _finals, _launch, _launcher_log

pytestmark = pytest.mark.timeout(180)


def _members_agree(tmp: Path, doc: dict[str, Any], workers: list[str]) -> None:
    assert doc["ok"] and doc["summary"]["final_step"] == STEPS, doc
    finals = _finals(tmp / "out")
    assert sorted(finals) == workers
    assert len({f["digest"] for f in finals.values()}) == 1, "bit parity at the end"
    assert {f["step"] for f in finals.values()} == {STEPS}


def test_lost_coordinator_is_rehosted_and_survivors_carry_on(tmp_path: Path) -> None:
    # At step 10 the launcher drops its store and hosts a new one on another port; every
    # worker's store connection breaks, they follow the address file, join the next epoch
    # there and train on from their own memory: nobody restarts, no step is lost. Then worker 1
    # dies at step 20: the re-hosted coordinator replaces it (a fresh id, 3) as usual.
    schedule = KillSchedule(
        kills=(Kill(worker=1, step=20),), coordinator_losses=(LoseCoordinator(step=10),)
    )
    hold = ("--hold-at", "30", "--hold-size", "3")
    doc = json.loads(_launch(tmp_path, 3, schedule, *hold, launcher=("--json",)))
    _members_agree(tmp_path, doc, ["0", "2", "3"])
    assert doc["coordinator_rehosts"] == 1 and doc["restarts"] == 1
    assert [(r["worker"], r["replacement"]) for r in doc["recoveries"]] == [(1, 3)]
    log = _launcher_log(tmp_path / "events")
    (moved,) = [e for e in log if e["kind"] == EventKind.COORDINATOR_REHOSTED]
    assert moved["members"] == [0, 1, 2] and moved["why"] == "SIGUSR1"
    events = read_events(tmp_path / "events")
    for w in (0, 2):
        kinds = [e["kind"] for e in events[w]]
        assert kinds.count(EventKind.START) == 1 and kinds.count(EventKind.FINISH) == 1
        lost = [e["step"] for e in events[w] if e["kind"] == EventKind.STEP and not e["committed"]]
        assert all(step >= 20 for step in lost) and len(lost) <= 1, lost
        joined = [e["epoch"] for e in events[w] if e["kind"] == EventKind.RECONFIGURED]
        assert joined[:2] == [1, 2], "the first epoch, then the one published on the new store"
        before = [e for e in events[w] if e["kind"] == EventKind.STEP and e["step"] <= 10]
        assert all(e["epoch"] == 1 for e in before)
    assert any(e["kind"] == EventKind.STATE_RECEIVED for e in events[3])


def test_dropped_collective_is_detected_and_the_member_replaced(tmp_path: Path) -> None:
    # Worker 1 never enters step 8's all-reduce (alive, heartbeats going): the others' collective
    # times out after the gloo timeout (3 s), they discard the step, worker 1 never arrives at
    # the next epoch, the launcher kills and replaces it, and the replacement heals.
    schedule = KillSchedule(drops=(Drop(worker=1, step=8),))
    hold = ("--hold-at", "20", "--hold-size", "3")
    doc = json.loads(_launch(tmp_path, 3, schedule, *hold, timeout_s=3, launcher=("--json",)))
    _members_agree(tmp_path, doc, ["0", "2", "3"])
    (rec,) = recoveries(tmp_path / "events")
    assert (rec.worker, rec.exit_code, rec.replacement) == (1, -9, 3) and rec.lost_steps <= 1
    events = read_events(tmp_path / "events")
    assert any(e["kind"] == EventKind.STATE_RECEIVED for e in events[3])
    for w in (0, 2):
        assert any(e["kind"] == EventKind.FAULT_DETECTED for e in events[w])


def _pid_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # a zombie nobody reaped has exited all the same


def test_launcher_death_stops_workers_with_a_clear_error(tmp_path: Path) -> None:
    # The coordinator's host dies (the launcher is SIGKILLed): no new address ever appears, so
    # each worker stops within the epoch timeout with a DistributedError that says what happened.
    events = tmp_path / "events"
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "2", "--events", str(events),
           "--timeout", "3", str(WORKER), "--steps", "100000", "--step-sleep", "0.01"]  # fmt: skip
    launcher = subprocess.Popen(
        cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        while not any(
            e["kind"] == EventKind.STEP and e["step"] >= 5 for e in read_events(events).get(0, [])
        ):
            assert launcher.poll() is None, launcher.stderr.read() if launcher.stderr else ""
            time.sleep(0.05)
        os.kill(launcher.pid, signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=120)  # EOF: every worker has exited
    finally:
        if launcher.poll() is None:
            launcher.kill()
    pids = [e["pid"] for lines in read_events(events).values() for e in lines
            if e["kind"] == EventKind.START]  # fmt: skip
    # stderr's EOF comes as the workers close their files on exit; the exit itself may finish a
    # moment later on a loaded box: wait for it (bounded), the point is that they stop
    deadline = time.monotonic() + 30
    while not all(_pid_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(pids) == 2 and all(_pid_gone(p) for p in pids)
    assert stderr.count("DistributedError: worker") == 2, stderr[-3000:]
    assert "is gone" in stderr and "run the job again with `stalwart run`" in stderr
