"""Replaying a measured fault trace in the simulation (``simulate(schedule=...)``).

``bench/plan_validate.py`` scores each chaos run against the model with that run's own faults
(when they fell, their kind, whether they struck): the replay must give, for a schedule worked
out by hand, exactly the goodput the costs imply, and it must not change the Poisson draws.
"""

from __future__ import annotations

import pytest

from stalwart.errors import ConfigError
from stalwart.plan import PlanInputs, simulate
from stalwart.plan.trace import TracedFault
from tests.unit.test_plan_starting import two_replicas as _starting_replicas

NO_MEMORY = "stalwart-no-memory"
EVERY = {"remote": 10.0}  # a remote save every 10 steps of 1 s


def _two_replicas() -> PlanInputs:
    """``test_plan_starting``'s two one-rank replicas (a crash found in 0.1 s, a heal or restart
    start of 4 s, a load of 0.5 s), with rack losses too, for the test that draws failures."""
    return _starting_replicas().replace(**{"fleet.rack_loss_per_hour": 36.0})


def _replay(schedule: list[TracedFault], horizon_s: float = 100.0, **kw: object):
    return simulate(_two_replicas(), NO_MEMORY, EVERY, schedule=schedule, horizon_s=horizon_s,
                    replications=4, **kw)  # type: ignore[arg-type]  # fmt: skip


def test_a_replayed_crash_and_loss_of_every_member_give_the_goodput_worked_out_by_hand() -> None:
    """A crash at 30.3 s: found in 0.1 s, the step in flight (0.3) discarded, rank 0 out for its
    4 s heal (half the job: 2 s). Training resumes at 32.4 s from step 30, so the save of step
    50 commits at 52.41 s. Every member lost at 55.5 s (step 53.1): 3.1 steps redone, and the
    job stands still for detection, a start and a load (0.1 + 4 + 0.5 s). In 100 s the job
    loses 0.1 + 0.3 + 2 + 3.1 + 4.6 = 10.1 s: ETTR 0.899, in every replication."""
    got = _replay([TracedFault(30.3, "crash", 0), TracedFault(55.5, "rack", 0)])
    assert got.replications == pytest.approx((0.899,) * 4, abs=1e-9)
    assert got.ettr_ci == pytest.approx(0.0, abs=1e-9)
    assert got.failures == 4 * 2 and got.rungs == {"peer": 4, "remote": 4}
    assert got.lost_work_s == pytest.approx((0.3 + 3.1) / 2)


def test_an_empty_trace_costs_only_the_saves_and_a_trace_past_the_horizon_is_cut() -> None:
    assert _replay([]).ettr == pytest.approx(1.0)
    late = _replay([TracedFault(30.3, "crash", 0), TracedFault(150.0, "rack", 0)])
    assert late.ettr == pytest.approx((100.0 - 2.4) / 100.0)  # the loss at 150 s never came


def test_a_fault_without_a_unit_strikes_a_running_process() -> None:
    """Rank 0 heals from 30.3 s to 34.4 s; a crash of "a running process" at 31 s is rank 1,
    the last live holder: the job rolls back to step 30 (the replacement resumes it), where a
    crash of rank 0 (still starting) would strike nobody with ``strike_starting=False``."""
    unit = _replay(
        [TracedFault(30.3, "crash", 0), TracedFault(31.0, "crash")], strike_starting=False
    )
    assert unit.rungs == {"peer": 4, "remote": 4}
    starting = _replay(
        [TracedFault(30.3, "crash", 0), TracedFault(31.0, "crash", 0)], strike_starting=False
    )
    assert starting.rungs == {"peer": 4} and starting.ettr == pytest.approx(0.976)
    assert unit.ettr < starting.ettr


def test_start_factors_spread_a_replayed_trace_and_the_poisson_draws_are_unchanged() -> None:
    trace = [TracedFault(30.3, "crash", 0), TracedFault(55.5, "rack", 0)]
    spread = _replay(trace, start_factors=(0.5, 1.5))
    # each start of 4 s is 2 s or 6 s: the restart's stall moves by +-2 s; the heal's debt by
    # +-1 s (and the save of step 50 with it): ETTR between 0.899 - 0.03 and 0.899 + 0.03
    assert all(0.869 - 1e-9 <= x <= 0.929 + 1e-9 for x in spread.replications)
    assert len(set(spread.replications)) > 1
    a = simulate(_two_replicas(), NO_MEMORY, EVERY, failures=200, replications=4, seed=3)
    b = simulate(_two_replicas(), NO_MEMORY, EVERY, failures=200, replications=4, seed=3,
                 schedule=None)  # fmt: skip
    assert a == b and a.failures > 100


def test_a_schedule_needs_its_horizon_and_known_kinds() -> None:
    with pytest.raises(ConfigError, match="horizon_s"):
        simulate(_two_replicas(), NO_MEMORY, EVERY, schedule=[TracedFault(1.0, "crash")])
    with pytest.raises(ConfigError, match="kind"):
        TracedFault(1.0, "kill")
    with pytest.raises(ConfigError, match="t_s"):
        TracedFault(-1.0, "crash")


def test_a_fault_on_a_whole_job_stays_a_peer_loss_when_the_model_heals_longer() -> None:
    """The run had every member again at 33 s, the model heals rank 0 until 34.4 s: a fault
    the run took with every member strikes the rank the model holds as starting (another
    heal), not the model's last live holder (a rollback)."""
    whole = _replay([TracedFault(30.3, "crash", 0), TracedFault(33.0, "crash", whole=True)])
    assert whole.rungs == {"peer": 8}
    short = _replay([TracedFault(30.3, "crash", 0), TracedFault(33.0, "crash", whole=False)])
    assert short.rungs == {"peer": 4, "remote": 4}
