"""Backup workers: a step commits with the first n - b contributions, late ones dropped.

``stalwart run`` with 3 real workers, worker 2 slowed; members' digests compared bit for bit.
Nothing asserts a duration: the slowed worker only makes lateness likely, and the assertions
hold whoever is late.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from stalwart.elastic import read_events
from stalwart.elastic.backup import BackupRound, Dynamic, Static, backup_count
from stalwart.elastic.backup_policy import noise_scale
from stalwart.elastic.backup_wire import decode, encode, rng_state, set_rng_state
from stalwart.elastic.events import EventKind
from stalwart.elastic.protocol import keys
from stalwart.errors import ConfigError
from stalwart.testing import Kill, KillSchedule

pytestmark = pytest.mark.timeout(180)

WORKER = Path(__file__).with_name("backup_worker.py")
STEPS = 24


def _run(
    tmp: Path, backup: str, schedule: KillSchedule | None = None, micro: int = 1,
    base_s: float = 0.0, slow_s: float = 0.15,
) -> tuple[dict[int, list[dict[str, Any]]], list[dict[str, Any]]]:  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(schedule.to_env() if schedule else {})}
    env.pop("STALWART_ELASTIC_STORE", None)
    restarts = "1" if schedule else "0"
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "3", "--max-restarts", restarts,
           "--events", str(tmp / "events"), "--timeout", "30", str(WORKER),
           "--steps", str(STEPS), "--backup", backup, "--slow-worker", "2", "--slow-s", str(slow_s),
           "--base-s", str(base_s), "--micro", str(micro), "--out", str(tmp / "out")]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, f"stalwart run failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    finals = [torch.load(p) for p in sorted((tmp / "out").glob("final-*.pt"))]
    return read_events(tmp / "events"), finals


def _assert_parity(events: dict[int, list[dict[str, Any]]], finals: list[dict[str, Any]]) -> None:
    assert len(finals) == 3 and {f["step"] for f in finals} == {STEPS}
    assert len({f["digest"] for f in finals}) == 1, "bit parity at the end"
    by_step: dict[int, set[str]] = {}
    for lines in events.values():
        for e in lines:
            if e["kind"] == EventKind.STEP and e.get("digest"):
                by_step.setdefault(e["step"], set()).add(e["digest"])
    assert by_step and all(len(d) == 1 for d in by_step.values()), by_step
    assert not any(
        e["kind"] == EventKind.FAULT_DETECTED for lines in events.values() for e in lines
    )


def _backup_events(events: dict[int, list[dict[str, Any]]]) -> dict[int, list[dict[str, Any]]]:
    return {w: [e for e in lines if e["kind"] == EventKind.BACKUP] for w, lines in events.items()}


def test_static_backup_commits_with_the_first_two_of_three(tmp_path: Path) -> None:
    # 2 micro-batches polling too_late(job): the slow worker abandons steps that committed
    events, finals = _run(tmp_path, "1", micro=2)
    _assert_parity(events, finals)
    per_worker = _backup_events(events)
    for w, evs in per_worker.items():
        assert [e["step"] for e in evs] == list(range(STEPS)), w  # every step applied once
        assert all(len(e["used"]) == 2 for e in evs)
        late = [e for e in evs if e["ticket"] is not None and e["ticket"] > 2]
        assert all(w not in e["used"] for e in late), "a late contribution is dropped"
        gone = [e for e in evs if e["abandoned"]]
        assert all(e["ticket"] > 2 and w not in e["used"] for e in gone), "abandoned: dropped"
    assert any(e["abandoned"] for e in per_worker[2]), "worker 2 (0.15 s slower) abandoned"
    used = [tuple(e["used"]) for e in per_worker[0]]
    # the same members were used on every worker (one result per step)
    assert all([tuple(e["used"]) for e in per_worker[w]] == used for w in per_worker)


def test_partial_contributions_count_the_slow_members_share(tmp_path: Path) -> None:
    # every member sleeps 0.04 s over 4 micro-batches, worker 2 twice that: with partial=True it
    # stops once the step has its 2 contributions and sends the share it computed
    events, finals = _run(tmp_path, "1+partial", micro=4, base_s=0.04, slow_s=0.04)
    _assert_parity(events, finals)
    per_worker = _backup_events(events)
    for w, evs in per_worker.items():
        assert [e["step"] for e in evs] == list(range(STEPS)), w  # every step applied once
        assert all(len(e["shares"]) == len(e["used"]) >= 2 for e in evs)
        assert all(0 < s <= 1 for e in evs for s in e["shares"])
    shared = [e for e in per_worker[2] if 2 in e["used"] and e["ticket"] > 2]
    assert shared, "worker 2's late contribution was used"
    assert any(e["shares"][e["used"].index(2)] < 1 for e in shared), "a partial share of it"
    used = [(tuple(e["used"]), tuple(e["shares"])) for e in per_worker[0]]
    assert all([(tuple(e["used"]), tuple(e["shares"])) for e in per_worker[w]] == used
               for w in per_worker)  # fmt: skip


def test_partial_shares_weight_the_mean_by_rows_computed() -> None:
    """Three members through a real TCPStore: two full, one late with half its batch."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=20))  # fmt: skip
    master.set(keys.EPOCH, "0")  # the reducer checks for a newer membership epoch
    grads = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.0]), torch.tensor([0.5, 0.5])]
    out: dict[int, tuple[Any, int]] = {}

    def member(rank: int) -> None:
        store = dist.TCPStore("127.0.0.1", master.port, is_master=False,
                              timeout=timedelta(seconds=20))  # fmt: skip
        rnd = BackupRound(store, Static(1, partial=True))
        rnd.share = (0, 0, 0.5 if rank == 2 else 1.0)
        out[rank] = rnd.exchange(epoch=0, step=0, rank=rank, size=3, grads=[grads[rank]],
                                 buffers=[], own_s=0.01)  # fmt: skip

    threads = []
    for rank in range(3):  # tickets in rank order: rank 1 reduces, rank 2 is late
        threads.append(threading.Thread(target=member, args=(rank,)))
        threads[-1].start()
        while int(master.add("backup/0/0/n", 0)) <= rank:
            time.sleep(0.001)
    for th in threads:
        th.join(timeout=20)
    assert sorted(out) == [0, 1, 2], "every member got the step's result"
    expected = (grads[0] + grads[1] + grads[2]) / 2.5  # the mean over every row computed
    for rank, (result, ticket) in out.items():
        assert ticket == rank + 1 and result.used == (0, 1, 2) and result.shares == (1, 1, 0.5)
        assert torch.allclose(result.grads[0], expected)
    assert all(torch.equal(out[r][0].grads[0], out[0][0].grads[0]) for r in out), "one result"


