"""Sharded state in an elastic job, healed from erasure-coded peers' memory (real gloo).

``stalwart run`` starts four workers of ``sharded_worker.py``; each owns a different shard
(an "expert" trained on its slot's own rows), protected every step with 3+1 XOR erasure
coding. A worker is SIGKILLed inside the all-reduce; its replacement takes over its slot and
rebuilds the shard from the three survivors' pieces, bit-identical to what the dead worker
protected; everyone returns to that step and training finishes. The experts' final bytes equal
an uninterrupted computation's exactly; the replicated model equals it to float tolerance
(the all-reduce's summation order follows ranks, and the replacement's new worker id gives it
another rank). Losing two workers of a 3+1 group at once fails with the fix in the message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from stalwart.elastic.sharded import assign_slots, lost_beyond_tolerance
from stalwart.errors import ConfigError
from stalwart.testing import Kill, KillSchedule

from . import sharded_worker

pytestmark = pytest.mark.timeout(240)

WORKER = Path(__file__).with_name("sharded_worker.py")
STEPS = 14
SLOTS = 4


def _launch(tmp: Path, schedule: KillSchedule) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **schedule.to_env()}
    env.pop("STALWART_ELASTIC_STORE", None)
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", str(SLOTS), "--min-size",
           str(SLOTS), "--max-restarts", "2", "--events", str(tmp / "events"), "--timeout",
           "30", str(WORKER), "--steps", str(STEPS), "--out", str(tmp / "out")]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)


def _logs(out: Path) -> dict[int, list[dict[str, Any]]]:
    return {
        int(p.stem.removeprefix("log-w")): [json.loads(x) for x in p.read_text().splitlines()]
        for p in out.glob("log-w*.jsonl")
    }


def _uninterrupted() -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """The same training in one process: the full batch for the model, each slot's expert."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = sharded_worker.batch(step, 0, 1)
        F.mse_loss(model(x), y).backward()
        opt.step()
    experts = {}
    for slot in range(SLOTS):
        expert = sharded_worker._expert()
        eopt = torch.optim.SGD(expert.parameters(), lr=0.05, momentum=0.9)
        for step in range(STEPS):
            eopt.zero_grad()
            xe, ye = sharded_worker.expert_batch(step, slot)
            F.mse_loss(expert(xe), ye).backward()
            eopt.step()
        experts[slot] = expert.state_dict()
    return model.state_dict(), experts


def test_slots_survivors_keep_theirs_newcomers_take_the_free_ones() -> None:
    assert assign_slots([-1, -1, -1, -1], 4) == [0, 1, 2, 3]
    assert assign_slots([0, 2, 3, -1], 4) == [0, 2, 3, 1]  # the replacement of slot 1
    assert assign_slots([-1, 3, 0, -1], 4) == [1, 3, 0, 2]
    with pytest.raises(ConfigError):
        assign_slots([1, 1, -1, -1], 4)


def test_more_than_m_lost_per_group_is_reported() -> None:
    assert lost_beyond_tolerance([1], 4, 3, 1) == []
    assert lost_beyond_tolerance([1, 5], 8, 3, 1) == []  # one per group of 4
    over = lost_beyond_tolerance([1, 2], 4, 3, 1)
    assert len(over) == 1 and "[1, 2]" in over[0]
    assert lost_beyond_tolerance([0, 1], 6, 4, 2) == []


def test_killed_worker_rebuilds_its_shard_from_peers(tmp_path: Path) -> None:
    kill = Kill(worker=1, step=8, where="collective", delay_s=0.002)
    done = _launch(tmp_path, KillSchedule((kill,)))
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-4000:]}"
    logs = _logs(tmp_path / "out")
    finals = {int(p.stem.removeprefix("final-w")): torch.load(p)
              for p in (tmp_path / "out").glob("final-w*.pt")}  # fmt: skip
    assert sorted(finals) == [0, 2, 3, 4]  # worker 1 died, worker 4 replaced it
    heal = next(e for e in logs[4] if e["kind"] == "heal")
    assert heal["slot"] == 1 and heal["lost"] == [1] and heal["rebuilt"]
    dead = {e["step"]: e["shard"] for e in logs[1] if e["kind"] == "protect"}
    assert heal["step"] in dead and heal["step"] >= 7
    assert heal["shard"] == dead[heal["step"]]  # bit-identical to what the dead one protected
    assert {f["slot"] for f in finals.values()} == set(range(SLOTS))
    assert all(f["step"] == STEPS and f["heals"] == 1 for f in finals.values())
    params, experts = _uninterrupted()
    for f in finals.values():
        for name, ref in experts[f["slot"]].items():
            assert torch.equal(f["expert"][name], ref), (f["slot"], name)
        for name, ref in params.items():
            torch.testing.assert_close(f["params"][name], ref, rtol=1e-5, atol=1e-6)


def test_two_lost_of_a_3_plus_1_group_fail_with_the_fix(tmp_path: Path) -> None:
    kills = (Kill(worker=1, step=5, where="boundary"), Kill(worker=2, step=5, where="boundary"))
    done = _launch(tmp_path, KillSchedule(kills))
    assert done.returncode != 0
    assert "restore every member from the durable checkpoint" in done.stdout + done.stderr
