"""``Job``: one member of an elastic data-parallel job, and the optimizer wrapper that commits.

A step is *committed* when its gradient all-reduce completed on this member with one vote per
member; otherwise the step is discarded (parameters, optimizer state and global RNGs as at its
start), the coordinator is told, and the job reconfigures at the next step boundary
(``zero_grad()``, or ``step()``): it joins the next published epoch on a fresh
``PrefixStore(f"epoch{n}", store)`` and reconciles with its members
(:mod:`stalwart.elastic.parity`: ahead wins, then a strict majority, else a rollback), so a
newcomer and any member behind receive the committed state peer to peer; with
``Job(follow=True)`` a replacement heals while the survivors commit instead
(:mod:`stalwart.elastic.follow_job`). Rank 0 of the epoch notices a newcomer and raises a flag
inside the next all-reduce, so every member changes epoch after the same step. When no live
member holds the committed state, the job resumes from its checkpoint tiers
(``Job(checkpoint=...)``, :mod:`stalwart.elastic.checkpointing`).

The job owns its step through a :class:`~stalwart.elastic.ledger.StepLedger` (``job.ledger``);
:meth:`Job.commit` hands each step to one :class:`~stalwart.elastic.commit.CommitStrategy`: the
all-reduce (:mod:`stalwart.elastic.commit`) or backup workers (:mod:`stalwart.elastic.backup_job`).

**Replica groups** (``Job(state, group_size=G)``; default ``stalwart run --group-size``):
each replica is a group of ``G`` ranks with FSDP2 or tensor parallel inside
(``job.shard_group``, ``job.shard_mesh``); commits and parity checks run on the replicate
dimension (:mod:`stalwart.elastic.groups`). ``job.rank`` / ``job.size`` span all ranks
(``replica_rank * G + shard_rank``). Such a job joins its first epoch at the first step
boundary, once the model is sharded on ``job.shard_mesh``: fill the state before it.

The backend follows the device (gloo on CPU, NCCL on CUDA); one timeout gives the others
(:mod:`stalwart.elastic.timeouts`). The :class:`World` (``"elastic"``, ``"torchrun"``,
``"single"``) is detected from the environment (:mod:`stalwart.elastic.worlds`).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stalwart.elastic.backup import BackupRound, Dynamic, Static
from stalwart.elastic.backup_job import BackupCommit, check_reduce
from stalwart.elastic.checkpointing import JobCheckpoint
from stalwart.elastic.commit import DEFAULT_GRAD_NORM_K, AllReduceCommit, CommitStrategy
from stalwart.elastic.events import EventLog, Finish, Start
from stalwart.elastic.follow_job import FollowHeal
from stalwart.elastic.groups import backend_for, build_solo_group, shard_mesh
from stalwart.elastic.ledger import Listener, StepLedger
from stalwart.elastic.optimizer import ElasticOptimizer
from stalwart.elastic.reduce import REDUCTIONS
from stalwart.elastic.worlds import World, coordinator_client, first_epoch, pick_device
from stalwart.environment import host_attributes
from stalwart.errors import ConfigError, DistributedError

__all__ = ["Job", "World"]

log = logging.getLogger(__name__)


class Job:
    """Join the job that started this process, and keep its members' state identical.

    Args:
        state: the replicated state (normally a :class:`stalwart.TrainingState`); its
            ``state_dict()`` is digested and sent to members that need it. With replica
            groups, each rank's part of it (FSDP2 DTensors hold their local shard).
        min_size: the fewest members (replica groups) to train with; below it, members wait
            for replacements.
        verify_every: compare digests every this many committed steps (0: only after heals).
        join_timeout_s: how long to wait for a membership epoch (None: derived from the
            timeout, :mod:`stalwart.elastic.timeouts`).
        stats_window: summarise step times every this many committed steps (``step-stats``
            events, and the launcher's straggler check; 0: off).
        world: ``"elastic"``, ``"torchrun"`` or ``"single"`` (:class:`World`); None: detected
            from the environment (:meth:`World.detect`).
        group_size: ranks per replica group (None: ``stalwart run --group-size``, else 1).
        timeout_s: the one timeout (None: ``stalwart run --timeout``, else 10 s); the
            collective and join timeouts derive from it.
        device: the device of the collectives, which picks the backend (gloo on CPU, NCCL on
            CUDA); None: the device of the state's first tensor. ``"cuda"`` without an index
            is this worker's device slot (``job.device``).
        checkpoint: a Checkpointer or TieredCheckpointer: the job resumes from it by itself
            when no live member holds the committed state, and saves on its schedule
            (:mod:`stalwart.elastic.checkpointing`). Under ``stalwart run`` its default
            process group is the replica group (each group's ranks save their shards).
        save_every: a plain Checkpointer's interval, committed steps (tiers have their own).
        warmup: run by a replacement before it announces itself (a backward on zeros, say).
        follow: a replacement heals while the survivors commit, then joins with nothing to
            send (:mod:`stalwart.elastic.follow_job`; ``stalwart run``; groups: per shard).

    Attributes:
        ledger: the committed step and each step's outcome (:mod:`stalwart.elastic.ledger`).
        timeouts: the derived timeouts; device: the collectives' device.

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
        join_timeout_s: float | None = None,
        stats_window: int = 20,
        world: World | str | None = None,
        group_size: int | None = None,
        timeout_s: float | None = None,
        device: str | torch.device | None = None,
        checkpoint: Any = None,
        save_every: int = 100,
        warmup: Callable[[], object] | None = None,
        follow: bool = False,
    ) -> None:
        if min_size < 1 or verify_every < 0 or (group_size is not None and group_size < 1):
            raise ConfigError(
                f"Job(min_size={min_size}, verify_every={verify_every}, group_size={group_size})"
                ": min_size and group_size must be >= 1 and verify_every >= 0"
            )
        self.state, self.verify_every = state, verify_every
        self._reduce, self._closed, self._save_every = "mean", False, save_every
        self._strategy: CommitStrategy = AllReduceCommit()
        self._solo: dist.ProcessGroup | None = None  # a group of one, made on first use
        self.world = World.detect() if world is None else World(world)
        env, self.timeouts, membership = coordinator_client(
            self.world, min_size, timeout_s, join_timeout_s, warmup, announce=not follow
        )
        self.join_timeout_s = self.timeouts.join_s
        self.device = pick_device(device, state, membership.layout.local_rank if membership else 0)
        events = EventLog(env.events_dir if env else None, env.worker_id if env else 0)
        index = self.device.index if self.device.type == "cuda" else None
        events.record(Start(pid=os.getpid(), host=host_attributes(index)))
        self._follow = None if membership is None or not follow else FollowHeal(
            state, membership, self.timeouts.collective)  # fmt: skip
        start = first_epoch if self._follow is None else self._follow.first_epoch
        first, shard_group = start(self.world, membership, group_size, self.device,
                                   self.timeouts, timeout_s)  # fmt: skip
        self.ledger = StepLedger(
            state, events, membership, first, verify_every=verify_every,
            join_timeout_s=self.join_timeout_s, stats_window=stats_window, shard_group=shard_group,
        )  # fmt: skip
        self.ledger.follow = self._follow
        self.checkpoint = checkpoint
        self._start(first.number)

    def _start(self, first: int) -> None:
        """Join the first epoch (replica groups: at the first boundary), or start alone."""
        if self.ledger.membership is not None and first == 0:  # replica groups: join later
            self.ledger.flag_newer_epoch()
            atexit.register(self._close_at_exit)
        elif self.ledger.membership is not None:
            self.ledger.settle_after_join()
            atexit.register(self._close_at_exit)
        else:
            self.ledger.check_parity("start")
            self.ledger.resume_if_lost()  # a fixed world starts from its newest checkpoint
        self.ledger.mark_boundary()

    # -- what the training loop reads -------------------------------------------------------

    @property
    def step(self) -> int:
        """Committed steps; equal on every member at every step boundary."""
        return self.ledger.step

    @property
    def rank(self) -> int:
        """Data-parallel rank over every rank of the epoch: ``replica_rank * G + shard_rank``."""
        return self.ledger.epoch.rank * self.group_size + self.ledger.epoch.shard_rank

    @property
    def size(self) -> int:
        """Ranks in the current epoch (``replicas * group_size``; members without groups)."""
        return self.ledger.epoch.size * self.group_size

    @property
    def replica_rank(self) -> int:
        """This rank's replica group's index among the epoch's groups (its replicate rank)."""
        return self.ledger.epoch.rank

    @property
    def replicas(self) -> int:
        """Replica groups in the current epoch (members, without groups)."""
        return self.ledger.epoch.size

    @property
    def group_size(self) -> int:
        """Ranks per replica group (1: plain data parallelism)."""
        return self.ledger.group_size

    @property
    def shard_rank(self) -> int:
        """This rank's rank in its replica group (its shard index; 0 without groups)."""
        return self.ledger.epoch.shard_rank

    @property
    def shard_group(self) -> dist.ProcessGroup:
        """This replica group's ranks, an ordinary process group (one rank without groups)."""
        if self.ledger.shard_group is not None:
            return self.ledger.shard_group
        if self._solo is None:
            self._solo = build_solo_group(self.device)
        return self._solo

    @property
    def shard_mesh(self) -> Any:
        """:attr:`shard_group` as a 1-D ``DeviceMesh`` (``fully_shard(model, mesh=...)``)."""
        return shard_mesh(self.shard_group, self.device)

    @property
    def backend(self) -> str:
        """The collectives' backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA)."""
        return backend_for(self.device)

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

    @property
    def checkpoint(self) -> Any:
        """The tiers the job resumes from and saves to (settable before the first step)."""
        held = self.ledger.checkpoint
        return None if held is None else held.checkpoint

    @checkpoint.setter
    def checkpoint(self, checkpoint: Any) -> None:
        self.ledger.checkpoint = (
            None if checkpoint is None
            else JobCheckpoint(checkpoint, self.state, save_every=self._save_every)
        )  # fmt: skip

    def digest(self) -> str:
        """Hex digest of parameters, optimizer state, RNG and the committed step."""
        return self.ledger.digest()

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(event, step)`` at ``step-begin``, ``collective-enter``, ``commit`` (chaos)."""
        self.ledger.add_listener(fn)

    # -- wrapping the user's objects --------------------------------------------------------

    def data_parallel(
        self, model: nn.Module, *, reduce: str = "mean", grad_norm_k: float = DEFAULT_GRAD_NORM_K
    ) -> nn.Module:
        """Average ``model``'s floating-point buffers over the members at every commit.

        Every buffer (BatchNorm's too) is put back on a discard. :meth:`optimizer`'s ``step()``
        reduces gradients: ``reduce="mean"`` averages them (one all-reduce per step, with the
        buffers); ``"adasum"`` combines them by Adasum (:mod:`stalwart.elastic.reduce`).
        ``grad_norm_k``: the gradient-norm outlier factor of the in-reduction signals
        (:mod:`stalwart.elastic.commit`, docs/sdc.md; 0: off). Returns ``model`` itself.

        Raises:
            ConfigError: ``reduce`` unknown, or Adasum with backup or with replica groups.
        """
        if reduce not in REDUCTIONS:
            raise ConfigError(f"data_parallel(reduce={reduce!r}): use one of {REDUCTIONS}")
        if reduce != "mean" and self.group_size > 1:
            raise ConfigError(
                f"data_parallel(reduce={reduce!r}) with replica groups of {self.group_size}: "
                "Adasum combines whole tensors, a rank holds a shard; use reduce='mean'"
            )
        check_reduce(reduce, isinstance(self._strategy, BackupCommit))
        self._reduce = reduce
        if isinstance(self._strategy, AllReduceCommit):
            self._strategy = AllReduceCommit(reduce, grad_norm_k)
        self.ledger.use_buffers(list(model.buffers()))
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
        if backup != 0 and self.group_size > 1:
            raise ConfigError(
                "backup workers with replica groups are not supported: the groups commit "
                "together (backup=0), or run with --group-size 1"
            )
        backups = None
        if backup != 0 and self.ledger.membership is not None:
            backups = BackupRound(self.ledger.membership.store, backup)
            self._strategy = BackupCommit(backups)
        elif backup != 0 and self.size > 1:
            raise ConfigError("backup workers need the coordinator: run under `stalwart run`")
        self.ledger.params = [p for g in optimizer.param_groups for p in g["params"]]
        if self._follow is not None:  # a replacement follows here, then joins the epoch
            self._follow.use(optimizer, self.ledger, backups=backup != 0)
        return ElasticOptimizer(optimizer, self, backups)

    # -- the step ---------------------------------------------------------------------------

    def begin_step(self) -> None:
        """The step boundary: join a new epoch first if one is due."""
        if self._follow is not None:
            self._follow.boundary(self.ledger)  # rank 0 starts or forgets a follow
        if self.ledger.reconfigure_due:
            self.ledger.reconfigure()
        self.ledger.notify("step-begin")

    def refresh(self) -> None:
        """At a step boundary, join a newer epoch if the coordinator published one.

        Collective, at the same boundary on every member; e.g. to wait for replacements:
        ``while job.replicas < 3: job.refresh()``.
        """
        ledger = self.ledger
        if ledger.membership is None:
            return
        if not ledger.reconfigure_due:
            if self._follow is not None:
                self._follow.boundary(ledger)
            ledger.poll_epoch()
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

        A member whose last all-reduce failed is healed here first. Idempotent; run at exit.
        """
        if self._closed:
            return
        ledger = self.ledger
        if self._follow is not None:
            self._follow.close(ledger)
        if ledger.membership is not None:
            deadline = time.monotonic() + self.join_timeout_s
            while not ledger.agree_final():  # a rollback raises: the loop must train on
                if time.monotonic() > deadline:
                    raise DistributedError("members did not agree on the final step in time")
            final = self.digest()
            ledger.membership.finish(self.step, self.epoch)
            ledger.drop_group()
        else:
            final = self.digest()
        if ledger.checkpoint is not None:
            ledger.checkpoint.wait()  # the last saves land before the process leaves
        self._closed = True
        self._strategy.close()
        ledger.events.record(Finish(step=self.step, epoch=self.epoch, digest=final))
        ledger.events.close()
        atexit.unregister(self._close_at_exit)  # the exit hook would keep the closed Job alive

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
