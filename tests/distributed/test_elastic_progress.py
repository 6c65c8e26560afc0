"""A job whose every state-holding member dies fails loudly instead of starting over at step 0.

Without checkpoint tiers nothing can resume the committed state: the first replacement
reports the error through the store and the launcher stops at once (exit code 3), instead
of respawning doomed workers until ``--max-restarts``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.elastic import read_events
from stalwart.elastic.events import EventKind
from stalwart.elastic.supervisor import EXIT_FATAL
from stalwart.testing import Kill, KillSchedule

from .test_elastic import RUN_TIMEOUT_S, STEPS, WORKER, _env, _launcher_log

pytestmark = pytest.mark.timeout(150)


def test_losing_every_member_that_held_the_state_is_an_error_not_a_restart(
    tmp_path: Path,
) -> None:
    # both original workers die at the start of step 6: their replacements find nobody to heal
    # from, while the coordinator knows the job had committed step 6
    chaos = KillSchedule((Kill(worker=0, step=6), Kill(worker=1, step=6)))
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "2", "--max-restarts", "20",
           "--events", str(tmp_path / "events"), "--timeout", "10", str(WORKER),
           "--steps", str(STEPS), "--out", str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(cmd, env=_env(chaos), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)  # fmt: skip
    assert done.returncode == EXIT_FATAL, done.stdout + done.stderr[-3000:]
    assert "durable checkpoint" in done.stderr and "start over" in done.stderr, done.stderr[-3000:]
    events = read_events(tmp_path / "events")
    newcomers = [w for w in events if w >= 2]
    assert newcomers, "the launcher replaced the dead workers"
    for wid in newcomers:  # no replacement committed a single step of a restarted job
        assert not any(e["kind"] == EventKind.STEP and e["committed"] for e in events[wid]), wid
    assert not list((tmp_path / "out").glob("final-*.pt")), "no run finished as if all was well"
    spawned = [e for e in _launcher_log(tmp_path / "events") if e["kind"] == EventKind.SPAWNED]
    assert len(spawned) <= 4, "stopped after the first replacements, not --max-restarts 20"
