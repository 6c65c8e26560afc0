"""One timeout the user sets, and every other one derived from it.

``stalwart run --timeout S`` (``Job(timeout_s=S)``; default 10 s) is the only timeout a user
reasons about: *how long a member may stay silent or stuck before the job gives up on it*.
The others follow from it, in an order that is checked (:meth:`Timeouts.check`) so that no
derived timeout fires first for the wrong reason:

    heartbeat period   S / 10            a worker's beat thread adds to coord/beat/{wid}
    hang timeout       S / 2             the launcher kills a worker whose beats stood still
    collective timeout S                 the gloo / NCCL group of an epoch, the store's client,
                                         the arrival at a new epoch
    join timeout       max(30 S, 60 s)   a worker waits this long for an epoch that lists it

* **heartbeat < hang**: five beats per hang timeout, so one late beat (a busy machine, a
  short GC pause) is not a hang.
* **hang < collective**: a frozen member is killed by the launcher (the kernel closes its
  sockets, the survivors' collective fails at once) *before* the survivors' collective times
  out; the collective timeout only bounds a member that is alive and beating but never
  enters the collective (a deadlock in the training script). Were it shorter, every slow but
  healthy collective (a big heal on a busy machine) would be a fault.
* **collective < join**: a worker waiting for an epoch outlives a failed arrival (abandoned
  after the collective timeout), the launcher's reaction and a replacement's start (a fresh
  interpreter importing torch: seconds), with room to spare; the join timeout only ends a
  job whose launcher is gone or that never gets ``--min-size`` members.

``--hang-timeout`` may still be given (0 turns heartbeats off); one that breaks the order
(at or above the collective timeout) is logged as a warning by :meth:`Timeouts.check`. With
NCCL a collective stuck on a dead peer does not fail by itself: the wait is watched, and the
communicator is aborted as soon as the launcher publishes the next epoch (it saw the death)
or after the collective timeout
(:mod:`stalwart.elastic.groups`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

from stalwart.errors import ConfigError

__all__ = ["DEFAULT_TIMEOUT_S", "ORDER", "Timeouts"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
BEATS_PER_HANG = 5  # heartbeats per hang timeout (heartbeat.BEATS_PER_TIMEOUT)
_JOIN_FACTOR = 30.0
_JOIN_FLOOR_S = 60.0
ORDER = ("heartbeat_s", "hang_s", "collective_s", "join_s")
"""The timeouts shortest first, as :meth:`Timeouts.check` keeps them (the module docstring)."""


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """The derived timeouts of one setting (module docstring); validated on construction.

    Attributes:
        timeout_s: the user's setting, seconds (the collective timeout).
        hang_override_s: ``--hang-timeout`` when given (0: heartbeats off); None: derived.
        join_override_s: an explicit ``Job(join_timeout_s=...)``; None: derived.
    """

    timeout_s: float = DEFAULT_TIMEOUT_S
    hang_override_s: float | None = None
    join_override_s: float | None = None

    def __post_init__(self) -> None:
        self.check()

    @property
    def collective_s(self) -> float:
        """Timeout of an epoch's process group, the store client and the arrival, seconds."""
        return self.timeout_s

    @property
    def hang_s(self) -> float:
        """Heartbeat silence after which the launcher kills a worker (0: never)."""
        return self.timeout_s / 2 if self.hang_override_s is None else self.hang_override_s

    @property
    def heartbeat_s(self) -> float:
        """Seconds between two heartbeats of a worker (0: none sent)."""
        return self.hang_s / BEATS_PER_HANG

    @property
    def join_s(self) -> float:
        """How long a worker waits for a membership epoch that lists it."""
        if self.join_override_s is not None:
            return self.join_override_s
        return max(_JOIN_FACTOR * self.timeout_s, _JOIN_FLOOR_S)

    @property
    def collective(self) -> timedelta:
        """:attr:`collective_s` as torch.distributed takes it."""
        return timedelta(seconds=self.collective_s)

    def check(self) -> list[str]:
        """The order of the module docstring, checked; returns what an override breaks.

        Derived timeouts always keep the order. An explicit ``--hang-timeout`` or
        ``join_timeout_s`` that breaks it is allowed (a test may want a collective to time
        out first on purpose) but logged as a warning, and returned.

        Raises:
            ConfigError: the timeout is not positive, or an override is negative.
        """
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout {self.timeout_s} s: give a positive number of seconds")
        hang, join = self.hang_s, self.join_s
        if hang < 0 or join <= 0:
            raise ConfigError(
                f"hang timeout {hang:g} s, join timeout {join:g} s: the hang timeout is >= 0 "
                "(0: heartbeats off) and the join timeout > 0"
            )
        problems = []
        if hang > 0 and hang >= self.collective_s:
            problems.append(
                f"hang timeout {hang:g} s >= collective timeout {self.collective_s:g} s: a frozen "
                "member's peers time out before the launcher kills it (leave --hang-timeout "
                "out: it is derived as --timeout / 2)"
            )
        if join <= self.collective_s + hang:
            problems.append(
                f"join timeout {join:g} s <= collective ({self.collective_s:g} s) + hang "
                f"({hang:g} s): a worker may give up on an epoch that is still forming (leave "
                "join_timeout_s out: it is derived as max(30 x timeout, 60 s))"
            )
        for problem in problems:
            log.warning("timeouts out of order: %s", problem)
        return problems

    def table(self) -> dict[str, float]:
        """Every timeout by name, shortest first (:data:`ORDER`), seconds (for docs, logs and
        ``--json`` output)."""
        return {name: getattr(self, name) for name in ORDER}
