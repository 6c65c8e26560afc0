"""Seeded fault schedules for elastic jobs: kill, freeze, raise in or slow down a worker.

A schedule travels to the workers in one environment variable (``STALWART_CHAOS``, JSON), and
each worker script calls :func:`install` on its job. The job announces points of its step to
listeners (``step-begin``: the step boundary; ``collective-enter``: about to enter the
gradient all-reduce; ``group-agree``: with replica groups, the replicate all-reduce done, before
the group's ranks agree to apply the step); a worker scheduled to die there kills itself with
SIGKILL, which is what the other members see of a crashed host; with ``signal="STOP"`` it
freezes instead (a hung host; the launcher kills it once it is taken for hung). ``delay_s``
> 0 on a ``collective`` kill fires from a timer thread that many seconds after entry, i.e.
while the all-reduce is in flight.

Two more kinds of fault, in user space (``tc netem`` is not available on these machines):

* :class:`Raise`: the worker raises :class:`InjectedFault` at a step point, as a bug in the
  training step would. The exception is not caught: the process dies (exit code 1), its
  peers' all-reduce fails on the closed sockets and they discard the step, and the launcher
  replaces it. Continuing in the raising process is not offered: after an exception in the
  middle of a step its state is unknown, and a fresh process healed from a live member is
  the path whose result is verified by digest.
* :class:`Delay`: the worker sleeps ``delay_s`` before entering the all-reduce at every step
  of a range: a slow link or a slow host, which the launcher reports as a straggler.

Two faults of the job's plumbing:

* :class:`LoseCoordinator`: at a step boundary the worker sends SIGUSR1 to its parent, the
  ``stalwart run`` launcher, which drops the coordinator's store and re-hosts it on a new port
  (see :mod:`stalwart.elastic.launcher`): every worker's store connection breaks under it.
* :class:`Drop`: the worker never enters the all-reduce of a step (it blocks forever, its
  heartbeats still going): a collective that never completes. The others' all-reduce times
  out after the epoch's gloo timeout, they discard the step, the member that never arrives at
  the next epoch is taken for hung and replaced.

:meth:`KillSchedule.mixed` draws a seeded mix of kill, stop, raise and delay;
:meth:`KillSchedule.poisson` draws kills, hangs and losses of every member at Poisson times of
the job's clock (:mod:`stalwart.testing.poisson`).

Silent data corruption: :class:`BitFlip` (:mod:`stalwart.testing.bitflip`) flips one bit
of one element of the worker's state right after it commits a step, once per process.

Faults name the *original* worker id; a replacement gets a fresh id and is not hit again.

    schedule = KillSchedule((Kill(worker=1, step=7, where="collective", delay_s=0.002),))
    subprocess.run([...], env={**os.environ, **schedule.to_env()})
    # in the worker script:
    chaos.install(job)
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from stalwart.errors import ConfigError, StalwartError
from stalwart.testing.bitflip import BitFlip, GradFlip, flip_grad, flip_in_state
from stalwart.testing.poisson import Timed, draw, for_job

__all__ = [
    "ENV_CHAOS",
    "BitFlip",
    "Delay",
    "Drop",
    "GradFlip",
    "InjectedFault",
    "Kill",
    "KillSchedule",
    "LoseCoordinator",
    "Raise",
    "Timed",
    "install",
]

ENV_CHAOS = "STALWART_CHAOS"
# The worker id ``stalwart run`` gives each process (stalwart.elastic.protocol.ENV_WORKER;
# spelled out here because testing sits below elastic in the layering).
_ENV_WORKER = "STALWART_ELASTIC_WORKER"
_WHERE = ("boundary", "collective")  # the points seeded schedules draw from
_POINTS = (*_WHERE, "agree")  # every point a fault may name ("agree": replica groups only)
_EVENTS = {"step-begin": "boundary", "collective-enter": "collective", "group-agree": "agree"}
_SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}


class InjectedFault(StalwartError, RuntimeError):
    """The exception a :class:`Raise` fault raises inside a worker's step."""


class _Announcer(Protocol):
    def add_listener(self, fn: Any) -> None: ...


@dataclass(frozen=True)
class Kill:
    """Send SIGKILL (or SIGSTOP) to worker ``worker`` at ``step`` (committed steps so far).

    Attributes:
        worker: the worker id to kill.
        step: the step at which it dies.
        where: ``boundary`` (start of the step), ``collective`` (entering the all-reduce) or
            ``agree`` (replica groups: the replicate all-reduce done, before the group agrees).
        delay_s: for ``collective``: seconds after entry, from a timer thread.
        signal: ``KILL`` (a crash) or ``STOP`` (a hang).
    """

    worker: int
    step: int
    where: str = "boundary"
    delay_s: float = 0.0
    signal: str = "KILL"

    def __post_init__(self) -> None:
        if self.where not in _POINTS or self.delay_s < 0 or self.step < 0:
            raise ConfigError(f"{self}: where must be one of {_POINTS}, step >= 0 and delay_s >= 0")
        if self.signal not in _SIGNALS:
            raise ConfigError(f"{self}: signal must be one of {sorted(_SIGNALS)}")


