"""``Job(warmup=...)``: a replacement warms up before it announces itself; first members don't.

Real processes under ``stalwart run`` (gloo on CPU): worker 1 is SIGKILLed at step 3, its
replacement (worker 2) runs the warm-up (a forward and backward that also moves BatchNorm's
running statistics) before the coordinator knows it, then heals; every member ends with the
same digest, so nothing the warm-up touched in the state survived the heal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.elastic import read_events
from stalwart.testing import Kill, KillSchedule

pytestmark = pytest.mark.timeout(150)

WORKER = Path(__file__).with_name("warmup_worker.py")


def test_only_the_replacement_warms_up_and_the_heal_overwrites_what_it_touched(
    tmp_path: Path,
) -> None:
    out, events = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("STALWART_ELASTIC_STORE", None)
    env.update(KillSchedule((Kill(worker=1, step=3),)).to_env())
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "2", "--max-restarts", "2",
           "--events", str(events), "--timeout", "20", str(WORKER), "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=130)
    assert done.returncode == 0, f"stalwart run failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    assert sorted(p.name for p in out.glob("warmed-*")) == ["warmed-2"]
    assert all(json.loads((out / "warmed-2").read_text())["grads"])  # it cleared its gradients
    finals = {p.name: json.loads(p.read_text())["digest"] for p in out.glob("final-*.json")}
    assert set(finals) == {"final-0.json", "final-2.json"}
    assert len(set(finals.values())) == 1
    received = [e for e in read_events(events)[2] if e["kind"] == "state-received"]
    assert received  # the replacement was healed, not a first member
