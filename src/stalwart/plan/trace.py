"""A measured fault, for replaying a chaos run's trace in the simulation.

``simulate(schedule=[TracedFault(...), ...])`` replays these instead of drawing failures
(``stalwart.plan.simulate``): the faults of one measured run (a time on the job's clock, a kind
and the unit struck, or None for the model to choose), over ``horizon_s``. Every replication
replays the same faults and differs only in its start factors, so their mean is the model's
prediction for that run with *when* the faults fell taken from the run, and their spread is what
the start times alone leave open. ``bench/plan_validate.py`` builds them from each run's events
and scores its chaos runs this way beside the rate-level prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.errors import ConfigError
from stalwart.plan.ladder import Kind

__all__ = ["TracedFault"]


@dataclass(frozen=True)
class TracedFault:
    """One failure of a replayed trace (``simulate(schedule=...)``).

    Attributes:
        t_s: seconds on the job's clock.
        kind: a :class:`~stalwart.plan.ladder.Kind` or its name (``crash``, ``hang``, ``node``,
            ``rack``, ``sdc``).
        unit: the rank, node or rack struck; None: chosen by the model's state at ``t_s``
            (``whole``), since a measured fault names a rank of the run, whose members the
            model need not hold in the same state.
        whole: with ``unit`` None: whether the measured job had every member when struck. True:
            the unit is one the model still holds as starting, if any (its heal ran longer
            than the run's: the fault stays a loss the peers heal), else the first; False (a
            member was missing): the first unit whose processes are running (the fault struck
            a running process, the last live holder when only one runs).
    """

    t_s: float
    kind: Kind | str
    unit: int | None = None
    whole: bool = False

    def __post_init__(self) -> None:
        if self.kind not in {k.value for k in Kind} or not self.t_s >= 0:
            raise ConfigError(f"{self}: kind must be one of {[k.value for k in Kind]}, t_s >= 0")
        if self.unit is not None and self.unit < 0:
            raise ConfigError(f"{self}: unit must be >= 0 or None")
