"""Sharded state in an elastic job: each member holds its own shard, protected by its peers.

:class:`~stalwart.elastic.Job` heals a newcomer from a live member's memory, which works for
replicated state only. Here every member also holds a *shard* nobody else has (a ZeRO-style
optimizer shard, an expert, a slice of a sharded model). After every ``every`` committed steps
the members capture a :class:`~stalwart.checkpoint.memory.snapshot.Snapshot` of their whole
state (the job's replicated state and their shard) and exchange erasure-coded pieces of it
(:class:`~stalwart.checkpoint.memory.erasure.ErasureGroup`, ``k`` data + ``m`` parity pieces
per stripe: ``m/k`` extra memory per member). When a member dies, its replacement rebuilds
its snapshot from the survivors' memory, with no disk read, and every member returns to that
step together; survivors never restart.

**Slots.** Erasure coding needs fixed positions, but a replacement gets a new worker id and
therefore maybe another rank. So positions are *slots* ``0 .. n-1``, not ranks: at the first
epoch slot = rank; at every later epoch the members all-gather their slots over the job's
group, survivors keep theirs, and newcomers take the free ones (ascending, in rank order), so
a replacement takes over the dead member's slot and shard. The erasure exchange runs on a
gloo group whose rank is the slot (the default process group, rebuilt at each epoch on
``PrefixStore(f"shard/epoch{n}", coordinator store)``), so a rebuilt snapshot's pieces are
where the survivors left them.

**When a member is lost** (at the first step boundary of the new epoch, collective):

1. the members all-gather (slot, the steps of their two newest protected snapshots);
2. target = the newest step every survivor has protected (a member killed inside a protect
   can leave some survivors one protect ahead: each keeps its previous one for this);
3. more than ``m`` lost slots in one group of ``k + m``: :class:`CorruptCheckpointError` on
   every member, saying to restore from the durable checkpoint;
4. ``ErasureGroup.rebuild``: the newcomers receive their slot's snapshot (digest verified);
5. everyone restores its snapshot of the target step (replicated state, shard, RNG) and the
   job's committed step is set back to it; the replicated state's digests are compared
   (:mod:`stalwart.elastic.parity`); then the state is protected again at once.

Protection is two-phase so that a failure cannot leave a member blocked: a one-element
all-reduce on the *job's* group first (a member that discarded the step has closed that group,
so the others fail at once instead of waiting for a gloo timeout), then the exchange. A failed
protect is a fault of the step (the job moves on to the next epoch); the older protected
snapshot is kept.

Cost: two snapshot buffers and two parity buffers per member (the newest and the previous
protect), a protect (one capture, ``(n-1)/k`` of the snapshot sent per member) every ``every``
steps, and on a loss the steps since the last protect.

The shard's optimizer is stepped by :meth:`ShardedState.step_on_commit` when the job commits,
so a discarded step never touches the shard. It works through the job's
:class:`~stalwart.elastic.ledger.StepLedger` (``job.ledger``: its group, fault path and
``rewind``), never the job's private fields.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

from stalwart.checkpoint.capture import HostBuffer
from stalwart.checkpoint.memory.erasure import ErasureGroup, ProtectedSnapshot
from stalwart.checkpoint.memory.snapshot import Snapshot
from stalwart.elastic.events import EventKind
from stalwart.elastic.job import Job
from stalwart.errors import ConfigError, CorruptCheckpointError, DistributedError

__all__ = ["ShardedState", "assign_slots", "lost_beyond_tolerance"]

log = logging.getLogger(__name__)


def assign_slots(claimed: list[int], n: int) -> list[int]:
    """Slots of the members in rank order: ``-1`` (a newcomer) takes a free slot, ascending.

    Raises:
        ConfigError: two members claim one slot, or there are more members than slots.
    """
    kept = [s for s in claimed if s >= 0]
    if len(set(kept)) != len(kept) or len(claimed) > n:
        raise ConfigError(f"members claim slots {claimed} of {n}: each slot needs one member")
    free = iter(sorted(set(range(n)) - set(kept)))
    return [s if s >= 0 else next(free) for s in claimed]


def lost_beyond_tolerance(lost: list[int], n: int, k: int, m: int) -> list[str]:
    """Groups of ``k + m`` consecutive slots that lost more than ``m`` (empty: recoverable)."""
    width = k + m
    over = []
    for g in range(n // width):
        gl = [s for s in lost if g * width <= s < (g + 1) * width]
        if len(gl) > m:
            over.append(f"slots {gl} of group {g} (slots {g * width}..{(g + 1) * width - 1})")
    return over


class _Protected:
    """The two newest protected snapshots of this member, each in buffers of its own."""

    def __init__(self) -> None:
        self.buffers = [(HostBuffer(), HostBuffer()), (HostBuffer(), HostBuffer())]
        self.newest: tuple[int, ProtectedSnapshot] | None = None  # (buffer set, snapshot)
        self.previous: tuple[int, ProtectedSnapshot] | None = None

    def next_set(self) -> int:
        """The buffer set to write the next protect into (its old snapshot is dropped now)."""
        free = 0 if self.newest is None or self.newest[0] == 1 else 1
        if self.previous is not None and self.previous[0] == free:
            self.previous = None
        return free

    def steps(self) -> list[int]:
        return [-1 if p is None else p[1].step for p in (self.newest, self.previous)]

    def at(self, step: int) -> ProtectedSnapshot | None:
        for p in (self.newest, self.previous):
            if p is not None and p[1].step == step:
                return p[1]
        return None


class ShardedState:
    """Keep ``shard`` (this member's own state) recoverable from its peers' memory.

    Construct it after the :class:`~stalwart.elastic.Job` and its ``optimizer()``, on every
    member (a replacement included: it heals here). Run the job with ``min_size`` equal to
    the number of slots, so that nobody trains while a shard is missing.

    Args:
        job: the elastic job (its ``state`` is the replicated part).
        shard: this member's shard: anything with ``state_dict()`` / ``load_state_dict()``
            (e.g. ``TrainingState(model=expert, optimizer=opt, rng=False)``), with the same
            structure on every slot (a fresh replacement's shard is loaded into).
        k: data pieces per stripe; ``m``: parity pieces (losses tolerated per group).
        every: protect every this many committed steps (1: a loss costs one step).
        codec: the :class:`ErasureGroup` codec (``"auto"``: XOR for ``m = 1``).

    Raises:
        ConfigError: the number of members is not a multiple of ``k + m``.

    Example:
        >>> job = Job(TrainingState(model=model, optimizer=opt), min_size=4)  # doctest: +SKIP
        >>> optimizer = job.optimizer(opt)
        >>> sharded = ShardedState(job, TrainingState(model=expert, optimizer=eopt), k=3, m=1)
        >>> sharded.step_on_commit(eopt)   # the shard's update applies only to committed steps
        >>> while job.step < total:
        ...     optimizer.zero_grad()      # a lost shard is rebuilt here
        ...     loss(model, expert, batch(job.step, sharded.slot)).backward()
        ...     optimizer.step()
    """

    def __init__(
        self, job: Job, shard: Any, *, k: int, m: int, every: int = 1, codec: str = "auto"
    ) -> None:
        if every < 1 or k < 1 or m < 1:
            raise ConfigError(f"ShardedState(k={k}, m={m}, every={every}): all must be >= 1")
        if job.group_size > 1:
            raise ConfigError(
                f"ShardedState with replica groups of {job.group_size}: a replica group's "
                "shards heal from the matching rank of a live group; ShardedState is for "
                "--group-size 1"
            )
        self.job, self.shard, self.k, self.m = job, shard, k, m
        self.every, self.codec = every, codec
        self.n = job.size
        self.slot = -1
        self.heals = 0
        self.last_heal: dict[str, Any] | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._protected = _Protected()
        self._erasure: ErasureGroup | None = None
        self._epoch = -1
        self._valid = False  # this member's state is the job's (False: a newcomer, until healed)
        self._state = {"replicated": job.state, "shard": shard}
        self._on_epoch()
        job.add_listener(self._listen)

    @property
    def protected_step(self) -> int:
        """The step of the newest protected snapshot (-1: none yet)."""
        return self._protected.steps()[0]

    def step_on_commit(self, optimizer: torch.optim.Optimizer) -> None:
        """Run ``optimizer.step()`` and ``zero_grad()`` whenever the job commits a step.

        Its gradients are zeroed at every step boundary too, so a discarded step leaves
        nothing behind. Do not call its ``step()`` yourself.
        """
        self._optimizers.append(optimizer)

    # -- listening to the job ---------------------------------------------------------------

    def _listen(self, event: str, step: int) -> None:
        if event == "collective-enter" and self.job.epoch != self._epoch:
            raise ConfigError(
                "the job changed epoch inside optimizer.step() (no zero_grad() at the step "
                "boundary): sharded state heals at zero_grad(); call it at every step"
            )
        if event == "step-begin":
            if self.job.epoch != self._epoch:
                self._on_epoch()
            for opt in self._optimizers:
                opt.zero_grad()
        elif event == "commit":
            for opt in self._optimizers:
                opt.step()
                opt.zero_grad()
            if step % self.every == 0:
                self.protect()

    def protect(self) -> bool:
        """Capture and protect this member's state at the job's step (collective).

        Returns False when a member failed (the job then moves on to the next epoch at its
        next boundary; the previous protected snapshot is kept).
        """
        if self._erasure is None:
            return False
        group = self.job.ledger.group
        try:
            if group is not None:
                group.allreduce([torch.ones(1)]).wait()  # everyone committed this step
            which = self._protected.next_set()
            snap_buf, parity_buf = self._protected.buffers[which]
            snap = Snapshot.capture(self._state, self.job.step, snap_buf)
            done = self._erasure.protect(snap, parity_buffer=parity_buf)
        except (RuntimeError, DistributedError) as e:  # a member died: a fault of this step
            self.job.ledger.fault(e)
            return False
        self._protected.previous = self._protected.newest
        self._protected.newest = (which, done)
        return True

    # -- a new epoch --------------------------------------------------------------------------

    def _gather(self, values: list[int]) -> list[list[int]]:
        """Every member's ``values`` over the job's group, by rank."""
        t = torch.tensor(values, dtype=torch.int64)
        group = self.job.ledger.group
        if group is None:
            return [values]
        out = [torch.empty_like(t) for _ in range(self.job.size)]
        group.allgather([out], [t]).wait()
        return [o.tolist() for o in out]

    def _on_epoch(self) -> None:
        """At the first boundary of an epoch: settle slots, rebuild lost shards, protect.

        A member failing meanwhile is a fault: everyone joins the next epoch and starts over
        (a newcomer whose rebuild did not finish is still counted as lost).
        """
        while True:
            while self.job.elastic and self.job.size < self.n:
                self.job.refresh()  # wait for replacements: a shard is missing
            try:
                self._settle()
            except (RuntimeError, DistributedError) as e:  # a member died during the heal
                log.warning("epoch %d: healing sharded state failed: %s", self.job.epoch, e)
                self.job.ledger.fault(e)
            if not self.job.ledger.reconfigure_due:
                return
            self.job.ledger.reconfigure()

    def _settle(self) -> None:
        valid = int(self._valid)
        rows = self._gather([self.slot, self.n, valid, *self._protected.steps()])
        self.n = max(r[1] for r in rows)
        slots = assign_slots([r[0] for r in rows], self.n)
        lost = sorted(slots[i] for i, r in enumerate(rows) if not r[2])
        self.slot = slots[self.job.rank]
        self._make_group()
        self._epoch = self.job.epoch
        if all(r[3] < 0 for r in rows):  # nothing protected yet: the job's start
            self._valid = True
            self.protect()
        elif lost:
            self._heal([r for r in rows if r[2]], lost)

    def _make_group(self) -> None:
        """The erasure group: a gloo group in which this member's rank is its slot."""
        if self.job.elastic:
            if dist.is_initialized():
                dist.destroy_process_group()
            membership = self.job.ledger.membership
            assert membership is not None
            store = PrefixStore(f"shard/epoch{self.job.epoch}", membership.store)
            timeout = timedelta(seconds=membership.env.timeout_s)
            dist.init_process_group("gloo", store=store, rank=self.slot, world_size=self.n,
                                    timeout=timeout)  # fmt: skip
        elif self.job.size == 1:
            self._erasure = None  # a world of one: nobody to protect with
            return
        self._erasure = ErasureGroup(self.k, self.m, codec=self.codec)

    def _heal(self, rows: list[list[int]], lost: list[int]) -> None:
        """Rebuild the lost slots' snapshots and take every member back to their step.

        ``rows``: the valid members' (slot, n, 1, newest protected step, previous one).
        """
        t0 = time.perf_counter()
        over = lost_beyond_tolerance(lost, self.n, self.k, self.m)
        if over:
            raise CorruptCheckpointError(
                f"sharded state lost beyond repair from memory: {'; '.join(over)} died, but "
                f"{self.k}+{self.m} erasure coding rebuilds at most {self.m} per group; stop the "
                "job and restore every member from the durable checkpoint (stalwart.checkpoint)",
                damaged=over,
            )
        target = min(r[3] for r in rows)
        mine = None if self.slot in lost else self._protected.at(target)
        if self.slot not in lost and mine is None:
            raise CorruptCheckpointError(
                f"slot {self.slot} holds no protected snapshot of step {target} (it holds "
                f"{self._protected.steps()}); restore from the durable checkpoint"
            )
        assert self._erasure is not None
        rebuilt = self._erasure.rebuild(lost, mine, buffer=self._protected.buffers[0][0])
        snap = rebuilt if rebuilt is not None else mine.snapshot if mine is not None else None
        assert snap is not None
        if rebuilt is not None:  # a newcomer: its rebuilt snapshot lives in buffer set 0
            self._protected.newest = self._protected.previous = None
        snap.restore_into(self._state)
        self._valid = True
        self.job.ledger.rewind(target, "shard-heal")
        self.heals += 1
        rebuild_s = self._erasure.last_rebuild.total_s if self._erasure.last_rebuild else 0.0
        self.last_heal = {"step": target, "lost": lost, "rebuilt": rebuilt is not None,
                          "seconds": time.perf_counter() - t0, "rebuild_s": rebuild_s}  # fmt: skip
        self.job.ledger.events.write(EventKind.SHARD_HEALED, **self.last_heal, slot=self.slot)
        self.protect()