def test_dynamic_backup_drops_the_slow_worker_and_keeps_parity(tmp_path: Path) -> None:
    events, finals = _run(tmp_path, "dynamic")
    _assert_parity(events, finals)
    evs = _backup_events(events)[0]
    assert len(evs[0]["used"]) == 3, "nothing measured before the first step: wait for all"
    ks = [e["next_k"] for e in evs]
    assert ks.count(2) > len(ks) // 2, ks  # worker 2 is ~0.15 s slower every step


def test_a_member_killed_inside_a_backup_step_is_replaced_with_parity(tmp_path: Path) -> None:
    kill = Kill(worker=1, step=8, where="collective", delay_s=0.001)
    events, finals = _run(tmp_path, "1", KillSchedule((kill,)))
    # Either the survivors commit step 8 without the dead member (2 of 3 suffice) and change
    # epoch after it, or it died holding the reducer's ticket and they discard step 8 as soon
    # as the launcher publishes the next epoch (not after the store's 30 s timeout). A
    # replacement may arrive after the 24 fast steps are over.
    assert len(finals) >= 2 and {f["step"] for f in finals} == {STEPS}
    assert len({f["digest"] for f in finals}) == 1, "bit parity at the end"
    for w in (0, 2):
        kinds = [e["kind"] for e in events[w]]
        assert kinds.count(EventKind.START) == 1 and kinds.count(EventKind.FINISH) == 1, (
            "survivors never restart"
        )
        assert sum(e["kind"] == EventKind.STEP and not e["committed"] for e in events[w]) <= 1
        faults = [e["error"] for e in events[w] if e["kind"] == EventKind.FAULT_DETECTED]
        assert not any("timeout" in f for f in faults), faults


