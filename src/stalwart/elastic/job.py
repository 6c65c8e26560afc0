"""``Job``: one member of an elastic data-parallel job, and the optimizer wrapper that commits.

A step is *committed* when its gradient all-reduce completed on this member: the reduced
buffer carries one vote per member, and the optimizer applies the update only when all votes
are there. A failed collective (a peer died, a timeout) discards the step (parameters and
optimizer state were not touched; the global RNGs are put back as they were at the step's
start), tells the coordinator, and marks the job for reconfiguration. Membership changes only
at step boundaries: at the next ``zero_grad()`` (or ``step()``), the member joins the next
epoch published by the coordinator, builds its gloo group on a fresh
``PrefixStore(f"epoch{n}", store)``, and reconciles with the other members
(:mod:`stalwart.elastic.parity`: ahead wins, then a strict majority, else a rollback), so a
newcomer and any member behind receive the committed state peer to peer.

The job owns its step through a :class:`~stalwart.elastic.ledger.StepLedger` (``job.ledger``:
the committed step, the epoch, commit, discard, fault, reconfigure); :meth:`Job.commit` hands
each step to one :class:`~stalwart.elastic.ledger.CommitStrategy` that receives the ledger:
the all-reduce (:mod:`stalwart.elastic.commit`) or backup workers
(:mod:`stalwart.elastic.backup_job`).

A newcomer announced by the coordinator is noticed by rank 0 of the epoch, which raises a
flag inside the next gradient all-reduce: every member sees the same flag in the same reduced
buffer, so all of them change epoch after the same step.

Three worlds (:class:`World`), given as ``Job(..., world=...)`` or, by default, detected
from the environment (:mod:`stalwart.environment`):

* ``"elastic"``, under ``stalwart run`` (``STALWART_ELASTIC_STORE`` set): as above;
* ``"torchrun"`` (``RANK``/``WORLD_SIZE`` set, more than one process): the default gloo
  process group, a fixed world; a failed collective raises
  :class:`~stalwart.errors.DistributedError`;
* ``"single"``: a world of one, no collectives.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stalwart.elastic.backup import BackupRound, Dynamic, Static
from stalwart.elastic.backup_job import BackupCommit, check_reduce
from stalwart.elastic.commit import AllReduceCommit
from stalwart.elastic.events import EventLog, Finish, Start
from stalwart.elastic.ledger import CommitStrategy, Listener, StepLedger
from stalwart.elastic.membership import Epoch, Membership
from stalwart.elastic.optimizer import ElasticOptimizer
from stalwart.elastic.parity import Decision, gather_digests
from stalwart.elastic.protocol import from_env
from stalwart.elastic.reduce import REDUCTIONS
from stalwart.environment import torchrun_world
from stalwart.errors import ConfigError, DistributedError

__all__ = ["Job", "World"]

log = logging.getLogger(__name__)


class World(StrEnum):
    """Where a :class:`Job` runs, and so how it finds its members (module docstring)."""

    ELASTIC = "elastic"  # stalwart run's coordinator: members come and go
    TORCHRUN = "torchrun"  # the default gloo process group, a fixed world
    SINGLE = "single"  # one process, no collectives

    @classmethod
    def detect(cls) -> World:
        """The world the environment says: ``stalwart run``, then ``torchrun``, else one process."""
        if from_env() is not None:
            return cls.ELASTIC
        world = torchrun_world()
        return cls.TORCHRUN if world is not None and world[1] > 1 else cls.SINGLE


def _fixed_epoch(world: World) -> Epoch:
    """The world of ``torchrun`` (default process group) or of a single process."""
    if world is World.TORCHRUN:
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        size = dist.get_world_size()
        return Epoch(0, tuple(range(size)), dist.get_rank(), dist.group.WORLD)
    return Epoch(0, (0,), 0, None)


class Job:
    """Join the job that started this process, and keep its members' state identical.

    Args:
        state: the replicated state (normally a :class:`stalwart.TrainingState`); its
            ``state_dict()`` is digested and sent to members that need it.
        min_size: the fewest members to train with; below it, members wait for replacements.
        verify_every: compare digests every this many committed steps (0: only after heals).
        join_timeout_s: how long to wait for a membership epoch before giving up.
        stats_window: summarise step times every this many committed steps (``step-stats``
            events, and the launcher's straggler check; 0: off).
        world: ``"elastic"``, ``"torchrun"`` or ``"single"`` (:class:`World`); None: detected
            from the environment (:meth:`World.detect`).

    Attributes:
        ledger: the committed step and each step's outcome (:mod:`stalwart.elastic.ledger`),
            the interface the commit strategies, DiLoCo and sharded state work through.

    Example:
        >>> job = Job(TrainingState(model=model, optimizer=opt))  # doctest: +SKIP
        >>> optimizer = job.optimizer(opt)
        >>> while job.step < total:
        ...     optimizer.zero_grad()
        ...     loss_fn(model(batch(job.step, job.rank, job.size))).backward()
        ...     optimizer.step()
    """

    def __init__(
        self,
        state: Any,
        *,
        min_size: int = 1,
        verify_every: int = 50,
        join_timeout_s: float = 300.0,
        stats_window: int = 20,
        world: World | str | None = None,
    ) -> None:
        if min_size < 1 or verify_every < 0:
            raise ConfigError(
                f"Job(min_size={min_size}, verify_every={verify_every}): min_size must be >= 1 "
                "and verify_every >= 0"
            )
        self.state = state
        self.verify_every = verify_every
        self.join_timeout_s = join_timeout_s
        self._reduce = "mean"
        self._strategy: CommitStrategy = AllReduceCommit()
        self._closed = False
        self.world = World.detect() if world is None else World(world)
        env = from_env() if self.world is World.ELASTIC else None
        if self.world is World.ELASTIC and env is None:
            raise ConfigError(
                "Job(world='elastic') needs the coordinator: run the script with `stalwart run`"
            )
        membership = Membership(env, min_size) if env else None
        events = EventLog(env.events_dir if env else None, env.worker_id if env else 0)
        events.record(Start(pid=os.getpid()))
        first = membership.join(0, join_timeout_s) if membership else _fixed_epoch(self.world)
        self.ledger = StepLedger(
            state, events, membership, first, verify_every=verify_every,
            join_timeout_s=join_timeout_s, stats_window=stats_window,
        )  # fmt: skip
        if membership is not None:
            self.ledger.settle_after_join()
            atexit.register(self._close_at_exit)
        else:
            self.ledger.check_parity("start")
        self.ledger.mark_boundary()

    # -- what the training loop reads -------------------------------------------------------

    @property
    def step(self) -> int:
        """Committed steps; equal on every member at every step boundary."""
        return self.ledger.step

    @property
    def rank(self) -> int:
        """This member's rank in the current epoch (0 .. size-1)."""
        return self.ledger.epoch.rank

    @property
    def size(self) -> int:
        """Number of members in the current epoch."""
        return self.ledger.epoch.size

    @property
    def members(self) -> tuple[int, ...]:
        """Worker ids of the current epoch's members, ascending (rank = index)."""
        return self.ledger.epoch.members

    @property
    def epoch(self) -> int:
        """The current membership epoch (0 outside ``stalwart run``)."""
        return self.ledger.epoch.number

    @property
    def elastic(self) -> bool:
        """True under ``stalwart run`` (members may come and go)."""
        return self.ledger.membership is not None

    def digest(self) -> str:
        """Hex digest of parameters, optimizer state, RNG and the committed step."""
        return self.ledger.digest()

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(event, step)`` at ``step-begin``, ``collective-enter`` and ``commit``.

        Used by :mod:`stalwart.testing.chaos` to kill a member at an exact point.
        """
        self.ledger.add_listener(fn)

    # -- wrapping the user's objects --------------------------------------------------------

    def data_parallel(self, model: nn.Module, *, reduce: str = "mean") -> nn.Module:
        """Average ``model``'s floating-point buffers over the members at every commit.

        Every buffer (BatchNorm's statistics and counters too) is put back on a discard.
        Gradients are reduced by :meth:`optimizer`'s ``step()``: ``reduce="mean"`` averages
        them (one all-reduce per step, with the buffers); ``reduce="adasum"`` combines them by
        Adasum (:mod:`stalwart.elastic.reduce`: a tree and a broadcast, then the buffers'
        all-reduce). Returns ``model`` itself: nothing changes in the forward pass.

        Raises:
            ConfigError: ``reduce`` is not one of ``"mean"``, ``"adasum"``, or Adasum with backup.
        """
        if reduce not in REDUCTIONS:
            raise ConfigError(f"data_parallel(reduce={reduce!r}): use one of {REDUCTIONS}")
        check_reduce(reduce, isinstance(self._strategy, BackupCommit))
        self._reduce = reduce
        if isinstance(self._strategy, AllReduceCommit):
            self._strategy = AllReduceCommit(reduce)
        self.ledger.model_buffers = list(model.buffers())
        self.ledger.buffers = [b for b in self.ledger.model_buffers if b.is_floating_point()]
        return model

    def optimizer(
        self, optimizer: torch.optim.Optimizer, *, backup: int | Static | Dynamic = 0
    ) -> ElasticOptimizer:
        """Wrap ``optimizer``: ``zero_grad()`` is the step boundary; ``step()`` commits.

        ``backup=b`` (or ``Static(b, partial=True)``, or ``Dynamic()`` to choose b online)
        commits each step with the first ``n - b`` members' gradients, late ones dropped or
        partial (:mod:`stalwart.elastic.backup`); elastic jobs only (needs the coordinator).
        """
        check_reduce(self._reduce, backup != 0)
        backups = None
        if backup != 0 and self.ledger.membership is not None:
            backups = BackupRound(self.ledger.membership.store, backup)
            self._strategy = BackupCommit(backups)
        elif backup != 0 and self.size > 1:
            raise ConfigError("backup workers need the coordinator: run under `stalwart run`")
        self.ledger.params = [p for g in optimizer.param_groups for p in g["params"]]
        return ElasticOptimizer(optimizer, self, backups)

    # -- the step ---------------------------------------------------------------------------

    def begin_step(self) -> None:
        """The step boundary: join a new epoch first if one is due."""
        if self.ledger.reconfigure_due:
            self.ledger.reconfigure()
        self.ledger.notify("step-begin")

    def refresh(self) -> None:
        """At a step boundary, join a newer epoch if the coordinator published one.

        Collective: every member calls it at the same boundary (``optimizer.step()`` does the
        same check for free inside its all-reduce). Use it to wait for replacements, e.g.
        ``while job.size < 3: job.refresh()`` before an evaluation.
        """
        ledger = self.ledger
        if ledger.membership is None:
            return
        if not ledger.reconfigure_due:
            flag = torch.tensor([ledger.change_flag()])
            try:
                if ledger.group is not None:
                    ledger.group.allreduce([flag]).wait()
            except RuntimeError as e:
                ledger.fault(e)
            if float(flag[0]) > 0:
                ledger.flag_newer_epoch()
        if ledger.reconfigure_due:
            ledger.reconfigure()
        else:
            time.sleep(0.01)  # nothing new: callers poll in a loop

    def commit(self, apply: Callable[[], Any]) -> Any:
        """Combine the members' contributions by the job's strategy and ``apply()`` the step.

        The strategy is the all-reduce (:class:`~stalwart.elastic.commit.AllReduceCommit`) or,
        with backup workers, :class:`~stalwart.elastic.backup_job.BackupCommit`. Returns
        ``apply()``'s result, or None when the step was discarded.
        """
        self.ledger.enter_collective()
        return self._strategy.commit(self.ledger, apply)

    # -- the end ----------------------------------------------------------------------------

    def close(self) -> None:
        """Agree with the other members that everyone finished at the same step, then leave.

        A member whose copy of the last all-reduce failed is healed here, so that no member
        leaves with a state the others do not have. Idempotent once done; run at exit if forgotten.
        """
        if self._closed:
            return
        ledger = self.ledger
        if ledger.membership is not None:
            deadline = time.monotonic() + self.join_timeout_s
            while not self._agree_final():  # a rollback raises: the loop must train on
                if time.monotonic() > deadline:
                    raise DistributedError("members did not agree on the final step in time")
            final = self.digest()
            ledger.membership.finish(self.step, self.epoch)
            ledger.drop_group()
        else:
            final = self.digest()
        self._closed = True
        ledger.events.record(Finish(step=self.step, epoch=self.epoch, digest=final))
        ledger.events.close()

    def _agree_final(self) -> bool:
        ledger = self.ledger
        if ledger.reconfigure_due:
            ledger.reconfigure()
        try:
            table = gather_digests(self.step, self.digest(), ledger.group)
            if len(set(table)) == 1:
                return True
            ledger.check_parity("final")
            if ledger.last_decision is Decision.ROLLBACK:
                raise DistributedError(
                    f"no majority at the final step: rolled back to step {self.step}, the last "
                    "agreed; train on to the total and call close() again (or make verify_every "
                    "divide the total steps, so that the check runs inside the training loop)"
                )
        except RuntimeError as e:
            if isinstance(e, DistributedError):
                raise
            ledger.fault(e)
        return False

    def _close_at_exit(self) -> None:
        if getattr(sys, "last_value", None) is not None:
            return  # the script died of an exception: leave, the others see a fault
        try:
            self.close()
        except Exception:
            log.exception("closing the elastic job at exit failed")

    def __enter__(self) -> Job:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()
