"""The coordinator: a ``TCPStore`` hosted by the launcher, and the epochs it publishes.

The launcher is the only writer of membership: it sees worker processes exit (``waitpid``),
reads the workers' readiness records and fault reports from the store, and publishes a new
epoch (``coord/epoch{n}/members``, then ``coord/epoch``) when a member died, a member reported
a failed collective, or a ready newcomer is waiting. Workers only ever follow published
epochs (see :mod:`stalwart.elastic.membership`), so there is no election and no consensus
beyond the store's atomic ``add`` and ``compare_set``.

If the store fails while the launcher lives (or on SIGUSR1, a fail-over drill), the launcher
re-hosts it on a new port and publishes the address in ``coordinator.addr``; members and their
heartbeats follow it and rejoin from their own memory (:mod:`stalwart.elastic.launcher`). If
the launcher's host dies, the store dies with it: members keep training in their current
epoch (their gloo groups do not use the store once built) until the next membership change,
whose join then times out with a :class:`~stalwart.errors.DistributedError` telling the user
to rerun from the last checkpoint; moving the store to a surviving host is not implemented.

A hung member (SIGSTOP, a stuck host) stops its heartbeats; the launcher kills it after the
hang timeout (:mod:`stalwart.elastic.heartbeat`), which also fails the survivors' pending
collective with it. As a backstop (heartbeats off, or a member alive but never entering the
collective), the others' collective times out after the epoch's gloo timeout; the hung member
then never arrives at the next epoch, which the others abandon after the same timeout, and the
launcher kills and replaces whoever never arrived (:meth:`absent`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch.distributed import TCPStore

from stalwart.elastic.protocol import decode, encode, keys

__all__ = ["Coordinator"]


class Coordinator:
    """Hosts the store on 127.0.0.1 at a port chosen by the OS, and publishes epochs."""

    def __init__(self) -> None:
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.epoch = 0
        self.members: tuple[int, ...] = ()

    @property
    def address(self) -> str:
        """``host:port`` for workers (``STALWART_ELASTIC_STORE``)."""
        return f"127.0.0.1:{self.store.port}"

    def ready(self, wids: Iterable[int]) -> dict[int, dict[str, Any]]:
        """The readiness records of the workers among ``wids`` that announced themselves."""
        return {w: decode(self.store.get(keys.ready(w))) for w in wids if self._has(keys.ready(w))}

    def done(self, wids: Iterable[int]) -> dict[int, dict[str, Any]]:
        """The completion records of the workers among ``wids`` that finished."""
        return {w: decode(self.store.get(keys.done(w))) for w in wids if self._has(keys.done(w))}

    def fatal(self) -> dict[str, Any] | None:
        """The fatal error a worker reported (``{"wid", "error"}``), or None."""
        return decode(self.store.get(keys.FATAL)) if self._has(keys.FATAL) else None

    def stats(self, wids: Iterable[int]) -> dict[int, dict[str, Any]]:
        """The latest step-time windows published by the workers among ``wids``."""
        return {w: decode(self.store.get(keys.stats(w))) for w in wids if self._has(keys.stats(w))}

    def faulted(self) -> bool:
        """True when a member reported a failed collective in the current epoch."""
        return self.epoch > 0 and self.store.add(keys.faults(self.epoch), 0) > 0

    def absent(self) -> set[int]:
        """Members of the current epoch that never came to build it, if it was abandoned."""
        fate = keys.fate(self.epoch)
        if self.epoch == 0 or not self._has(fate) or self.store.get(fate) != b"abandon":
            return set()
        return {w for w in self.members if not self._has(keys.arrival(self.epoch, w))}

    def members_of(self, epoch: int) -> tuple[int, ...]:
        """The members published for ``epoch``."""
        return tuple(decode(self.store.get(keys.members(epoch))))

    def publish(self, members: Iterable[int], groups: Sequence[Sequence[int]] | None = None) -> int:
        """Publish the next epoch with ``members``; returns its number.

        ``groups``: the replica groups (each its worker ids by rank in the group), written
        before the epoch number so that a worker that sees the epoch finds them.
        """
        self.members = tuple(sorted(members))
        self.epoch += 1
        self.store.set(keys.members(self.epoch), encode(list(self.members)))  # type: ignore[arg-type]  # the stub says str; bytes are accepted
        if groups is not None:
            self.store.set(keys.groups(self.epoch), encode([list(g) for g in groups]))  # type: ignore[arg-type]  # bytes are accepted
        self.store.set(keys.EPOCH, str(self.epoch))
        return self.epoch

    def _has(self, key: str) -> bool:
        return bool(self.store.check([key]))
