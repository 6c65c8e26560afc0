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

A newcomer announced by the coordinator is noticed by rank 0 of the epoch, which raises a
flag inside the next gradient all-reduce: every member sees the same flag in the same reduced
buffer, so all of them change epoch after the same step.

Three modes, chosen from the environment:

* under ``stalwart run`` (``STALWART_ELASTIC_STORE`` set): elastic, as above;
* under ``torchrun`` (``RANK``/``WORLD_SIZE`` set): the default gloo process group, a fixed
  world; a failed collective raises :class:`~stalwart.errors.DistributedError`;
* otherwise: a world of one, no collectives.
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
from stalwart.elastic.backup_job import check_reduce, commit_with_backup
from stalwart.elastic.events import EventLog
from stalwart.elastic.membership import Epoch, Membership
from stalwart.elastic.optimizer import ElasticOptimizer
from stalwart.elastic.parity import Decision, ParityCheck, gather_digests
from stalwart.elastic.protocol import from_env
from stalwart.elastic.reduce import REDUCTIONS, reduce_
from stalwart.elastic.state import BoundarySnapshot, digest
from stalwart.elastic.stats import StepStats
from stalwart.errors import ConfigError, DistributedError

__all__ = ["Job"]

log = logging.getLogger(__name__)

Listener = Callable[[str, int], None]


