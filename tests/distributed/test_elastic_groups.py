"""Replica groups: ``stalwart run --nproc 4 --group-size 2``, FSDP2 inside each group, on gloo.

Two groups of two ranks train a small MLP sharded with ``fully_shard`` on ``job.shard_mesh``
(``groups_worker.py``). A seeded schedule kills rank 1 of group 0 inside the cross-group
all-reduce, then, once a replacement group healed, rank 0 of the other original group at
the ``group-agree`` point (its replicate all-reduce done, before its group agreed). Each
death takes its whole group out and a new group heals rank by rank from a live group; the
test checks the state bit for bit per shard across groups at every committed step (the
worker verifies every step), that a group's ranks always committed the same steps, and the
final weights against one plain process (float tolerance: the split of the batch changes
with the membership). Timing bounds only liveness.
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

from stalwart.elastic import read_events
from stalwart.elastic.events import EventKind, JobSummary, launcher_lines
from stalwart.elastic.roster import Roster
from stalwart.elastic.timeouts import Timeouts
from stalwart.errors import ConfigError
from stalwart.testing import Kill, KillSchedule

pytestmark = pytest.mark.timeout(150)

WORKER = Path(__file__).with_name("groups_worker.py")
STEPS = 24


def _env(schedule: KillSchedule | None = None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("STALWART_ELASTIC_STORE", None)
    return {**env, **(schedule.to_env() if schedule else {})}


def _finals(out: Path) -> dict[str, dict[str, Any]]:
    return {p.stem.removeprefix("final-"): torch.load(p) for p in sorted(out.glob("final-*.pt"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The same script as one plain process: a one-rank mesh, the whole batch per step."""
    out = tmp_path_factory.mktemp("single")
    subprocess.run([sys.executable, str(WORKER), "--steps", str(STEPS), "--out", str(out)],
                   env=_env(), check=True, capture_output=True, timeout=100)  # fmt: skip
    return _finals(out)["single"]["full"]


def _shards_agree_at_every_step(events: dict[int, list[dict[str, Any]]],
                                shard: dict[int, int]) -> None:  # fmt: skip
    """Bit parity per shard across groups at every verified step (verify_every = 1: every
    committed step, except where the check itself failed because a peer died after the
    commit; the next epoch's heal verified it then)."""
    by_step: dict[tuple[int, int], set[str]] = {}
    for wid, lines in events.items():
        faulted = {e["step"] for e in lines if e["kind"] == EventKind.FAULT_DETECTED}
        for e in lines:
            if e["kind"] == EventKind.STEP and e["committed"]:
                assert e["digest"] or e["step"] in faulted, (wid, e)
                if e["digest"]:
                    by_step.setdefault((e["step"], shard[wid]), set()).add(e["digest"])
    assert len({step for step, _ in by_step}) >= STEPS - 2
    assert all(len(d) == 1 for d in by_step.values()), by_step