@dataclass(frozen=True)
class Raise:
    """Raise :class:`InjectedFault` in worker ``worker`` at ``step``.

    Attributes:
        worker: the worker id.
        step: the step (committed steps so far).
        where: ``boundary`` (in ``zero_grad()``) or ``collective`` (in ``step()``, before the
            all-reduce).
    """

    worker: int
    step: int
    where: str = "collective"

    def __post_init__(self) -> None:
        if self.where not in _WHERE or self.step < 0:
            raise ConfigError(f"{self}: where must be one of {_WHERE} and step >= 0")


@dataclass(frozen=True)
class Delay:
    """Make worker ``worker`` sleep ``delay_s`` before each all-reduce of steps [start, stop).

    Attributes:
        worker: the worker id.
        delay_s: seconds slept before entering the all-reduce.
        start: the first delayed step.
        stop: the first step no longer delayed (None: to the end).
    """

    worker: int
    delay_s: float
    start: int = 0
    stop: int | None = None

    def __post_init__(self) -> None:
        if self.delay_s < 0 or self.start < 0 or (self.stop is not None and self.stop < self.start):
            raise ConfigError(f"{self}: need delay_s >= 0 and 0 <= start <= stop")

    def covers(self, step: int) -> bool:
        """True when ``step`` is delayed."""
        return self.start <= step and (self.stop is None or step < self.stop)


@dataclass(frozen=True)
class LoseCoordinator:
    """Worker ``worker`` makes the launcher re-host the coordinator at ``step`` (SIGUSR1).

    Attributes:
        step: the step boundary at which the store is lost.
        worker: the worker that asks (any live one; its parent must be the launcher).
    """

    step: int
    worker: int = 0


@dataclass(frozen=True)
class Drop:
    """Worker ``worker`` never enters the all-reduce of ``step``: it blocks there for good.

    Attributes:
        worker: the worker id.
        step: the step whose collective it drops.
    """

    worker: int
    step: int


_KINDS = ("kill", "stop", "raise", "delay")


@dataclass(frozen=True)
class KillSchedule:
    """Kills, hangs, raised exceptions and delays, reproducible from a seed."""

    kills: tuple[Kill, ...] = ()
    raises: tuple[Raise, ...] = ()
    delays: tuple[Delay, ...] = ()
    coordinator_losses: tuple[LoseCoordinator, ...] = ()
    drops: tuple[Drop, ...] = ()
    flips: tuple[BitFlip, ...] = ()
    grad_flips: tuple[GradFlip, ...] = ()
    timed: tuple[Timed, ...] = ()
    clock: str | None = None
    """The folder of the job's clock and records, for ``timed`` faults (shared by the workers)."""
    members: int = 1
    """Ranks of the whole job, for ``timed`` faults (a fault's slot picks one)."""

    @classmethod
    def poisson(cls, rate_per_s: float, *, seed: int, horizon_s: float, clock: str,
                members: int, kinds: tuple[str, ...] = ("kill",),
                weights: tuple[float, ...] | None = None) -> KillSchedule:  # fmt: skip
        """Faults at Poisson times of the job's clock (:func:`stalwart.testing.poisson.draw`):
        ``kill`` and ``stop`` strike one of ``members`` ranks, ``all`` every member at once."""
        faults = draw(rate_per_s, seed=seed, horizon_s=horizon_s, kinds=kinds, weights=weights)
        return cls(timed=faults, clock=clock, members=members)

    @classmethod
    def seeded(cls, seed: int, *, workers: int, steps: range, count: int = 1,
               where: str = "collective", max_delay_s: float = 0.003) -> KillSchedule:  # fmt: skip
        """``count`` kills of distinct original workers at steps drawn from ``steps``."""
        rng = random.Random(seed)
        victims = rng.sample(range(workers), count)
        kills = []
        for w in victims:
            delay = rng.uniform(0, max_delay_s) if where == "collective" else 0.0
            kills.append(Kill(w, rng.choice(steps), where, delay))
        return cls(tuple(kills))

    @classmethod
    def mixed(
        cls,
        seed: int,
        *,
        workers: int,
        steps: range,
        count: int = 2,
        kinds: tuple[str, ...] = _KINDS,
        max_delay_s: float = 0.05,
    ) -> KillSchedule:
        """``count`` faults of kinds drawn from ``kinds``, on distinct workers and steps.

        Kills and raises land inside the all-reduce or at the boundary (drawn); a delay
        slows its worker from its step to the end.
        """
        if not set(kinds) <= set(_KINDS) or not kinds or count > min(workers, len(steps)):
            raise ConfigError(f"mixed(kinds={kinds}, count={count}): kinds from {_KINDS}, "
                              "count <= workers and <= len(steps)")  # fmt: skip
        rng = random.Random(seed)
        kills: list[Kill] = []
        raises: list[Raise] = []
        delays: list[Delay] = []
        for w, step in zip(
            rng.sample(range(workers), count), rng.sample(steps, count), strict=True
        ):
            kind, where = rng.choice(kinds), rng.choice(_WHERE)
            if kind in ("kill", "stop"):
                delay = rng.uniform(0, 0.003) if where == "collective" else 0.0
                kills.append(Kill(w, step, where, delay, "KILL" if kind == "kill" else "STOP"))
            elif kind == "raise":
                raises.append(Raise(w, step, where))
            else:
                delays.append(Delay(w, rng.uniform(max_delay_s / 2, max_delay_s), start=step))
        return cls(tuple(kills), tuple(raises), tuple(delays))

    def to_env(self) -> dict[str, str]:
        """The environment variable that carries this schedule to the workers."""
        faults: dict[str, Any] = {
            "kills": self.kills,
            "raises": self.raises,
            "delays": self.delays,
            "coordinator_losses": self.coordinator_losses,
            "drops": self.drops,
            "flips": self.flips,
            "grad_flips": self.grad_flips,
            "timed": self.timed,
        }
        data: dict[str, Any] = {k: [asdict(f) for f in v] for k, v in faults.items()}
        return {ENV_CHAOS: json.dumps({**data, "clock": self.clock, "members": self.members})}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KillSchedule:
        """The schedule in ``environ`` (default ``os.environ``); empty when there is none.

        A plain JSON list is read as a list of kills.
        """
        raw = (os.environ if environ is None else environ).get(ENV_CHAOS)
        data = json.loads(raw) if raw else {}
        if isinstance(data, list):
            data = {"kills": data}
        return cls(
            tuple(Kill(**k) for k in data.get("kills", ())),
            tuple(Raise(**r) for r in data.get("raises", ())),
            tuple(Delay(**d) for d in data.get("delays", ())),
            tuple(LoseCoordinator(**c) for c in data.get("coordinator_losses", ())),
            tuple(Drop(**d) for d in data.get("drops", ())),
            tuple(BitFlip(**f) for f in data.get("flips", ())),
            tuple(GradFlip(**f) for f in data.get("grad_flips", ())),
            tuple(Timed(**f) for f in data.get("timed", ())),
            data.get("clock"),
            int(data.get("members", 1)),
        )