def _fixed_epoch() -> Epoch:
    """The world of ``torchrun`` (default process group) or of a single process."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
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
    ) -> None:
        if min_size < 1 or verify_every < 0:
            raise ConfigError(
                f"Job(min_size={min_size}, verify_every={verify_every}): min_size must be >= 1 "
                "and verify_every >= 0"
            )
        self.state = state
        self.verify_every = verify_every
        self.join_timeout_s = join_timeout_s
        self._step = 0
        self._params: list[torch.Tensor] = []
        self._buffers: list[torch.Tensor] = []
        self._model_buffers: list[torch.Tensor] = []  # all of them: put back on a discard
        self._reduce = "mean"
        self._backups: BackupRound | None = None
        self._listeners: list[Listener] = []
        self._stats, self._own_s = StepStats(stats_window), 0.0
        self._needs_reconfigure = self._changed = self._closed = False
        env = from_env()
        self._membership = Membership(env, min_size) if env else None
        self._events = EventLog(env.events_dir if env else None, env.worker_id if env else 0)
        self._events.write("start", pid=os.getpid())
        self._parity = ParityCheck(state, self._events)
        if self._membership is not None:
            self._epoch = self._membership.join(0, join_timeout_s)
            self._settle_after_join()
            atexit.register(self._close_at_exit)
        else:
            self._epoch = _fixed_epoch()
            self._check_parity("start")
        self._mark_boundary()

    # -- what the training loop reads -------------------------------------------------------

    @property
    def step(self) -> int:
        """Committed steps; equal on every member at every step boundary."""
        return self._step

    @property
    def rank(self) -> int:
        """This member's rank in the current epoch (0 .. size-1)."""
        return self._epoch.rank

    @property
    def size(self) -> int:
        """Number of members in the current epoch."""
        return self._epoch.size

    @property
    def members(self) -> tuple[int, ...]:
        """Worker ids of the current epoch's members, ascending (rank = index)."""
        return self._epoch.members

    @property
    def epoch(self) -> int:
        """The current membership epoch (0 outside ``stalwart run``)."""
        return self._epoch.number

    @property
    def elastic(self) -> bool:
        """True under ``stalwart run`` (members may come and go)."""
        return self._membership is not None

    def digest(self) -> str:
        """Hex digest of parameters, optimizer state, RNG and the committed step."""
        return digest(self.state, self._step)

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(event, step)`` at ``step-begin``, ``collective-enter`` and ``commit``.

        Used by :mod:`stalwart.testing.chaos` to kill a member at an exact point.
        """
        self._listeners.append(fn)

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
        check_reduce(reduce, self._backups is not None)
        self._reduce = reduce
        self._model_buffers = list(model.buffers())
        self._buffers = [b for b in self._model_buffers if b.is_floating_point()]
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
        if backup != 0 and self._membership is not None:
            self._backups = BackupRound(self._membership.store, backup)
        elif backup != 0 and self.size > 1:
            raise ConfigError("backup workers need the coordinator: run under `stalwart run`")
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        return ElasticOptimizer(optimizer, self)

    # -- the step ---------------------------------------------------------------------------

    def _notify(self, event: str) -> None:
        for fn in self._listeners:
            fn(event, self._step)

    def _mark_boundary(self) -> None:
        self._rng = BoundarySnapshot(self.state, self._model_buffers)
        self._t0 = time.time()

    def begin_step(self) -> None:
        """The step boundary: join a new epoch first if one is due."""
        if self._needs_reconfigure:
            self._reconfigure()
        self._notify("step-begin")

    def refresh(self) -> None:
        """At a step boundary, join a newer epoch if the coordinator published one.

        Collective: every member calls it at the same boundary (``optimizer.step()`` does the
        same check for free inside its all-reduce). Use it to wait for replacements, e.g.
        ``while job.size < 3: job.refresh()`` before an evaluation.
        """
        if self._membership is None:
            return
        if not self._needs_reconfigure:
            flag = torch.tensor([self._change_flag()])
            try:
                if self._epoch.group is not None:
                    self._epoch.group.allreduce([flag]).wait()
            except RuntimeError as e:
                self._fault(e)
            self._needs_reconfigure = self._needs_reconfigure or float(flag[0]) > 0
        if self._needs_reconfigure:
            self._reconfigure()
        else:
            time.sleep(0.01)  # nothing new: callers poll in a loop

    def _change_flag(self) -> float:
        """1.0 when this member sees a newer epoch published (checked by rank 0 only)."""
        if self._membership is None or self.rank != 0:
            return 0.0  # a lost coordinator: followed, or DistributedError (membership.py)
        return 1.0 if self._membership.latest_epoch() > self.epoch else 0.0

    def commit(self, apply: Callable[[], Any]) -> Any:
        """Reduce gradients and buffers, then ``apply()`` if every member voted; else discard."""
        if self._needs_reconfigure:  # a step() without zero_grad() after a fault
            self._reconfigure()
        self._notify("collective-enter")
        self._own_s = time.time() - self._t0  # this member's own time (see stats.py)
        if self._backups is not None and self.size > 1:
            return commit_with_backup(self, self._backups, apply)
        control = torch.tensor([1.0, self._change_flag()])
        try:
            control = reduce_(self._params, self._buffers, control, self._epoch.group, self._reduce)
        except RuntimeError as e:
            self._discard(e)
            return None
        votes, change = float(control[0]), float(control[1])
        if votes < self.size:  # cannot happen with gloo SUM; kept as the commit rule
            self._discard(DistributedError(f"{votes:g} of {self.size} votes"))
            return None
        result = apply()
        self._step += 1
        self._needs_reconfigure = self._needs_reconfigure or change > 0
        self._after_commit()
        return result

    def _after_commit(self) -> None:
        digest_hex = None
        if self.verify_every and self._step % self.verify_every == 0:
            try:
                digest_hex = self._check_parity("periodic")
            except RuntimeError as e:  # a peer died after the commit: next boundary heals
                if isinstance(e, DistributedError):
                    raise
                self._fault(e)
        dt = time.time() - self._t0
        self._events.write(
            "step", step=self._step, committed=True, epoch=self.epoch,
            members=list(self.members), dt=dt, digest=digest_hex,
        )  # fmt: skip
        window = self._stats.add(self._own_s, dt, self._step)
        if window is not None:
            self._events.write("step-stats", **window)
            if self._membership is not None:
                self._membership.publish_stats(window)
        if self._changed:
            self._events.write("first-commit-after-change", step=self._step, epoch=self.epoch)
            self._changed = False
        if self._membership is not None and self.rank == 0:
            self._membership.record_progress(self._step)
        self._notify("commit")
        self._mark_boundary()

    def _discard(self, err: BaseException) -> None:
        self._rng.restore()
        self._events.write(
            "step", step=self._step, committed=False, epoch=self.epoch,
            members=list(self.members), dt=time.time() - self._t0,
        )  # fmt: skip
        self._fault(err)
        self._mark_boundary()

    def _fault(self, err: BaseException) -> None:
        if self._membership is None:
            raise DistributedError(
                f"a collective failed in a fixed world (torchrun or one process): {err}; "
                "run the script with `stalwart run` to survive member failures"
            ) from err
        log.warning("epoch %d: collective failed at step %d: %s", self.epoch, self._step, err)
        self._events.write("fault-detected", step=self._step, epoch=self.epoch,
                           members=list(self.members), error=str(err)[:200])  # fmt: skip
        self._membership.report_fault(self.epoch)
        self._epoch = Epoch(self.epoch, self.members, self.rank, None)  # closes our sockets
        self._needs_reconfigure = True

    # -- membership and parity --------------------------------------------------------------

    def _reconfigure(self) -> None:
        assert self._membership is not None
        old = self.epoch
        self._epoch = Epoch(old, self.members, self.rank, None)  # drop the old group first
        self._epoch = self._membership.join(old, self.join_timeout_s)
        self._settle_after_join()
        self._mark_boundary()

    def _settle_after_join(self) -> None:
        """Reconcile in a freshly joined epoch; a failure moves on to the next epoch."""
        assert self._membership is not None
        while True:
            self._events.write("reconfigured", step=self._step, epoch=self.epoch,
                               members=list(self.members))  # fmt: skip
            try:
                self._check_parity("heal")
            except RuntimeError as e:
                if isinstance(e, DistributedError):
                    raise
                self._fault(e)
                self._epoch = self._membership.join(self.epoch, self.join_timeout_s)
                continue
            if self._parity.last_decision is not Decision.ROLLBACK:  # rolled back on purpose
                self._membership.check_progress(self._step, self.epoch)
            self._needs_reconfigure, self._changed = False, True
            return

    def _check_parity(self, why: str) -> str:
        """Reconcile members (see :mod:`stalwart.elastic.parity`); returns the common digest."""
        self._step = self._parity.run(self._step, self._epoch, why)
        return self.digest()

    # -- the end ----------------------------------------------------------------------------

    def close(self) -> None:
        """Agree with the other members that everyone finished at the same step, then leave.

        A member whose copy of the last all-reduce failed is healed here, so that no member
        leaves with a state the others do not have. Idempotent once done; run at exit if forgotten.
        """
        if self._closed:
            return
        if self._membership is not None:
            deadline = time.monotonic() + self.join_timeout_s
            while not self._agree_final():  # a rollback raises: the loop must train on
                if time.monotonic() > deadline:
                    raise DistributedError("members did not agree on the final step in time")
            final = self.digest()
            self._membership.finish(self._step, self.epoch)
            self._epoch = Epoch(self.epoch, self.members, self.rank, None)
        else:
            final = self.digest()
        self._closed = True
        self._events.write("finish", step=self._step, epoch=self.epoch, digest=final)
        self._events.close()

    def _agree_final(self) -> bool:
        if self._needs_reconfigure:
            self._reconfigure()
        try:
            table = gather_digests(self._step, self.digest(), self._epoch.group)
            if len(set(table)) == 1:
                return True
            self._check_parity("final")
            if self._parity.last_decision is Decision.ROLLBACK:
                raise DistributedError(
                    f"no majority at the final step: rolled back to step {self._step}, the last "
                    "agreed; train on to the total and call close() again (or make verify_every "
                    "divide the total steps, so that the check runs inside the training loop)"
                )
        except RuntimeError as e:
            if isinstance(e, DistributedError):
                raise
            self._fault(e)
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
