"""Failures that land on a process still starting, in the simulation and in the chaos schedule.

``bench/plan_validate.py`` scores the model against ``stalwart run`` jobs under a Poisson chaos
schedule that acts at step boundaries, so it cannot strike a process before its first one; the
model's ``strike_starting=False`` draws the same failures and lets the ones that land on a
starting process strike nothing. A replacement already starting when the last live holder is
lost resumes the job once it is up and the loss is found (the two run side by side).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from stalwart.plan import PlanInputs, simulate
from stalwart.plan.ladder import Kind, Layout
from stalwart.plan.simulate import _Run
from stalwart.testing.poisson import Timed, TimedFaults, read_claims

NO_MEMORY = "stalwart-no-memory"


def two_replicas(**costs: float) -> PlanInputs:
    """Two one-rank replicas, one per node and rack of their own; a remote tier every 10 steps."""
    return PlanInputs().replace(**{
        "job.accelerators": 2, "job.group_size": 1, "job.state_gb": 1.0, "job.step_s": 1.0,
        "job.accelerators_per_node": 1, "fleet.nodes_per_rack": 2,
        "fleet.crash_per_hour": 360.0, "fleet.hang_per_hour": 0.0, "fleet.sdc_per_hour": 0.0,
        "fleet.node_loss_per_hour": 0.0, "fleet.rack_loss_per_hour": 0.0,
        "fleet.network_gbps": 1e6, "tiers.disk.capacity_gb": 1e-12,
        "tiers.remote.read_gbps": 2.0, "tiers.remote.write_gbps": 100.0,
        "costs.remote_stall_s_per_gb": 0.0, "costs.remote_background_s_per_gb": 0.0,
        "costs.crash_detect_s": 0.1, "costs.hang_detect_s": 2.5, "costs.node_detect_s": 0.1,
        "costs.resume_s": 0.0, "costs.heal_s": 4.0, "costs.restart_s": 4.0, "costs.spare_s": 0.0,
        **{f"costs.{k}": v for k, v in costs.items()},
    })  # fmt: skip


def _run(strike_starting: bool) -> tuple[_Run, Layout]:
    inputs = two_replicas()
    return _Run(inputs, NO_MEMORY, {"remote": 10}, strike_starting), Layout.of(inputs)


@pytest.mark.parametrize("strike_starting", [True, False])
def test_a_crash_of_the_rank_still_healing_strikes_only_when_starting_processes_fail(
    strike_starting: bool,
) -> None:
    run, lay = _run(strike_starting)
    assert run.failure(100.0, lay.loss(Kind.CRASH, 0))  # rank 0 heals from rank 1 until 104.1
    resumed = run.seg.w0  # the peer stall and the heal's debt (half the job for 4 s)
    assert resumed == pytest.approx(100.1 + 4.0 / 2)
    again = run.failure(103.0, lay.loss(Kind.CRASH, 0))  # its replacement, still starting
    assert again is strike_starting
    if strike_starting:  # a second detection and heal
        assert run.taken["peer"] == 2 and run.seg.w0 > resumed
    else:  # nothing happened
        assert run.taken["peer"] == 1 and run.seg.w0 == resumed
    assert run.failure(120.0, lay.loss(Kind.CRASH, 0))  # healed by then: it runs, it is struck


@pytest.mark.parametrize("strike_starting", [True, False])
def test_a_failure_during_a_restart_restarts_it_only_when_starting_processes_fail(
    strike_starting: bool,
) -> None:
    run, lay = _run(strike_starting)
    run.failure(50.0, lay.loss(Kind.RACK, 0))  # both lost: restart from the remote tier
    assert run.taken["remote"] == 1
    end = run.seg.w0
    assert end == pytest.approx(50.0 + 0.1 + 4.0 + 0.5)  # detection, start, load 1 GB at 2 GB/s
    run.settle(51.0)
    assert run.failure(51.0, lay.loss(Kind.CRASH, 1)) is strike_starting
    assert (run.seg.w0 > end) is strike_starting  # a restarted rollback, or none


def test_a_replacement_starting_resumes_once_it_is_up_and_the_hang_is_found() -> None:
    """Found and started side by side: the job stands still max(detection, start left) + load."""
    run, lay = _run(strike_starting=False)
    run.failure(100.0, lay.loss(Kind.CRASH, 0))  # the replacement for rank 0 is up at 104.1
    run.settle(100.5)
    run.failure(100.5, lay.loss(Kind.HANG, 1))  # the last live holder hangs: found at 103.0
    assert run.taken["remote"] == 1
    left = 104.1 - 100.5  # the replacement's start left: longer than the hang's detection
    resumed = 100.5 + max(2.5, left) + 0.5  # 104.6
    # the hung member's replacement, launched at the hang's detection (103.0), is up at 107.0:
    # half the job is out for the 2.4 s left of its heal once the job resumed
    debt = (103.0 + 4.0 - resumed) / 2
    assert run.seg.w0 == pytest.approx(resumed + debt)


def test_sparing_starting_processes_only_removes_failures() -> None:
    """The same seeded arrivals either way; sparing the starting processes drops some of them and
    never lowers the ETTR here (every failure costs)."""
    inputs = two_replicas().replace(**{"fleet.rack_loss_per_hour": 90.0})
    both = [simulate(inputs, NO_MEMORY, {"remote": 10.0}, failures=400, replications=4, seed=5,
                     strike_starting=s) for s in (True, False)]  # fmt: skip
    struck, spared = both
    assert spared.failures < struck.failures
    assert spared.ettr > struck.ettr


def test_a_process_ignores_unclaimed_faults_timed_before_its_first_boundary(
    tmp_path: Path,
) -> None:
    now = time.time()
    (tmp_path / "origin").write_text(repr(now - 100.0))  # the job's clock started 100 s ago
    faults = (Timed(50.0, "kill"), Timed(60.0, "kill"), Timed(70.0, "all"), Timed(1e4, "kill"))
    # fault 1 was taken by a member of epoch 3 (rank 0 struck); faults 0 and 2 by nobody: every
    # process was starting then
    record = {"t": now - 40.0, "kind": "kill", "rank": 0, "size": 2, "epoch": 3}
    (tmp_path / "fault-1").write_text(json.dumps(record))
    late = TimedFaults(faults, tmp_path, 2, born=now - 200.0)  # started before all of them
    assert late.take(rank=0, size=2, epoch=3) == "KILL"  # the claimed one strikes it
    assert [f for _, f in late.pending] == [faults[3]]  # the unclaimed ones are gone
    assert [c["index"] for c in read_claims(tmp_path)] == [1]  # and never recorded


def test_a_start_factor_scales_every_heal_and_restart_start() -> None:
    """Every start drawn at twice the mean is the model with a start twice as long (the same
    failures: the factors have their own random stream); factors of one change nothing."""
    inputs = two_replicas().replace(**{"fleet.rack_loss_per_hour": 90.0})
    longer = inputs.replace(**{"costs.heal_s": 8.0, "costs.restart_s": 8.0})
    args = {"failures": 400, "replications": 4, "seed": 5, "strike_starting": False}
    doubled = simulate(inputs, NO_MEMORY, {"remote": 10.0}, start_factors=[2.0], **args)
    same = simulate(longer, NO_MEMORY, {"remote": 10.0}, **args)
    assert doubled.replications == pytest.approx(same.replications, rel=1e-6)  # to rounding
    plain = simulate(inputs, NO_MEMORY, {"remote": 10.0}, **args)
    ones = simulate(inputs, NO_MEMORY, {"remote": 10.0}, start_factors=[1.0, 1.0], **args)
    assert ones.replications == plain.replications
    assert doubled.ettr < plain.ettr


@pytest.mark.parametrize("at_boundaries", [False, True])
def test_a_rollback_launches_in_restart_s_and_a_boundary_fault_keeps_the_save_in_its_pause(
    at_boundaries: bool,
) -> None:
    """An all-holder loss stalls for detection + ``restart_s`` + the load, whatever a heal
    takes; one during a save's pause loses that save unless faults strike at step boundaries
    (the chaos schedule: the save is written as its pause begins)."""
    inputs = two_replicas(restart_s=1.0, remote_background_s_per_gb=0.5)  # a 0.5 s pause
    run = _Run(inputs, NO_MEMORY, {"remote": 10}, True, at_boundaries=at_boundaries)
    lay = Layout.of(inputs)
    assert run.failure(10.2, lay.loss(Kind.RACK, 0))  # the save of step 10 paused at 10.0
    assert run.seg.p0 == (10.0 if at_boundaries else 0.0)
    assert run.seg.w0 == pytest.approx(10.2 + 0.1 + 1.0 + 0.5)  # detection, restart, load
