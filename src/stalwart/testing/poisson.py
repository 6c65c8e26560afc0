"""Faults at Poisson times of a job's clock: a member killed, a member hung, every member lost.

:func:`draw` makes the times: a Poisson process of ``rate_per_s`` (exponential gaps, seeded),
each event's kind drawn from ``kinds`` with ``weights``. The same seed gives the same unit
arrivals whatever the rate (gaps are a unit exponential divided by the rate), so runs at
different rates or checkpoint intervals can share their failure times (common random numbers).

A :class:`Timed` fault names a time on the job's clock and a slot, not a worker or a step,
because the processes that hold a job change as it fails. The clock starts when the first
member of the job reaches a step boundary: that process links ``<clock>/origin`` (holding the
wall time) into place, atomically; every other process reads it. :class:`TimedFaults` takes a
fault at each process's first step boundary at or after its time:

* ``kill`` / ``stop``: the fault strikes rank ``floor(slot x members)`` of a job of
  ``members`` ranks, uniformly drawn. The member of that rank sends itself SIGKILL (a crash)
  or SIGSTOP (a hang: the launcher finds it silent and replaces it); the others pass. While
  the job is short of members (a replacement still starting), a rank past the live ones
  strikes the missing member: nobody dies (the process being started is not hit).
* ``all``: every member dies (SIGKILL) at its boundary: no live process holds the state, and
  the job resumes from its durable tier (``Job(checkpoint=...)``).

The first process to take a fault records it, atomically, in ``<clock>/fault-<i>``
(``{"t": wall time, "kind", "rank", "size", "epoch"}``): the fault strikes the members of that
epoch (the struck rank as it was in that epoch), wherever they are when they reach it (a member
whose step failed has reconfigured since); a process that never was in that epoch (a
replacement that joined later) passes it, so a fault never strikes twice. An ``all`` is no
exception: a replacement that joined the next epoch (holding the state) before reaching a
boundary of it passes the ``all`` recorded in the epoch before, and the job trains on from it
as after a crash (``bench/plan_validate.py`` replays such a fault as one).

Faults strike running processes only, never one still starting: a process ignores the faults
timed before its first step boundary that no member has taken yet (a member of its own epoch
may have taken one a moment before; that record stands). So a fault due while no member is at
a boundary (every process of the job restarting) strikes nobody and is never recorded, as a
fault on the member still starting during a heal strikes nobody. A process also ignores faults
timed before it started (its start read from ``/proc`` on Linux). The records are what the
bench reads of the run. The folder must be shared by the workers (one host, or a shared
filesystem).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from stalwart.errors import ConfigError

__all__ = [
    "TIMED_KINDS",
    "Timed",
    "TimedFaults",
    "draw",
    "for_job",
    "read_claims",
    "read_origin",
]

TIMED_KINDS = ("kill", "stop", "all")
_SIGNAL = {"kill": "KILL", "stop": "STOP", "all": "KILL"}


@dataclass(frozen=True)
class Timed:
    """A fault ``at_s`` seconds after the job's clock started (module docstring).

    Attributes:
        at_s: seconds on the job's clock.
        kind: ``kill`` (one member crashes), ``stop`` (one member hangs) or ``all`` (every
            member dies at once).
        slot: in [0, 1): which rank a ``kill`` or ``stop`` strikes (:meth:`rank`).
    """

    at_s: float
    kind: str = "kill"
    slot: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in TIMED_KINDS or not self.at_s >= 0 or not 0 <= self.slot < 1:
            raise ConfigError(
                f"{self}: kind must be one of {TIMED_KINDS}, at_s >= 0 and 0 <= slot < 1"
            )

    def rank(self, members: int) -> int:
        """The rank this fault strikes in a job of ``members`` ranks."""
        return min(int(self.slot * members), members - 1)


def draw(
    rate_per_s: float,
    *,
    seed: int,
    horizon_s: float,
    kinds: Sequence[str] = ("kill",),
    weights: Sequence[float] | None = None,
) -> tuple[Timed, ...]:
    """Poisson arrivals of ``rate_per_s`` in [0, ``horizon_s``), each of a kind drawn from
    ``kinds`` (``weights``: their shares; default equal).

    Raises:
        ConfigError: a rate or horizon not positive, an unknown kind, weights that do not match.
    """
    if not rate_per_s > 0 or not horizon_s > 0:
        raise ConfigError(f"poisson: rate_per_s ({rate_per_s}) and horizon_s must be > 0")
    if not kinds or not set(kinds) <= set(TIMED_KINDS):
        raise ConfigError(f"poisson: kinds {list(kinds)} must be taken from {TIMED_KINDS}")
    if weights is not None and (len(weights) != len(kinds) or min(weights) < 0 or not sum(weights)):
        raise ConfigError(f"poisson: weights {list(weights)} must be one share >= 0 per kind")
    rng = random.Random(seed)
    out: list[Timed] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0) / rate_per_s  # a unit arrival, scaled: common random numbers
        kind, slot = rng.choices(list(kinds), weights)[0], rng.random()
        if t >= horizon_s:
            return tuple(out)
        out.append(Timed(round(t, 6), kind, slot))


def read_origin(clock: str | Path) -> float | None:
    """The wall time the job's clock started at, or None before any member reached a boundary."""
    path = Path(clock) / "origin"
    try:
        return float(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def read_claims(clock: str | Path) -> list[dict[str, object]]:
    """The faults taken so far, by index: ``{"index", "t", "kind", "rank", "size"}`` each."""
    out = []
    for path in sorted(Path(clock).glob("fault-*"), key=lambda p: int(p.name[6:])):
        try:
            out.append({"index": int(path.name[6:]), **json.loads(path.read_text())})
        except ValueError:  # a claim being written this instant
            continue
    return out


def _process_start() -> float:
    """This process's start, wall time (Linux: from /proc, to a clock tick; elsewhere: now)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


@runtime_checkable
class Ranked(Protocol):
    """What a timed fault reads of the job at each step boundary (a ``stalwart.elastic.Job``)."""

    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def epoch(self) -> int: ...


class TimedFaults:
    """One process's view of a timed schedule: :meth:`take` at each step boundary.

    Args:
        faults: the schedule (:func:`draw`).
        clock: the folder that holds the job's clock and the claims (module docstring).
        members: ranks of the whole job (a fault's slot picks one of them).
        born: when this process started, wall time (default: from ``/proc`` on Linux, else
            now); faults timed before it are ignored.
    """

    def __init__(self, faults: Sequence[Timed], clock: str | Path, members: int,
                 born: float | None = None) -> None:  # fmt: skip
        if members < 1:
            raise ConfigError(f"TimedFaults(members={members}): the job's ranks, >= 1")
        self.members = members
        self.clock = Path(clock)
        self.clock.mkdir(parents=True, exist_ok=True)
        self.pending = list(enumerate(faults))
        self.born = _process_start() if born is None else born
        self.origin: float | None = None
        self.job: Ranked | None = None
        self.ranks: dict[int, int] = {}  # this process's rank in each epoch it was in

    def _start_clock(self) -> float:
        if self.origin is None:
            tmp = self.clock / f".origin-{os.getpid()}"
            first = time.time()  # this process's first step boundary: it runs from here on
            tmp.write_text(repr(first))
            try:
                os.link(tmp, self.clock / "origin")  # atomic: the first member's time wins
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
            self.origin = read_origin(self.clock)
            assert self.origin is not None  # linked above, by this process or another
            self.pending = [
                (i, f)
                for i, f in self.pending
                if self.origin + f.at_s >= max(self.born, first)
                or (self.origin + f.at_s >= self.born and (self.clock / f"fault-{i}").exists())
            ]
        return self.origin

    def at_boundary(self) -> str | None:
        """:meth:`take` for the job this schedule was made for (:func:`for_job`)."""
        assert self.job is not None, "made without a job: call take(rank, size)"
        return self.take(self.job.rank, self.job.size, self.job.epoch)

    def take(self, rank: int, size: int, epoch: int) -> str | None:
        """At a step boundary, as rank ``rank`` of the ``size`` members of ``epoch``: the
        signal this process must send itself (``KILL``, ``STOP``), or None; every fault due
        is passed once."""
        origin = self._start_clock()
        now = time.time() - origin
        self.ranks.setdefault(epoch, rank if rank < size else -1)
        while self.pending and self.pending[0][1].at_s <= now:
            index, fault = self.pending.pop(0)
            record = {"t": time.time(), "kind": fault.kind, "rank": fault.rank(self.members),
                      "size": size, "epoch": epoch}  # fmt: skip
            taken = self._record(index, record)
            if taken["epoch"] not in self.ranks:
                continue  # it struck an epoch this process was never in
            if fault.kind == "all" or taken["rank"] == self.ranks[taken["epoch"]]:
                return _SIGNAL[fault.kind]
        return None

    def _record(self, index: int, record: dict[str, Any]) -> dict[str, Any]:
        """Record fault ``index`` unless a member did first; the record that stands."""
        path, tmp = self.clock / f"fault-{index}", self.clock / f".fault-{index}-{os.getpid()}"
        tmp.write_text(json.dumps(record))
        try:
            os.link(tmp, path)  # atomic: the first record wins, and is whole when seen
        except FileExistsError:
            record = json.loads(path.read_text())
        finally:
            tmp.unlink()
        return record


def for_job(job: Any, faults: Sequence[Timed], clock: str | None, members: int
            ) -> TimedFaults | None:  # fmt: skip
    """The timed faults of ``job`` (None without a clock folder).

    Raises:
        ConfigError: faults without a clock folder, or a job without ``rank`` and ``size``.
    """
    if faults and not clock:
        raise ConfigError("timed faults need a clock folder: KillSchedule(timed=..., clock=...)")
    if not clock:
        return None
    if not isinstance(job, Ranked):
        raise ConfigError(f"timed faults read the job's rank and size: {job!r} has neither")
    timed = TimedFaults(faults, clock, members)
    timed.job = job
    return timed
