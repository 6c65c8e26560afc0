"""Per-member step-time statistics, and the rule that calls a member a straggler.

A member's *own time* in a step is the time from the step boundary to the moment it enters
the gradient all-reduce: its forward, backward and anything the script does in between (a
delay before the collective counts too). The whole step time (``dt``) is nearly the same on
every member, since the all-reduce waits for the slowest; the own time is what differs.

Every ``window`` committed steps a member closes a window (:class:`StepStats`) with the median
and 90th percentile of both, writes it to its event file (``step-stats``) and publishes it on
the coordinator (``coord/stats/{wid}``, one store write per window). The launcher
(:class:`StragglerWatch`) compares each member's latest own-time median with the median of the
other members' medians; a member above ``factor`` times that (and at least
``min_excess_s`` above it, so that sub-millisecond noise is never a straggler) in
``persist`` consecutive windows is reported once as a straggler.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

__all__ = ["StepStats", "StragglerWatch", "percentile"]


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest-rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


class StepStats:
    """A member's step times, summarised every ``window`` committed steps.

    Args:
        window: committed steps per window (0: keep no statistics).
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self._own: list[float] = []
        self._dt: list[float] = []

    def add(self, own_s: float, dt_s: float, step: int) -> dict[str, Any] | None:
        """Record one committed step; returns the window's summary when it is complete."""
        if self.window <= 0:
            return None
        self._own.append(own_s)
        self._dt.append(dt_s)
        if len(self._own) < self.window:
            return None
        out = {
            "step": step,
            "window": self.window,
            "own_median": statistics.median(self._own),
            "own_p90": percentile(self._own, 0.9),
            "step_median": statistics.median(self._dt),
            "step_p90": percentile(self._dt, 0.9),
        }
        self._own.clear()
        self._dt.clear()
        return out


class StragglerWatch:
    """The launcher's straggler rule (see the module docstring).

    Args:
        factor: how many times slower than the others' median a straggler is (<= 1: off).
        persist: consecutive windows above it before the member is reported.
        min_excess_s: the least absolute excess over the others' median that counts.
    """

    def __init__(self, factor: float, persist: int = 3, min_excess_s: float = 0.005) -> None:
        self.factor, self.persist, self.min_excess_s = factor, persist, min_excess_s
        self._latest: dict[int, dict[str, Any]] = {}
        self._strikes: dict[int, int] = {}
        self.reported: dict[int, dict[str, Any]] = {}

    def update(self, windows: Mapping[int, dict[str, Any]]) -> list[dict[str, Any]]:
        """Feed the members' latest windows; returns the stragglers newly reported now.

        Only a member's *new* window (a later ``step``) counts towards its persistence.
        """
        fresh = [w for w, s in windows.items() if self._latest.get(w, {}).get("step") != s["step"]]
        self._latest = {w: dict(s) for w, s in windows.items()}
        out = []
        for wid in fresh:
            others = [s["own_median"] for w, s in self._latest.items() if w != wid]
            if self.factor <= 1 or not others:
                continue
            mine, typical = self._latest[wid]["own_median"], statistics.median(others)
            slow = mine > self.factor * typical and mine - typical >= self.min_excess_s
            self._strikes[wid] = self._strikes.get(wid, 0) + 1 if slow else 0
            if self._strikes[wid] >= self.persist and wid not in self.reported:
                report = {"wid": wid, "own_median": mine, "others_median": typical,
                          "ratio": mine / typical if typical > 0 else float("inf"),
                          "step": self._latest[wid]["step"]}  # fmt: skip
                self.reported[wid] = report
                out.append(report)
        return out
