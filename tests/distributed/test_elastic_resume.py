"""Every member holding the state dies at once: the job resumes from its checkpoint tiers by itself.

Real ``stalwart run`` jobs (gloo on CPU, workers SIGKILLed by the chaos schedule): with a
durable tier attached (``Job(state, checkpoint=...)``) the replacements climb the recovery
ladder together and finish the run, equal to a plain run restarted from the step they resumed;
with a checkpoint that holds nothing yet, the launcher stops at once with the error and exit
code 3 instead of respawning doomed workers until ``--max-restarts``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stalwart.elastic import read_events
from stalwart.elastic.events import EventKind
from stalwart.elastic.supervisor import EXIT_FATAL
from stalwart.testing import Kill, KillSchedule

from .test_elastic import WORKER, _assert_close_to, _env, _finals, _launcher_log

pytestmark = pytest.mark.timeout(240)  # three 60 s runs in the first test

STEPS = 20
EVERY = 3  # the durable tier's interval: steps 3, 6, ... are saved
KILL_AT = 8  # both workers die at the start of step 8: the newest durable step is 6
# The workers wait for each save to land (--ckpt-wait): step 6's background write must not race
# the kill two short steps later (it did on a loaded box: the resume then came from step 3).
RUN_TIMEOUT_S = 60


def _run(tmp: Path, every: int, *, max_restarts: int = 4) -> subprocess.CompletedProcess[str]:
    chaos = KillSchedule((Kill(worker=0, step=KILL_AT), Kill(worker=1, step=KILL_AT)))
    # --min-size 2: the two replacements resume together (with 1, the first to import torch
    # could finish the run alone on a loaded box before the other joined, as it did once)
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "2", "--min-size", "2",
           "--max-restarts", str(max_restarts), "--events", str(tmp / "events"),
           "--timeout", "10", str(WORKER), "--steps", str(STEPS), "--step-sleep", "0.05",
           "--ckpt", str(tmp / "ckpt"), "--ckpt-every", str(every), "--ckpt-wait",
           "--out", str(tmp / "out")]  # fmt: skip
    return subprocess.run(cmd, env=_env(chaos), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)  # fmt: skip


def _plain(out: Path, ckpt: Path, steps: int) -> None:
    cmd = [sys.executable, str(WORKER), "--steps", str(steps), "--ckpt", str(ckpt),
           "--ckpt-every", str(EVERY), "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, env=_env(), check=True, capture_output=True, timeout=RUN_TIMEOUT_S)


def _first(events: dict[int, list[dict[str, Any]]], kind: str) -> list[dict[str, Any]]:
    return [e for lines in events.values() for e in lines if e["kind"] == kind]


def test_all_holders_killed_at_once_resume_from_the_newest_durable_step(tmp_path: Path) -> None:
    done = _run(tmp_path, EVERY)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    events = read_events(tmp_path / "events")
    resumed = _first(events, EventKind.RESUMED)
    assert resumed, "the replacements resumed from the checkpoint tiers"
    assert {e["step"] for e in resumed} == {KILL_AT // EVERY * EVERY}  # the newest durable step
    assert all(e["tier"] == "local" and 0 < e["steps_lost"] <= EVERY for e in resumed), resumed
    assert all(e["last_known"] == KILL_AT for e in resumed)
    assert all(e["wid"] >= 2 for e in resumed), "only the replacements resumed"
    starts = _first(events, EventKind.START)
    assert len(starts) == 4 and all(e["host"]["hostname"] for e in starts)  # fleet log's input
    # the time from the last sign of the killed workers to the first commit after the resume
    dead = max(e["t"] for w in (0, 1) for e in events[w])
    first = min(e["t"] for w in events if w >= 2 for e in events[w]
                if e["kind"] == EventKind.STEP and e["committed"])  # fmt: skip
    print(f"all killed -> resumed commit: {first - dead:.2f} s; "
          f"lost steps: {resumed[0]['steps_lost']}")  # fmt: skip
    finals = _finals(tmp_path / "out")
    assert {f["step"] for f in finals.values()} == {STEPS} and len(finals) == 2
    assert len({f["digest"] for f in finals.values()}) == 1
    # the peer: one plain process saved to that step, then restarted from it
    step = resumed[0]["step"]
    _plain(tmp_path / "p1", tmp_path / "plain-ckpt", step)
    _plain(tmp_path / "p2", tmp_path / "plain-ckpt", STEPS)
    reference = _finals(tmp_path / "p2")["single"]
    _assert_close_to(reference["params"], next(iter(finals.values()))["params"])


def test_nothing_to_resume_although_steps_committed_stops_the_launcher_at_once(
    tmp_path: Path,
) -> None:
    # the durable tier's first save would be step 50: nothing is stored when all die at step 8
    done = _run(tmp_path, 50, max_restarts=20)
    assert done.returncode == EXIT_FATAL, done.stdout + done.stderr[-4000:]
    assert "no step verifies" in done.stderr and "committed step 8" in done.stderr
    spawned = [e for e in _launcher_log(tmp_path / "events") if e["kind"] == EventKind.SPAWNED]
    assert len(spawned) <= 4, "stopped after the first replacements, not --max-restarts 20"
    assert not list((tmp_path / "out").glob("final-*.pt"))
