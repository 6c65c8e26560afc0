"""Buffered DiLoCo: a member that dies after claiming a buffer never blocks the job.

Real ``stalwart run`` workers (``diloco_claimer_kill_worker.py``): the member that claims buffer
3 is SIGKILLed right after the claim, before it published version 4. A survivor takes the claim over
once the dead member has left the latest epoch, and every member ends on the same version.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stalwart.elastic import read_events
from stalwart.elastic.events import EventKind, launcher_lines

pytestmark = pytest.mark.timeout(120)

WORKER = Path(__file__).with_name("diloco_claimer_kill_worker.py")
OUTER = 10


def test_a_buffer_claimed_by_a_member_that_died_is_taken_over(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("STALWART_ELASTIC_STORE", None)
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "3", "--max-restarts", "1",
           "--events", str(tmp_path / "events"), "--timeout", "10", str(WORKER),
           "--kill-v", "3", "--mode", "async", "--k", "2", "--staleness",
           "1", "--outer", str(OUTER), "--h", "10", "--outer-momentum", "0.5",
           "--compute-s", "0.01", "--out", str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, f"stalwart run failed:\n{done.stderr[-4000:]}"
    finals = [torch.load(p) for p in sorted((tmp_path / "out").glob("final-*.pt"))]
    assert len(finals) >= 2 and {f["steps"] for f in finals} == {OUTER}
    assert len({f["digest"] for f in finals}) == 1, "every survivor ends on version OUTER"
    events = read_events(tmp_path / "events")
    takeovers = [e for lines in events.values() for e in lines
                 if e["kind"] == EventKind.DILOCO_TAKEOVER]  # fmt: skip
    killed = [e["wid"] for e in launcher_lines(tmp_path / "events") if e["kind"] == "exited"
              and e["rc"] == -9]  # fmt: skip
    assert [(e["buffer"], e["departed"]) for e in takeovers] == [(3, *killed)], takeovers
    versions = sorted(e["version"] for lines in events.values() for e in lines
                      if e["kind"] == EventKind.DILOCO_AGGREGATE)  # fmt: skip
    assert versions[:OUTER] == list(range(1, OUTER + 1)), "each version published once"
