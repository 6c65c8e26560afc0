"""Seeded fault schedules for elastic jobs: SIGKILL or SIGSTOP a worker at an exact point.

A schedule travels to the workers in one environment variable (``STALWART_CHAOS``, JSON), and
each worker script calls :func:`install` on its job. The job announces points of its step to
listeners (``step-begin``: the step boundary; ``collective-enter``: about to enter the
gradient all-reduce); a worker scheduled to die there kills itself with SIGKILL, which is what
the other members see of a crashed host; with ``signal="STOP"`` it freezes instead (a hung
host; the launcher kills it once it is taken for hung). ``delay_s`` > 0 on a ``collective``
kill fires from a timer thread that many seconds after entry, i.e. while the all-reduce is in
flight.

Kills name the *original* worker id; a replacement gets a fresh id and is not killed again.

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
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from stalwart.errors import ConfigError

__all__ = ["ENV_CHAOS", "Kill", "KillSchedule", "install"]

ENV_CHAOS = "STALWART_CHAOS"
# The worker id ``stalwart run`` gives each process (stalwart.elastic.protocol.ENV_WORKER;
# spelled out here because testing sits below elastic in the layering).
_ENV_WORKER = "STALWART_ELASTIC_WORKER"
_WHERE = ("boundary", "collective")
_SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}


class _Announcer(Protocol):
    def add_listener(self, fn: Any) -> None: ...


@dataclass(frozen=True)
class Kill:
    """Send SIGKILL (or SIGSTOP) to worker ``worker`` at ``step`` (committed steps so far).

    Attributes:
        worker: the worker id to kill.
        step: the step at which it dies.
        where: ``boundary`` (start of the step) or ``collective`` (entering the all-reduce).
        delay_s: for ``collective``: seconds after entry, from a timer thread.
        signal: ``KILL`` (a crash) or ``STOP`` (a hang).
    """

    worker: int
    step: int
    where: str = "boundary"
    delay_s: float = 0.0
    signal: str = "KILL"

    def __post_init__(self) -> None:
        if self.where not in _WHERE or self.delay_s < 0 or self.step < 0:
            raise ConfigError(f"{self}: where must be one of {_WHERE}, step >= 0 and delay_s >= 0")
        if self.signal not in _SIGNALS:
            raise ConfigError(f"{self}: signal must be one of {sorted(_SIGNALS)}")


@dataclass(frozen=True)
class KillSchedule:
    """A list of kills, reproducible from a seed."""

    kills: tuple[Kill, ...] = ()

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

    def to_env(self) -> dict[str, str]:
        """The environment variable that carries this schedule to the workers."""
        return {ENV_CHAOS: json.dumps([asdict(k) for k in self.kills])}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KillSchedule:
        """The schedule in ``environ`` (default ``os.environ``); empty when there is none."""
        raw = (os.environ if environ is None else environ).get(ENV_CHAOS)
        return cls(tuple(Kill(**k) for k in json.loads(raw))) if raw else cls()


def _die(sig: str, delay_s: float = 0.0) -> None:
    signum = _SIGNALS[sig]
    if delay_s <= 0:
        os.kill(os.getpid(), signum)
        return
    timer = threading.Timer(delay_s, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()


def install(
    job: _Announcer, schedule: KillSchedule | None = None, worker: int | None = None
) -> None:
    """Make ``job`` (a :class:`stalwart.elastic.Job`) die as ``schedule`` says for ``worker``.

    Args:
        job: anything with ``add_listener(fn(event, step))``.
        schedule: default: :meth:`KillSchedule.from_env`.
        worker: this process's worker id; default: from the environment (no kills without one).
    """
    schedule = schedule if schedule is not None else KillSchedule.from_env()
    if worker is None:
        raw = os.environ.get(_ENV_WORKER)
        worker = int(raw) if raw else None
    mine = [k for k in schedule.kills if k.worker == worker]
    if not mine:
        return

    def listener(event: str, step: int) -> None:
        for k in mine:
            if k.step != step:
                continue
            if k.where == "boundary" and event == "step-begin":
                _die(k.signal)
            elif k.where == "collective" and event == "collective-enter":
                _die(k.signal, k.delay_s)

    job.add_listener(listener)
