"""The Poisson chaos schedule: seeded arrival times, the job's clock and who takes a fault.

``KillSchedule.poisson`` is what ``bench/plan_validate.py`` runs ``stalwart run`` jobs under;
the members here are :class:`TimedFaults` objects of one process sharing a real clock folder
(the claims are real exclusive files), so nothing is killed.
"""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path

import pytest

from stalwart.errors import ConfigError
from stalwart.testing import KillSchedule
from stalwart.testing.poisson import Timed, TimedFaults, draw, read_claims, read_origin


def test_arrivals_are_seeded_poisson_with_common_random_numbers() -> None:
    rate, horizon = 2.0, 5000.0
    faults = draw(rate, seed=7, horizon_s=horizon, kinds=("kill", "stop", "all"),
                  weights=(2, 1, 1))  # fmt: skip
    assert faults == draw(rate, seed=7, horizon_s=horizon, kinds=("kill", "stop", "all"),
                          weights=(2, 1, 1))  # fmt: skip
    n = len(faults)
    assert abs(n - rate * horizon) < 5 * math.sqrt(rate * horizon)  # Poisson count, 5 sigma
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(faults)]
    assert abs(sum(gaps) / len(gaps) - 1 / rate) < 5 / rate / math.sqrt(len(gaps))
    kills = sum(f.kind == "kill" for f in faults)
    assert abs(kills / n - 0.5) < 5 * math.sqrt(0.25 / n)  # weights 2:1:1
    assert all(0 <= f.at_s < horizon for f in faults)
    # the same seed at twice the rate: the same arrivals, at half the times
    slow = draw(1.0, seed=3, horizon_s=100.0)
    fast = draw(2.0, seed=3, horizon_s=50.0)
    assert len(slow) == len(fast) and all(
        math.isclose(s.at_s, 2 * f.at_s, abs_tol=1e-5) for s, f in zip(slow, fast, strict=True)
    )


def test_schedule_travels_in_the_environment(tmp_path: Path) -> None:
    schedule = KillSchedule.poisson(0.5, seed=1, horizon_s=60.0, clock=str(tmp_path),
                                    members=3, kinds=("kill", "all"))  # fmt: skip
    assert schedule.timed and schedule.clock == str(tmp_path) and schedule.members == 3
    assert len({f.rank(3) for f in schedule.timed}) == 3  # slots drawn uniformly
    assert KillSchedule.from_env(schedule.to_env()) == schedule


@pytest.mark.parametrize(
    "bad",
    [
        {"rate_per_s": 0.0},
        {"kinds": ("explode",)},
        {"kinds": ("kill", "stop"), "weights": (1.0,)},
    ],
)
def test_bad_schedules_are_refused(bad: dict[str, object]) -> None:
    args: dict[str, object] = {"rate_per_s": 1.0, "seed": 0, "horizon_s": 10.0, **bad}
    with pytest.raises(ConfigError):
        draw(**args)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        Timed(-1.0)


def test_the_struck_rank_dies_every_member_dies_of_an_all(tmp_path: Path) -> None:
    faults = (Timed(0.0, "stop", slot=0.6), Timed(0.0, "kill", slot=0.9), Timed(0.0, "all"))
    first, second = TimedFaults(faults, tmp_path, 2), TimedFaults(faults, tmp_path, 2)
    assert [f.rank(2) for f in faults[:2]] == [1, 1]
    assert read_origin(tmp_path) is None  # the clock starts at the first boundary
    assert first.take(rank=0, size=2, epoch=4) == "KILL"  # the hang and the kill strike rank 1,
    origin = read_origin(tmp_path)  # the all everyone
    assert origin is not None and first.origin == origin
    assert second.take(rank=1, size=2, epoch=4) == "STOP"  # the struck rank: it hangs first
    assert second.take(rank=1, size=2, epoch=4) == "KILL" and second.origin == origin
    assert [(c["kind"], c["rank"], c["epoch"]) for c in read_claims(tmp_path)] == [
        ("stop", 1, 4),
        ("kill", 1, 4),
        ("all", 0, 4),
    ]
    # a process that was never in the struck epoch (a replacement) passes the faults ...
    assert TimedFaults(faults, tmp_path, 2).take(rank=1, size=2, epoch=5) is None
    # ... a member of it whose step failed meanwhile takes them as the rank it had there
    kill = (Timed(0.0, "kill", slot=0.9),)
    struck, other = TimedFaults(kill, tmp_path / "e", 2), TimedFaults(kill, tmp_path / "e", 2)
    struck.ranks[4] = 1  # it was rank 1 of epoch 4 at an earlier boundary
    assert other.take(rank=0, size=2, epoch=4) is None  # rank 0 records the kill of rank 1 ...
    assert struck.take(rank=0, size=1, epoch=5) == "KILL"  # ... who dies although rank 0 now
    # a job short of a member: the rank past the live ones is the missing one; nobody dies
    alone = TimedFaults((Timed(0.0, "kill", slot=0.9),), tmp_path / "short", 2)
    assert alone.take(rank=0, size=1, epoch=1) is None
    late = TimedFaults(faults, tmp_path, 2, born=time.time())  # started after the faults: they
    assert late.take(rank=1, size=2, epoch=4) is None and late.pending == []  # hit others