def test_group_deaths_take_the_group_out_and_a_new_group_heals_per_shard(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    schedule = KillSchedule(
        kills=(
            Kill(worker=1, step=5, where="collective", delay_s=0.001),
            Kill(worker=2, step=13, where="agree"),
        )
    )
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "4", "--group-size", "2",
           "--max-restarts", "2", "--events", str(tmp_path / "events"), "--timeout", "20",
           "--json", str(WORKER), "--steps", str(STEPS), "--hold-at", "10", "--hold-at", "18",
           "--hold-replicas", "2", "--warmup", "--out", str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(cmd, env=_env(schedule), capture_output=True, text=True, timeout=140)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-4000:]}"
    doc = json.loads(done.stdout)
    assert doc["ok"] and doc["restarts"] == 2 and doc["final_digests_equal"], doc
    events_dir = tmp_path / "events"
    launcher = launcher_lines(events_dir)
    downs = [(e["wid"], e["killed"]) for e in launcher if e["kind"] == EventKind.GROUP_DOWN]
    assert downs == [(1, [0]), (2, [3])], "each death took its whole group out"
    assert [(r["worker"], r["replacement"]) for r in doc["recoveries"]] == [(1, 5), (2, 6)]
    shard = {int(w): r for w, r in doc["summary"]["shard_ranks"].items()}
    assert shard == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1, 6: 0, 7: 1}

    events = read_events(events_dir)
    _shards_agree_at_every_step(events, shard)
    # A group's ranks commit the same steps in the same epochs: never half a step. A rank
    # killed (or taken out with its group) after the group agreed may not live to record the
    # step its partner records, so in a group that died one rank may be one step ahead.
    for first, second in ((0, 1), (2, 3), (4, 5), (6, 7)):
        steps = [
            [(e["step"], e["epoch"]) for e in events[w]
             if e["kind"] == EventKind.STEP and e["committed"]]
            for w in (first, second)
        ]  # fmt: skip
        if first >= 4:  # the groups that finished
            assert steps[0] == steps[1], (first, second)
        else:
            short, long = sorted(steps, key=len)
            assert long[: len(short)] == short and len(long) - len(short) <= 1, (first, second)
    healed = {w for w, lines in events.items()
              for e in lines if e["kind"] == EventKind.STATE_RECEIVED}  # fmt: skip
    assert {4, 5, 6, 7} <= healed, "every rank of each new group received its shard"

    finals = _finals(tmp_path / "out")
    assert sorted(finals) == ["4", "5", "6", "7"]
    assert {f["step"] for f in finals.values()} == {STEPS}
    # each new group's ranks warmed up once, before they joined (Job(warmup=...) waits for
    # the model sharded on the group's mesh, then the group announces itself)
    assert {w: f["warmups"] for w, f in finals.items()} == {w: [0] for w in "4567"}
    for rank in (0, 1):
        assert len({f["digest"] for f in finals.values() if f["shard_rank"] == rank}) == 1
    for name, ref in reference.items():
        torch.testing.assert_close(finals["4"]["full"][name], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("warmup", [False, True], ids=["follow", "warm-up-then-follow"])
def test_a_replacement_group_follows_per_shard_and_joins_with_nothing_sent(
    tmp_path: Path, reference: dict[str, torch.Tensor], warmup: bool
) -> None:
    # Job(follow=True) with groups: rank 1 of group 0 dies at step 5 and its group is taken
    # out; each rank of the replacement group follows the survivors' rank of its own shard
    # (a copy of that rank's shard, then its reduced gradients step by step) while the
    # survivors commit, and the group joins with equal digests: nothing is sent. With a
    # warm-up, each new rank runs it once its model is sharded, before it follows.
    schedule = KillSchedule(kills=(Kill(worker=1, step=5, where="boundary"),))
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "4", "--group-size", "2",
           "--max-restarts", "1", "--events", str(tmp_path / "events"), "--timeout", "20",
           "--json", str(WORKER), "--steps", str(STEPS), "--hold-at", "20",
           "--hold-replicas", "2", "--step-sleep", "0.2", "--follow",
           *(["--warmup"] if warmup else []), "--out", str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(cmd, env=_env(schedule), capture_output=True, text=True, timeout=140)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-4000:]}"
    doc = json.loads(done.stdout)
    assert doc["ok"] and doc["restarts"] == 1 and doc["final_digests_equal"], doc
    assert (doc["summary"]["follows"], doc["summary"]["heals"]) == (2, 0), doc["summary"]
    shard = {int(w): r for w, r in doc["summary"]["shard_ranks"].items()}
    assert shard == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1}
    events = read_events(tmp_path / "events")
    follows = {w: {e["outcome"]: e for e in lines if e["kind"] == EventKind.FOLLOW}
               for w, lines in events.items()}  # fmt: skip
    assert not follows[0] and not follows[1], "the dead group takes no part"
    for pusher, follower in ((2, 4), (3, 5)):  # the survivors' ranks, one pusher per shard
        pushed, followed = follows[pusher], follows[follower]
        assert set(pushed) == {"started", "promoted"}, pushed
        assert pushed["started"]["peer"] == follower and shard[follower] == shard[pusher]
        assert set(followed) == {"promoted"}, followed
        assert followed["promoted"]["step"] == pushed["promoted"]["step"] >= 5
    for kind in (EventKind.STATE_RECEIVED, EventKind.PARITY_MISMATCH):
        assert not any(e["kind"] == kind for lines in events.values() for e in lines), kind
    _shards_agree_at_every_step(events, shard)
    finals = _finals(tmp_path / "out")
    assert sorted(finals) == ["2", "3", "4", "5"]
    assert {f["step"] for f in finals.values()} == {STEPS}
    warmed = {w: f["warmups"] for w, f in finals.items()}
    assert warmed == {"2": [], "3": [], "4": [0] * warmup, "5": [0] * warmup}, warmed
    for name, ref in reference.items():
        torch.testing.assert_close(finals["4"]["full"][name], ref, rtol=1e-4, atol=1e-5)


