"""The few collectives a save or load needs, with errors carried across ranks.

Every rank does its local part inside ``try``, then all ranks exchange outcomes with one
``all_gather_object`` so that a failure on any rank makes every rank raise the same
:class:`DistributedError` (instead of some ranks hanging in the next collective).
The objects exchanged are small descriptions, never tensor data.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from stalwart.errors import DistributedError

__all__ = ["BACKGROUND_GROUPS", "BackgroundGroups", "Group", "dedicated_group", "release",
           "resolve_group"]  # fmt: skip

T = TypeVar("T")


@dataclass
class Group:
    """The ranks a checkpointer coordinates (a process group, or one lone process)."""

    pg: Any
    rank: int
    world: int

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, indexed by rank."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(out, obj, group=self.pg)
        except RuntimeError as e:  # gloo: a peer died ("Connection closed by peer"), timeout
            raise self._failed(e) from e
        return out

    def count(self, flag: bool) -> int:
        """On how many ranks ``flag`` holds (every rank learns the same number).

        Where the group takes CPU tensors (gloo) this is an all-reduce of one number: 0.4 ms
        for 4 ranks sharing 2 cores, against 7 ms for an object gather, which needs two
        all-gathers, each a ring the peers step through in turn. Elsewhere, an object gather.
        """
        if self.world == 1:
            return int(flag)
        if "gloo" not in str(dist.get_backend(self.pg)):
            return sum(map(bool, self.all_gather(flag)))
        t = torch.tensor([int(bool(flag))], dtype=torch.int64)
        try:
            dist.all_reduce(t, group=self.pg)
        except RuntimeError as e:
            raise self._failed(e) from e
        return int(t.item())

    def _failed(self, e: RuntimeError) -> DistributedError:
        return DistributedError(
            f"a collective with the other {self.world - 1} rank(s) failed ({e}); another "
            "rank probably died or hung. A step is committed whole or not at all, whichever "
            "collective failed: restart the job and resume from the latest checkpoint"
        )

    def broadcast(self, obj: T, src: int = 0) -> T:
        """Rank ``src``'s ``obj`` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.pg, src), group=self.pg)
        except RuntimeError as e:
            raise self._failed(e) from e
        return box[0]

    def run_on_root(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 alone and hand its result to every rank (one broadcast);
        raise on every rank if it failed."""
        if self.world == 1:
            return fn()
        outcome: tuple[bool, Any] = (True, None)
        local_error: BaseException | None = None
        if self.rank == 0:
            try:
                outcome = (True, fn())
            except Exception as e:  # carried to every rank below, re-raised locally
                local_error, outcome = e, (False, f"{type(e).__name__}: {e}")
        ok, result = self.broadcast(outcome)
        if not ok:
            raise DistributedError(f"{what} failed on rank 0: {result}") from local_error
        return result

    def run(self, what: str, fn: Callable[[], T]) -> list[T]:
        """Run ``fn`` on every rank and gather results; raise on all ranks if any failed."""
        try:
            outcome: tuple[bool, Any] = (True, fn())
        except Exception as e:  # carried to every rank below, re-raised locally
            if self.world == 1:
                raise
            local_error: BaseException | None = e
            outcome = (False, f"{type(e).__name__}: {e}")
        else:
            local_error = None
        outcomes = self.all_gather(outcome)
        failed = [(r, msg) for r, (ok, msg) in enumerate(outcomes) if not ok]
        if failed:
            detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
            err = DistributedError(f"{what} failed on {len(failed)} rank(s): {detail}")
            if local_error is not None:
                raise err from local_error
            raise err
        return [res for _, res in outcomes]


def resolve_group(process_group: Any = None) -> Group:
    """The group to coordinate: the given one, the default one if initialised, or none."""
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return Group(pg=None, rank=0, world=1)
    pg = process_group if process_group is not None else dist.group.WORLD
    return Group(pg=pg, rank=dist.get_rank(pg), world=dist.get_world_size(pg))


def dedicated_group(g: Group) -> Group:
    """A new gloo group over ``g``'s ranks, for collectives issued from background threads.

    Two threads issuing collectives on one group interleave and deadlock (a known DCP async
    failure); background work gets a group of its own. Collective: every rank of ``g`` must
    call it, in the same order.
    """
    ranks = dist.get_process_group_ranks(g.pg)
    pg = dist.new_group(ranks=ranks, backend="gloo")
    return Group(pg=pg, rank=dist.get_rank(pg), world=len(ranks))


def release(g: Group) -> None:
    """Destroy a group :func:`dedicated_group` made, once nothing runs on it any more.

    Each gloo group holds a connection to every other rank: a process that builds a
    ``Checkpointer`` per save would otherwise keep one more group (and its sockets) per save.
    Local, not collective. A group already gone (the default group destroyed first) is left.
    """
    if g.pg is None or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.get_process_group_ranks(g.pg)  # raises once the group is no longer registered
    except (RuntimeError, ValueError, KeyError):
        return
    dist.destroy_process_group(g.pg)


class BackgroundGroups:
    """Dedicated groups that no Checkpointer uses now, kept for the next one of the process.

    Making a gloo group is a rendezvous of every rank through the store and a connection to
    each (11 ms on 2 local ranks, the largest part of a new Checkpointer's first
    ``save_async``). A closed Checkpointer gives its background group back here, and the next
    one over the same ranks takes it instead of making one: a Checkpointer per save costs no
    group. A group is used by one Checkpointer at a time (two threads issuing collectives on
    one group deadlock). :meth:`take` is collective when it must make a group, so every rank
    must take and give in the same order, as every rank makes the same Checkpointer calls.
    At most ``keep`` free groups are kept per set of ranks; further ones are released.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.free: dict[tuple[int, ...], list[Group]] = {}
        self.made = 0  # groups made because none was free, for tests and benches
        self._lock = threading.Lock()

    def take(self, g: Group) -> Group:
        """A free dedicated group over ``g``'s ranks, or a new one (then collective)."""
        ranks = tuple(dist.get_process_group_ranks(g.pg))
        with self._lock:
            free = self.free.get(ranks, [])
            while free:
                cand = free.pop()
                if _registered(cand):  # gone with a destroyed default group: never reused
                    return cand
        self.made += 1
        return dedicated_group(g)

    def give(self, g: Group) -> None:
        """Return ``g`` (no collective runs on it any more); release it past ``keep``."""
        if not _registered(g):
            return
        ranks = tuple(dist.get_process_group_ranks(g.pg))
        with self._lock:
            free = self.free.setdefault(ranks, [])
            if len(free) < self.keep:
                free.append(g)
                return
        release(g)


def _registered(g: Group) -> bool:
    if g.pg is None or not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        dist.get_process_group_ranks(g.pg)
    except (RuntimeError, ValueError, KeyError):
        return False
    return True


BACKGROUND_GROUPS = BackgroundGroups()
"""The process's free background groups, shared by every Checkpointer."""
