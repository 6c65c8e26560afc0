"""The recovery ladder on gloo ranks, and exactly-once data under ``stalwart run`` with kills.

Ladder: each rank has its own tiers on tmp folders (memory snapshots kept on a folder as on a
tmpfs, local disk), real checkpoints of a small TrainingState; corruption is a flipped byte in
a pack file or in a snapshot's memory; every member must resume at the same verified step.
The bodies are in ``ladder_ranks.py``.

Exactly-once (``sampler_worker.py``): workers log the sample ids of each step they commit;
over a run with two SIGKILLs and two replacements, every data epoch is consumed exactly once
and the final parameters equal a one-process run's.
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

from stalwart.testing import Kill, KillSchedule, run_ranks

from . import ladder_ranks, sampler_worker

pytestmark = pytest.mark.timeout(240)

HELD_BY_TWO = (6, "durable", [2], "held by rank(s) [0, 1] of 3 only")


def test_durable_newest_common_step_wins_and_corruption_moves_everyone(tmp_path: Path) -> None:
    results = run_ranks(ladder_ranks.durable_per_rank, 3, str(tmp_path), timeout_s=180)
    for r in results:
        # step 6 is not on rank 2: not chosen; step 4 is on everyone: chosen
        report, value = r["partial"]
        assert (report["step"], report["tier"], report["lost"], value) == (4, "durable", 3, 4.0)
        assert report["rejected"] == [HELD_BY_TWO]
        # rank 1's copy of step 4 fails its checksum: every rank goes to step 2 together
        report, value = r["corrupt"]
        assert (report["step"], report["lost"], value) == (2, 5, 2.0)
        assert report["rejected"] == [HELD_BY_TWO, (4, "durable", [1], "CorruptCheckpointError")]


def test_tiers_memory_first_then_disk_and_a_restart_shares_one_nodes_memory(
    tmp_path: Path,
) -> None:
    results = run_ranks(ladder_ranks.tiered, 3, str(tmp_path), timeout_s=180)
    for rank, r in enumerate(results):
        report, value = r["newest"]  # memory holds 5, 6 and local 4: memory's 6 is newest
        assert (report["step"], report["tier"], report["rejected"], value) == (6, "memory", [], 6.0)
        report, value = r["bad_memory"]  # rank 1's snapshot of 6 fails its digest
        assert (report["step"], report["tier"], value) == (5, "memory", 5.0)
        assert report["rejected"] == [(6, "memory", [1], "CorruptCheckpointError")]
        # after the restart only rank 0's node kept its snapshots (tmpfs): 5 and 6
        report, value = r["restart_strict"]
        assert (report["step"], report["tier"], report["lost"], value) == (4, "local", 2, 4.0)
        assert [x[:3] for x in report["rejected"]] == [(6, "memory", [1, 2]), (5, "memory", [1, 2])]
        report, value, _ = r["restart_replicated"]  # replicated: rank 0 sends step 6
        assert (report["step"], report["tier"], report["lost"], value) == (6, "memory", 0, 6.0)
        assert report["source"] == (None if rank == 0 else 0)
    assert len({r["restart_replicated"][2] for r in results}) == 1, "bit-identical states"


def test_nothing_to_resume_is_a_fresh_start_or_a_clear_error(tmp_path: Path) -> None:
    results = run_ranks(ladder_ranks.nothing, 3, str(tmp_path), timeout_s=180)
    assert [r["fresh"] for r in results] == [None, None, None]
    assert len({r["lost"] for r in results}) == 1 and len({r["corrupt"] for r in results}) == 1
    lost, corrupt = results[0]["lost"], results[0]["corrupt"]
    assert "no step verifies on every member in tiers ['durable']" in lost
    assert "the job committed step 12" in lost and "no tier holds any step" in lost
    assert "step 3 (durable) on rank(s) [0]: CorruptCheckpointError" in corrupt
    assert "start the run again from step 0" in corrupt


# -- exactly-once data under `stalwart run` with kills (sampler_worker.py) -----------------

SAMPLER_WORKER = Path(__file__).with_name("sampler_worker.py")
SAMPLER_STEPS = 32  # 4 data epochs of 8 global batches (7 of 7 samples, then 1)


def _run_sampler_job(out: Path, *launcher: str, env: dict[str, str]) -> None:
    hold = ["--hold-at", "12", "--hold-at", "26", "--hold-size", "3"] if launcher else []
    cmd = [sys.executable, *launcher, str(SAMPLER_WORKER), "--steps", str(SAMPLER_STEPS),
           "--out", str(out), *hold]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr[-4000:]}"


def _committed_lines(out: Path) -> list[dict[str, Any]]:
    lines = []
    for path in sorted(out.glob("samples-*.jsonl")):
        for raw in path.read_text().splitlines():
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError:  # a worker killed mid-line (a timer-thread kill)
                continue
    return lines


@pytest.mark.timeout(200)
def test_every_sample_is_consumed_once_by_committed_steps_through_kills(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("STALWART_ELASTIC_STORE", None)
    _run_sampler_job(tmp_path / "single", env=env)  # the reference: one plain process
    # worker 1 dies inside the all-reduce of step 5, worker 2 at the boundary of step 19;
    # the survivors wait at steps 12 and 26 for a replacement (sizes 3 and 2 both occur)
    schedule = KillSchedule((Kill(1, 5, "collective", delay_s=0.002), Kill(2, 19, "boundary")))
    out = tmp_path / "elastic"
    _run_sampler_job(out, "-m", "stalwart", "run", "--nproc", "3", "--max-restarts", "2",
                     "--events", str(tmp_path / "events"), "--timeout", "10",
                     "--hang-timeout", "5", env={**env, **schedule.to_env()})  # fmt: skip
    lines = _committed_lines(out)
    by_step: dict[int, list[dict[str, Any]]] = {}
    for line in lines:
        by_step.setdefault(line["step"], []).append(line)
    assert sorted(by_step) == list(range(SAMPLER_STEPS)), "every committed step was logged"
    sizes = set()
    for step, entries in by_step.items():
        (global_ids,) = {tuple(e["global"]) for e in entries}  # one global batch per step
        for (epoch, size), group in _by_epoch(entries).items():
            shares = [i for e in group for i in e["ids"]]
            assert len(shares) == len(set(shares)), f"step {step}: members' shares overlap"
            assert set(shares) <= set(global_ids)
            if len(group) == size:  # every member of that epoch logged it: the shares tile it
                assert sorted(shares) == sorted(global_ids), (step, epoch)
                sizes.add(size)
    assert {2, 3} <= sizes, "the split followed the membership"
    per_epoch = -(-sampler_worker.SAMPLES // sampler_worker.BATCH)
    for first in range(0, SAMPLER_STEPS, per_epoch):
        consumed = [i for s in range(first, first + per_epoch) for i in by_step[s][0]["global"]]
        dup = len(consumed) - len(set(consumed))
        missing = set(range(sampler_worker.SAMPLES)) - set(consumed)
        assert (dup, missing) == (0, set()), f"data epoch {first // per_epoch}"
    finals = {p.stem: torch.load(p) for p in (out.glob("final-*.pt"))}
    assert len(finals) == 3 and len({f["digest"] for f in finals.values()}) == 1
    (reference,) = (torch.load(p) for p in (tmp_path / "single").glob("final-*.pt"))
    for f in finals.values():  # the committed updates saw exactly the reference's samples
        for name, want in reference["params"].items():
            torch.testing.assert_close(f["params"][name], want, rtol=1e-4, atol=1e-5)


def _by_epoch(entries: list[dict[str, Any]]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    out: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in entries:
        out.setdefault((e["epoch"], e["size"]), []).append(e)
    return out


def test_replica_groups_need_every_shard_and_share_along_the_replicate_dimension(
    tmp_path: Path,
) -> None:
    results = run_ranks(ladder_ranks.replica_groups, 4, str(tmp_path), timeout_s=180)
    for rank, r in enumerate(results):
        shard = rank % 2
        report, value = r["strict"]  # memory of 6 on group 0 only: the disk's step 4
        assert (report["step"], report["tier"], value) == (4, "local", 40.0 + shard)
        assert [x[:3] for x in report["rejected"]] == [(6, "memory", [2, 3]), (5, "memory", [2, 3])]
        report, value = r["replicated"]  # rank i of group 0 sends shard i to rank i of group 1
        assert (report["step"], report["tier"], value) == (6, "memory", 60.0 + shard)
        assert report["source"] == (None if rank < 2 else shard)
        report, value = r["uncovered"]  # shard 1 has no verified copy of 6: all go to 5
        assert (report["step"], report["tier"], value) == (5, "memory", 50.0 + shard)
        assert report["rejected"][0][:3] == (6, "memory", [1])