# -- the pieces around the processes (no processes) ----------------------------------------


def test_one_timeout_derives_the_others_in_order() -> None:
    t = Timeouts(timeout_s=10)
    assert t.table() == {"heartbeat_s": 1.0, "hang_s": 5.0, "collective_s": 10.0, "join_s": 300.0}
    assert t.check() == []
    for s in (0.5, 1, 3, 10, 60, 600):
        d = Timeouts(timeout_s=s)
        assert d.heartbeat_s < d.hang_s < d.collective_s < d.join_s, s
        assert d.join_s > d.collective_s + d.hang_s and d.check() == []
    late = Timeouts(timeout_s=3, hang_override_s=5)  # a test's choice: warned, not refused
    assert "hang timeout 5 s >= collective timeout 3 s" in late.check()[0]
    assert Timeouts(timeout_s=10, hang_override_s=0).heartbeat_s == 0
    with pytest.raises(ConfigError, match="positive"):
        Timeouts(timeout_s=0)


def test_the_roster_takes_a_group_out_once_and_publishes_complete_groups() -> None:
    roster = Roster(4, 2)
    for rank_slots in ((0, 1), (2, 3)):
        gid = roster.new_group()
        for wid in rank_slots:
            roster.add(gid, wid, roster.free_slot(None))
    assert roster.complete({0, 1, 2, 3}) == [[0, 1], [2, 3]]
    assert roster.complete({0, 1, 2}) == [[0, 1]], "a group is listed whole or not at all"
    assert roster.take_down(1) == [0] and roster.take_down(0) is None
    assert roster.taken_down == {0: 1}
    new = roster.new_group()
    for old in (0, 1):
        roster.add(new, 4 + old, roster.free_slot(old))
    assert roster.slot_of[4] == 0 and roster.slot_of[5] == 1, "the new group takes the old slots"
    assert roster.complete(range(6)) == [[2, 3], [4, 5]] and roster.live_groups(range(6)) == 2
    with pytest.raises(ConfigError, match="divide"):
        Roster(4, 3)


def test_group_size_must_divide_nproc_and_agree_is_a_chaos_point(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "4", "--group-size", "3",
           "--events", str(tmp_path), str(WORKER), "--steps", "1"]  # fmt: skip
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "divide" in done.stdout + done.stderr
    assert Kill(worker=0, step=1, where="agree").where == "agree"
    summary = JobSummary(final_digests={0: "a", 1: "b", 2: "a", 3: "b"},
                         shard_ranks={0: 0, 1: 1, 2: 0, 3: 1})  # fmt: skip
    assert summary.final_digests_equal
    summary.final_digests[3] = "c"
    assert not summary.final_digests_equal
