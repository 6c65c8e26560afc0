"""Wall time against training progress between two failures, in closed form.

A :class:`Segment` starts when training resumes: at wall time ``w0`` with ``p0`` steps of
progress kept. From there progress grows one step per ``step_s`` seconds, except that each
snapshot tier pauses training for ``pause_s`` whenever progress reaches one of its grid points
``anchor + j * every`` (whole steps); the snapshot then commits ``lag_s`` after the pause (its
background write). Tiers whose grid points coincide pause one after the other, in ladder order.
Nothing here draws a random number: the simulation asks where a segment stands at the wall
time of its next event, so periodic snapshots cost no events of their own.

All searches are over whole steps (bisection): O(log steps x tiers) per question.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Clock", "Segment", "Snapshot"]


@dataclass(frozen=True)
class Clock:
    """One tier's snapshot schedule: grid ``anchor + j * every`` (steps), its pause and lag."""

    name: str
    anchor: int
    every: int
    pause_s: float
    lag_s: float

    def on_grid(self, k: int) -> bool:
        return (k - self.anchor) % self.every == 0


@dataclass(frozen=True)
class Snapshot:
    """A snapshot taken at ``progress`` steps: it stopped training at ``start`` and commits at
    ``commit`` (wall seconds)."""

    progress: float
    start: float
    commit: float


class Segment:
    """Training from (``w0``, ``p0``) on, paced by ``step_s`` and the tiers' ``clocks``."""

    def __init__(self, w0: float, p0: float, step_s: float, clocks: tuple[Clock, ...]) -> None:
        self.w0, self.p0, self.step_s, self.clocks = w0, p0, step_s, clocks

    def _points(self, clock: Clock, upto: float) -> int:
        """Grid points of ``clock`` in (p0, upto]."""
        if upto <= self.p0:
            return 0
        return math.floor((upto - clock.anchor) / clock.every) - math.floor(
            (self.p0 - clock.anchor) / clock.every
        )

    def arrive(self, k: int) -> float:
        """Wall time at which progress reaches whole step ``k`` (> p0), before its pauses."""
        paused = sum(c.pause_s * self._points(c, k - 1) for c in self.clocks)
        return self.w0 + (k - self.p0) * self.step_s + paused

    def _pause_at(self, k: int) -> float:
        return sum(c.pause_s for c in self.clocks if c.on_grid(k))

    def _last_reached(self, t: float) -> int | None:
        """The largest whole step > p0 that progress has reached by wall time ``t``."""
        lo = math.floor(self.p0) + 1
        if t < self.w0 or self.arrive(lo) > t:
            return None
        hi = lo + max(1, math.ceil((t - self.w0) / self.step_s) + 1)
        while self.arrive(hi) <= t:  # the bound is loose only by float rounding
            hi *= 2
        while hi - lo > 1:  # invariant: arrive(lo) <= t < arrive(hi)
            mid = (lo + hi) // 2
            if self.arrive(mid) <= t:
                lo = mid
            else:
                hi = mid
        return lo

    def progress(self, t: float) -> float:
        """Steps of progress at wall time ``t`` (``p0`` before ``w0``: still recovering)."""
        if t <= self.w0:
            return self.p0
        k = self._last_reached(t)
        if k is None:
            return self.p0 + (t - self.w0) / self.step_s
        leave = self.arrive(k) + self._pause_at(k)
        return float(k) if t < leave else k + (t - leave) / self.step_s

    def snapshot(self, clock: Clock, x: int) -> Snapshot:
        """The snapshot of ``clock`` at grid point ``x`` (> p0)."""
        start = self.arrive(x)
        for c in self.clocks:
            if c is clock:
                break
            if c.on_grid(x):
                start += c.pause_s
        return Snapshot(float(x), start, start + clock.pause_s + clock.lag_s)

    def _grid(self, clock: Clock, t: float, at_most: float) -> tuple[int, int]:
        """Indices j of the grid points in (p0, min(progress(t), at_most)]."""
        j_lo = math.floor((self.p0 - clock.anchor) / clock.every) + 1
        reached = min(self.progress(t), at_most)
        return j_lo, math.floor((reached - clock.anchor) / clock.every)

    def newest_commit(self, clock: Clock, t: float, at_most: float = math.inf) -> Snapshot | None:
        """The newest snapshot of ``clock`` in this segment committed by ``t``, at progress
        <= ``at_most``."""
        j_lo, j_hi = self._grid(clock, t, at_most)
        at = clock.anchor
        if j_hi < j_lo or self.snapshot(clock, at + j_lo * clock.every).commit > t:
            return None
        while j_hi > j_lo:  # commit times grow with j; find the last one <= t
            mid = (j_lo + j_hi + 1) // 2
            if self.snapshot(clock, at + mid * clock.every).commit <= t:
                j_lo = mid
            else:
                j_hi = mid - 1
        return self.snapshot(clock, at + j_lo * clock.every)

    def newest_started(self, clock: Clock, t: float) -> Snapshot | None:
        """The newest snapshot of ``clock`` in this segment whose pause began by ``t``."""
        j_lo, j_hi = self._grid(clock, t, math.inf)
        for j in (j_hi, j_hi - 1):
            if j >= j_lo:
                snap = self.snapshot(clock, clock.anchor + j * clock.every)
                if snap.start <= t:
                    return snap
        return None

    def pause_s(self, upto: float) -> float:
        """Seconds of snapshot pauses in (p0, upto]."""
        return sum(c.pause_s * self._points(c, upto) for c in self.clocks)