def _die(sig: str, delay_s: float = 0.0) -> None:
    signum = _SIGNALS[sig]
    if delay_s <= 0:
        os.kill(os.getpid(), signum)
        return
    timer = threading.Timer(delay_s, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()


def install(
    job: _Announcer, schedule: KillSchedule | None = None, worker: int | None = None,
    state: Any = None,
) -> None:  # fmt: skip
    """Make ``job`` (a :class:`stalwart.elastic.Job`) fail as ``schedule`` says for ``worker``.

    Args:
        job: anything with ``add_listener(fn(event, step))``.
        schedule: default: :meth:`KillSchedule.from_env`.
        worker: this process's worker id; default: from the environment (no faults without one).
        state: what a :class:`BitFlip` corrupts (default: ``job.state``), right after the
            ``commit`` of its step, once per process.
    """
    schedule = schedule if schedule is not None else KillSchedule.from_env()
    if worker is None:
        raw = os.environ.get(_ENV_WORKER)
        worker = int(raw) if raw else None
    kills = [k for k in schedule.kills if k.worker == worker]
    raises = [r for r in schedule.raises if r.worker == worker]
    delays = [d for d in schedule.delays if d.worker == worker]
    losses = {c.step for c in schedule.coordinator_losses if c.worker == worker}
    drops = {d.step for d in schedule.drops if d.worker == worker}
    flips = [f for f in schedule.flips if f.worker == worker]
    grads = [g for g in schedule.grad_flips if g.worker == worker]
    timed = for_job(job, schedule.timed, schedule.clock, schedule.members)
    if not (kills or raises or delays or losses or drops or flips or grads or timed):
        return
    target = state if state is not None else getattr(job, "state", None)
    if (flips or grads) and target is None:
        raise ConfigError("a BitFlip needs the state to corrupt: chaos.install(job, state=...)")

    def listener(event: str, step: int) -> None:
        if event == "commit":
            for f in [f for f in flips if f.step == step]:
                flips.remove(f)  # once: a rollback recomputes the step without it
                flip_in_state(target, f)
        if event == "collective-enter":
            for g in [g for g in grads if g.step == step]:
                grads.remove(g)  # once: the retried step computes clean
                flip_grad(target, g)
        where = _EVENTS.get(event)
        if where == "boundary" and timed is not None and (sig := timed.at_boundary()):
            _die(sig)
        if where == "collective":
            for d in delays:
                if d.covers(step):
                    time.sleep(d.delay_s)
        for k in kills:
            if k.step == step and k.where == where:
                _die(k.signal, k.delay_s if where == "collective" else 0.0)
        for r in raises:
            if r.step == step and r.where == where:
                raise InjectedFault(f"chaos: worker {worker} raises at step {step} ({where})")
        if where == "boundary" and step in losses:
            losses.discard(step)  # once, even if the step is attempted again
            os.kill(os.getppid(), signal.SIGUSR1)
        if where == "collective" and step in drops:
            threading.Event().wait()  # never returns: the collective is never entered

    job.add_listener(listener)