def test_dynamic_choice_maximises_contributions_per_second() -> None:
    d = Dynamic()
    same = [{0: 1.0, 1: 1.0, 2: 1.0}] * 3
    assert d.choose(same, 3) == 3
    fixed = [{0: 1.0, 1: 1.05, 2: 2.0}] * 3
    assert d.choose(fixed, 3) == 2
    rotating = [{0: 2.0, 1: 1.0, 2: 1.0}, {0: 1.0, 1: 2.0, 2: 1.0}, {0: 1.0, 1: 1.0, 2: 2.0}]
    assert d.choose(rotating, 3) == 2, "a different slow member each step"
    assert d.choose([{0: 1.0, 1: 1.0}] * 2, 3) == 2, "an unmeasured member counts as slowest"
    assert d.choose([], 3) == 3
    assert Dynamic(min_k=3).choose(fixed, 3) == 3
    noisy = [{0: 0.001, 1: 0.003, 2: 0.15}] * 3  # ms of compute, jittery, against the commit
    assert d.choose(noisy, 3) == 1
    assert d.choose(noisy, 3, cost=0.010) == 2, "the commit's own cost counts"
    assert d.choose(fixed, 3, cost=0.1, noise=0.5) == 2
    close = [{0: 1.0, 1: 1.0, 2: 1.3}] * 3
    assert d.choose(close, 3, noise=1e9) == 3, "noisy: every gradient counts"
    assert d.choose(close, 3, noise=0.0) == 2, "exact: the step rate counts"
    slower = [{0: 1.0, 1: 1.0, 2: 1.5}] * 3
    assert d.choose(slower, 3, noise=1e9) == 3, "dropping a 2/3 share does not pay"
    partial = Dynamic(partial=True)  # the slow member's share (2/3 less a quarter) counts
    assert partial.choose(slower, 3, noise=1e9) == 2
    pair = [[torch.tensor([1.0, 0.5])], [torch.tensor([1.0, -0.5])]]
    assert noise_scale(pair, [torch.tensor([1.0, 0.0])]) == pytest.approx(0.5 / 0.75)
    assert math.isnan(noise_scale(pair[:1], pair[0]))
    assert backup_count(1, 3) == 2 and backup_count(5, 3) == 1 and backup_count(Dynamic(), 4) == 4
    assert backup_count(Dynamic(partial=True), 3) == 2 and backup_count(Static(1), 3) == 2
    with pytest.raises(ConfigError):
        Dynamic(window=0)
    with pytest.raises(ConfigError, match="must be >= 0"):
        Static(-1)


def test_adasum_with_backup_workers_is_refused_in_either_order() -> None:
    """A backup step combines contributions through the coordinator's store as a weighted mean,
    so Adasum and backup workers together used to average silently: now a ConfigError that
    says what to choose, whichever the loop configures first."""
    from stalwart import TrainingState
    from stalwart.elastic import Job
    from stalwart.elastic.backup_job import check_reduce

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    job = Job(TrainingState(model=model, optimizer=opt))
    job.data_parallel(model, reduce="adasum")
    with pytest.raises(ConfigError, match="use reduce='mean' with backup workers"):
        job.optimizer(opt, backup=Static(1, partial=True))
    job.optimizer(opt)  # Adasum alone is fine
    with pytest.raises(ConfigError, match="reduce='adasum'"):  # data_parallel after optimizer
        check_reduce("adasum", True)
    check_reduce("mean", True)


def test_wire_round_trip_is_bit_exact_for_any_dtype() -> None:
    tensors = [torch.randn(3, 4), torch.randn(5).to(torch.bfloat16), torch.zeros(0),
               torch.arange(6, dtype=torch.int64).reshape(2, 3)]  # fmt: skip
    header, out = decode(encode(("hdr", 1.5), tensors), [torch.empty_like(t) for t in tensors])
    assert header == ("hdr", 1.5)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(out, tensors, strict=True))
    gen = torch.Generator().manual_seed(3)
    state = rng_state([gen])

    def draw() -> tuple[torch.Tensor, float, float, torch.Tensor]:
        return torch.rand(2), random.random(), float(np.random.rand()), torch.rand(2, generator=gen)

    expected = draw()
    draw()
    set_rng_state(state, [gen])
    again = draw()
    assert torch.equal(again[0], expected[0]) and again[1:3] == expected[1:3]
    assert torch.equal(again[3], expected[3])
    with pytest.raises(ValueError, match="same shapes"):
        decode(encode(None, tensors[:1]), tensors)


def test_a_closed_backup_round_stops_its_store_cleaner() -> None:
    # Each BackupRound started a thread (with its own store connection) that deleted old
    # steps' keys forever; nothing stopped it. close() deletes what is queued, then stops.
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=20))  # fmt: skip
    master.set("backup/0/0/old", "x")
    before = {t for t in threading.enumerate() if t.name == "stalwart-backup-janitor"}
    rnd = BackupRound(master, Static(1))
    rnd._janitor.delete(["backup/0/0/old"])
    rnd.close()
    assert not master.check(["backup/0/0/old"]), "the queued key was deleted before it stopped"
    left = {t for t in threading.enumerate() if t.name == "stalwart-backup-janitor"} - before
    assert not left, "the cleaner thread outlived close()"
