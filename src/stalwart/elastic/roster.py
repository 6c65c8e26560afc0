"""The launcher's roster of replica groups: who is in which group, which groups are down.

With ``--group-size G`` the launcher starts ``nproc / G`` groups of ``G`` workers. The group is
the unit of failure: when one of its workers dies (or is killed as hung), the launcher kills
the others (:meth:`Roster.take_down`) and starts a whole new group in its place, with a fresh
group id; the other groups keep committing. An epoch lists only *complete* groups: every one
of their ``G`` workers alive and ready (:meth:`Roster.complete`), ordered by group id, so that
rank ``i`` of every listed group forms the replicate group of shard ``i``.

Each worker also has a *slot* on its node (``0 .. nproc-1``; its CUDA device is
``slot % device_count``): a replacement takes the slot of the worker it replaces, so the new
group lands on the devices the old one freed. With ``G = 1`` every worker is a group of one
and nothing here changes what the launcher did before groups.
"""

from __future__ import annotations

from collections.abc import Iterable

from stalwart.errors import ConfigError

__all__ = ["Roster"]


class Roster:
    """Replica groups of one launcher (module docstring).

    Args:
        nproc: workers this launcher runs (a multiple of ``group_size``).
        group_size: workers per replica group.

    Raises:
        ConfigError: ``group_size`` does not divide ``nproc``.
    """

    def __init__(self, nproc: int, group_size: int = 1) -> None:
        if group_size < 1 or nproc % group_size:
            raise ConfigError(
                f"--nproc {nproc} --group-size {group_size}: the group size must be >= 1 and "
                f"divide the number of workers; give an --nproc that is a multiple of it"
            )
        self.nproc, self.group_size = nproc, group_size
        self.group_of: dict[int, int] = {}  # wid -> group id
        self.members: dict[int, list[int]] = {}  # group id -> wids by rank in the group
        self.slot_of: dict[int, int] = {}  # wid -> device slot on this node
        self.down: set[int] = set()  # group ids taken out
        self.taken_down: dict[int, int] = {}  # a worker killed with its group -> who died
        self._next_group = 0

    @property
    def groups(self) -> int:
        """Replica groups at full strength."""
        return self.nproc // self.group_size

    def new_group(self) -> int:
        """A fresh group id."""
        gid = self._next_group
        self._next_group += 1
        self.members[gid] = []
        return gid

    def add(self, gid: int, wid: int, slot: int) -> int:
        """Put worker ``wid`` at the next rank of group ``gid``, on ``slot``; returns its rank."""
        self.group_of[wid] = gid
        self.members[gid].append(wid)
        self.slot_of[wid] = slot
        return len(self.members[gid]) - 1

    def free_slot(self, replaces: int | None) -> int:
        """The slot for a new worker: the one it replaces, else the lowest never used."""
        if replaces is not None and replaces in self.slot_of:
            return self.slot_of[replaces]
        return len(self.slot_of)

    def take_down(self, wid: int) -> list[int] | None:
        """Worker ``wid`` died: mark its group down; returns the partners to kill.

        None when its group was already down (``wid`` was killed with it, or died with it).
        """
        gid = self.group_of.get(wid)
        if gid is None or gid in self.down:
            return None
        self.down.add(gid)
        partners = [w for w in self.members[gid] if w != wid]
        for w in partners:
            self.taken_down[w] = wid
        return partners

    def group_members(self, wid: int) -> list[int]:
        """Every worker of ``wid``'s group, by rank (``[wid]`` for an unknown worker)."""
        gid = self.group_of.get(wid)
        return list(self.members[gid]) if gid is not None else [wid]

    def complete(self, ready: Iterable[int]) -> list[list[int]]:
        """The groups not down whose workers are all in ``ready``, by group id."""
        ok = set(ready)
        return [
            list(wids)
            for gid, wids in sorted(self.members.items())
            if gid not in self.down and len(wids) == self.group_size and set(wids) <= ok
        ]

    def live_groups(self, live: Iterable[int]) -> int:
        """Groups not down with every worker alive (``live``)."""
        return len(self.complete(live))
