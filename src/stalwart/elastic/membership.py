"""A worker's side of membership: announce itself, wait for an epoch, build its group.

Membership epochs are published by the coordinator (``stalwart run``); a worker never decides
who is in. Building epoch ``n``'s gloo group is guarded by one decision on the store, so that
either every listed member builds it or none does:

1. each member adds 1 to ``epoch{n}/arrived``; the member whose add completes the count writes
   ``fate = "go"`` with ``compare_set``;
2. a member still waiting that sees a newer epoch published (or waits past the timeout)
   writes ``fate = "abandon"`` with ``compare_set``;
3. ``compare_set`` returns the value that won, and every member follows it.

So a member never builds a group that another member abandoned (which would cost a full gloo
timeout), and a member that dies before arriving only costs the time until the coordinator
publishes the next epoch.

**Replica groups** (``--group-size G``, :mod:`stalwart.elastic.groups`): an epoch also lists
its groups (``coord/epoch{n}/groups``, each its worker ids by rank in the group); every
member of the epoch arrives as above, then rank ``i`` of each group builds the replicate
group of shard ``i`` (``PrefixStore(f"epoch{n}/shard{i}", store)``), its rank there the
index of its group in the epoch. The epoch's ``rank`` and ``size`` are then those of the
replicate dimension.

**Coordinator loss.** A store call that fails on the connection (the store's host died) makes
the worker look for a re-hosted coordinator: ``stalwart run`` writes the store's address to
``STALWART_ELASTIC_STORE_FILE``, and a launcher that re-hosts the store writes the new one
there after publishing the next epoch on it. The worker connects to it, announces itself again
and carries on (the epoch change heals nobody's state away: members keep their memory, and
parity is checked as after any change). When no new address appears within the epoch timeout,
it raises :class:`~stalwart.errors.DistributedError` saying that the coordinator is gone.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.distributed import PrefixStore, Store, TCPStore

from stalwart.elastic.groups import Layout, all_or_none, build_group, read_layout
from stalwart.elastic.heartbeat import Heartbeat
from stalwart.elastic.protocol import WorkerEnv, decode, encode, keys, read_address
from stalwart.elastic.timeouts import Timeouts
from stalwart.errors import DistributedError

__all__ = ["Epoch", "Membership"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

_POLL_S = 0.005


@dataclass(frozen=True)
class Epoch:
    """One membership epoch as this worker joined it.

    Attributes:
        number: the epoch number (increasing, published by the coordinator).
        members: worker ids, ascending; without replica groups a member's rank is its index.
        rank: this worker's rank in the replicate dimension: its index in ``members``, or
            with replica groups its group's index in ``groups``.
        group: the epoch's replicate process group (gloo, or a watched NCCL group; None
            when it has one member).
        groups: the replica groups, each its worker ids by rank in the group (empty: none).
        shard_rank: this worker's rank in its replica group (0 without groups).
    """

    number: int
    members: tuple[int, ...]
    rank: int
    group: Any
    groups: tuple[tuple[int, ...], ...] = ()
    shard_rank: int = 0

    @property
    def size(self) -> int:
        """Members of the replicate dimension (replica groups, or workers without groups)."""
        return len(self.groups) if self.groups else len(self.members)

    def worker(self, replica: int) -> int:
        """The worker id at replicate rank ``replica`` holding this worker's shard."""
        return self.groups[replica][self.shard_rank] if self.groups else self.members[replica]

    def without_group(self) -> Epoch:
        """This epoch with its process group forgotten (after a fault)."""
        return Epoch(self.number, self.members, self.rank, None, self.groups, self.shard_rank)


class Membership:
    """The coordinator client of one worker.

    Args:
        env: the settings ``stalwart run`` gave this worker.
        min_size: the fewest members (replica groups) this worker trains with (told to the
            coordinator).
        timeouts: the job's timeouts (default: derived from ``env``).
        device: the device of the replicate group's collectives (gloo: CPU; CUDA: NCCL).
        warmup: ``Job(warmup=...)``: called before announcing when the job already committed
            steps without this worker (a replacement, whose state the heal overwrites), so
            that its first-step costs (a cold first backward) are paid while the others train.
        announce: tell the coordinator this worker is ready at once (False: the caller calls
            :meth:`announce` later, a replacement that follows first, :mod:`.follow_job`).

    Attributes:
        layout: this worker's place in its replica group (the launcher's record).
        shard_group: the replica group's own process group, set by the job when groups have
            more than one rank: a replicate group is built by all of a group's ranks or none.
    """

    def __init__(self, env: WorkerEnv, min_size: int, *, timeouts: Timeouts | None = None,
                 device: torch.device | None = None,
                 warmup: Callable[[], object] | None = None,
                 announce: bool = True) -> None:  # fmt: skip
        self.env = env
        self.wid = env.worker_id
        self.min_size = min_size
        self.timeouts = timeouts or Timeouts(timeout_s=env.timeout_s, hang_override_s=env.hang_s)
        self.device = device or torch.device("cpu")
        self.address = (env.host, env.port)
        self.moves = 0  # re-hosted coordinators followed
        self.store: Store = self._connect(self.address)
        self.layout: Layout = read_layout(self.store, self.wid)
        self.shard_group: Any = None
        self.heartbeat = Heartbeat(env)  # before announcing: the launcher watches from then on
        self.warmup: Callable[[], object] | None = None  # a replacement group's, deferred
        if warmup is not None and self.progress() > 0:  # paid while the others still train
            self.warmup = warmup
            if self.layout.group_size > 1:  # its model is sharded on the group's mesh after
                announce = False  # the job is built: warm up and announce at the first join
            else:
                self.warm_up(announce=False)
        self.announced = False
        if announce:
            self.announce()

    def warm_up(self, *, announce: bool) -> None:
        """Run the replacement's warm-up (``Job(warmup=...)``) once, if one is due; then
        announce this worker if ``announce`` (with replica groups the warm-up waits for the
        model, sharded on the group's mesh: :meth:`join` runs it, or the follow before it)."""
        fn, self.warmup = self.warmup, None
        if fn is not None:
            started = time.perf_counter()
            fn()
            log.info("worker %d warmed up in %.2f s", self.wid, time.perf_counter() - started)
        if announce and not self.announced:
            self.announce()

    def _connect(self, address: tuple[str, int]) -> Store:
        host, port = address
        return TCPStore(host, port, is_master=False, timeout=self.timeouts.collective,
                        wait_for_workers=False)  # fmt: skip

    def announce(self) -> None:
        """Tell the coordinator this worker is ready: the next epoch lists it."""
        self.announced = True
        layout = self.layout
        record = encode({"pid": os.getpid(), "min_size": self.min_size,
                         "group": layout.group, "group_rank": layout.group_rank})  # fmt: skip
        self.store.set(keys.ready(self.wid), record)  # type: ignore[arg-type]  # the stub says str; bytes are accepted
        # A TCPStore set is not answered; a check on the same connection is, after it: on
        # return the coordinator (another connection) sees this worker as ready.
        self.store.check([keys.ready(self.wid)])

    def follow_coordinator(self, err: BaseException) -> None:
        """The store failed with ``err``: connect to a re-hosted coordinator if one appears.

        Waits up to the epoch timeout for a new address in ``env.store_file``.

        Raises:
            DistributedError: none appeared: the coordinator (the launcher or its host) is gone.
        """
        log.warning("worker %d: the coordinator at %s:%d failed (%s); looking for a new one",
                    self.wid, *self.address, err)  # fmt: skip
        deadline = time.monotonic() + self.timeouts.collective_s
        while time.monotonic() < deadline:
            address = read_address(self.env.store_file)
            if address is not None and address != self.address:
                try:
                    self.store = self._connect(address)
                    if self.announced:
                        self.announce()
                except RuntimeError:  # not up yet, or gone again: keep looking
                    time.sleep(_POLL_S)
                    continue
                self.address, self.moves = address, self.moves + 1
                log.warning("worker %d: following the coordinator to %s:%d", self.wid, *address)
                return
            time.sleep(10 * _POLL_S)
        where = f" in {self.env.store_file}" if self.env.store_file else ""
        raise DistributedError(
            f"worker {self.wid}: the coordinator at {self.address[0]}:{self.address[1]} is gone "
            f"({err}) and no re-hosted coordinator was announced{where} within "
            f"{self.timeouts.collective_s:.0f} s: the `stalwart run` launcher or its host died. "
            "This member stops; run the job again with `stalwart run`, resuming from your last "
            "checkpoint"
        ) from err

    def publish_stats(self, window: dict[str, object]) -> None:
        """Publish a step-time window for the launcher's straggler check (one store write)."""
        try:
            self.store.set(keys.stats(self.wid), encode(window))  # type: ignore[arg-type]  # the stub says str; bytes are accepted
        except RuntimeError as e:  # the coordinator is gone: nobody compares any more
            log.warning("could not publish step-time statistics: %s", e)

    def _following(self, op: Callable[[], _T]) -> _T:
        """``op()``, a store operation, again on a re-hosted coordinator whenever the store's
        host is gone (:meth:`follow_coordinator` raises when none appears)."""
        while True:
            try:
                return op()
            except RuntimeError as e:  # DistNetworkError: the store's host is gone
                self.follow_coordinator(e)

    def _count(self, key: str) -> int:
        """The number stored under ``key`` (0: none yet)."""
        return int(self.store.get(key)) if self.store.check([key]) else 0

    def record_progress(self, step: int) -> None:
        """Record the job's newest committed step (one store write, by the lowest rank)."""
        self._following(lambda: self.store.set(keys.PROGRESS, str(step)))

    def progress(self) -> int:
        """The newest step the job is known to have committed (0: none recorded)."""
        return self._following(lambda: self._count(keys.PROGRESS))

    def report_fatal(self, error: str) -> None:
        """Tell the launcher that the job cannot go on (it stops at once, exit code 3).

        For errors no replacement worker can fix (nothing to resume from): the first report
        wins; the launcher prints it and stops respawning.
        """
        record = encode({"wid": self.wid, "error": error[:2000]})
        try:
            self.store.compare_set(keys.FATAL, "", record)  # type: ignore[arg-type]  # bytes are accepted
        except RuntimeError as e:  # the coordinator is gone: the error is raised here anyway
            log.warning("could not report a fatal error to the coordinator: %s", e)

    def check_progress(self, step: int, epoch: int) -> None:
        """Refuse to train on from step 0 when the job had committed steps and every member
        that held them died before a newcomer could heal from it (no checkpoint attached).

        Raises:
            DistributedError: the members of ``epoch`` hold step 0 but the job reached a later
                step; nothing in memory holds it any more (also reported as fatal).
        """
        if step > 0:
            return
        reached = self.progress()
        if reached > 0:
            err = DistributedError(
                f"worker {self.wid}: epoch {epoch} formed at step 0, but the job had committed "
                f"step {reached} and every member holding that state died before a replacement "
                "could heal from it; training on would silently start over. Attach checkpoint "
                "tiers (Job(state, checkpoint=...)) so that the job resumes from the last "
                "durable checkpoint by itself, or keep more workers alive"
            )
            self.report_fatal(str(err))
            raise err

    def latest_epoch(self) -> int:
        """The newest published epoch number (0: none yet)."""
        return self._following(lambda: self._count(keys.EPOCH))

    def report_fault(self, epoch: int) -> None:
        """Tell the coordinator that a collective of ``epoch`` failed here."""
        try:
            self.store.add(keys.faults(epoch), 1)
        except RuntimeError as e:  # the coordinator is gone: nothing left to tell
            log.warning("could not report a fault of epoch %d to the coordinator: %s", epoch, e)

    def finish(self, step: int, epoch: int) -> None:
        """Record that this worker finished at ``step``, agreed with the members of ``epoch``."""
        record = encode({"step": step, "epoch": epoch})
        self._following(lambda: self.store.set(keys.done(self.wid), record))  # type: ignore[arg-type]  # the stub says str; bytes are accepted

    def join(self, after: int, deadline_s: float) -> Epoch:
        """Join the first epoch newer than ``after`` that lists this worker and forms.

        Raises:
            DistributedError: no epoch formed within ``deadline_s`` seconds.
        """
        if self.warmup is not None:  # a replacement group's, deferred until its model exists
            self.warm_up(announce=True)
        deadline = time.monotonic() + deadline_s
        floor = after
        while time.monotonic() < deadline:
            try:
                number = self._wait_newer(floor, deadline)
                members = tuple(decode(self.store.get(keys.members(number))))
                floor = number
                if self.wid not in members or not self._arrive(number, len(members), deadline):
                    continue
            except RuntimeError as e:
                if isinstance(e, DistributedError):
                    raise
                self.follow_coordinator(e)  # then look for the next epoch on the new store
                continue
            try:
                groups, rank = self._place(number, members)
                size = len(groups) if groups else len(members)
                build = functools.partial(self._build_group, number, rank, size)
                group = all_or_none(self.shard_group, build)
            except RuntimeError as e:  # a member died while the group was being built
                log.warning(
                    "epoch %d: building the group failed (%s); waiting for the next", number, e
                )
                self.report_fault(number)
                continue
            return Epoch(number, members, rank, group, groups, self.layout.group_rank)
        raise DistributedError(
            f"worker {self.wid} found no membership epoch to join within {deadline_s:.0f} s "
            f"(last seen: epoch {floor}); check that `stalwart run` is alive and that enough "
            "workers are running for --min-size"
        )

    def _wait_newer(self, floor: int, deadline: float) -> int:
        while time.monotonic() < deadline:
            latest = self.latest_epoch()
            if latest > floor:
                return latest
            time.sleep(_POLL_S)
        raise DistributedError(
            f"worker {self.wid}: no membership epoch after {floor} was published in time; "
            "check that `stalwart run` is alive"
        )

    def _arrive(self, number: int, size: int, deadline: float) -> bool:
        """Run the arrival protocol of the module docstring; True when the group is to be built.

        A member that has not arrived within the epoch timeout is taken for hung: the epoch is
        abandoned and reported as faulty, and the coordinator excludes whoever never arrived.
        """
        self.store.set(keys.arrival(number, self.wid), b"1")  # type: ignore[arg-type]  # the stub says str; bytes are accepted
        arrived = self.store.add(keys.arrived(number), 1)
        fate_key = keys.fate(number)
        if arrived >= size:
            return self._decide(fate_key, "go")
        hung_after = time.monotonic() + self.timeouts.collective_s
        while True:
            if self.store.check([fate_key]):
                return self.store.get(fate_key).decode() == "go"
            if self.latest_epoch() > number:
                return self._decide(fate_key, "abandon")
            if time.monotonic() > min(deadline, hung_after):
                go = self._decide(fate_key, "abandon")
                if not go:
                    self.report_fault(number)
                return go
            time.sleep(_POLL_S)

    def _decide(self, fate_key: str, wish: str) -> bool:
        won = self.store.compare_set(fate_key, "", wish)
        return bytes(won).decode() == "go"

    def _place(
        self, number: int, members: tuple[int, ...]
    ) -> tuple[tuple[tuple[int, ...], ...], int]:
        """The epoch's replica groups (empty without) and this worker's replicate rank."""
        if self.layout.group_size == 1:
            return (), members.index(self.wid)
        groups = tuple(tuple(g) for g in decode(self.store.get(keys.groups(number))))
        for index, group in enumerate(groups):
            if self.wid in group:
                if group.index(self.wid) != self.layout.group_rank:
                    raise DistributedError(
                        f"epoch {number} lists worker {self.wid} at rank {group.index(self.wid)} "
                        f"of its group, but it is rank {self.layout.group_rank}: the launcher's "
                        "records disagree; restart the job"
                    )
                return groups, index
        raise DistributedError(f"epoch {number} lists worker {self.wid} in no replica group")

    def _build_group(self, number: int, rank: int, size: int) -> Any:
        """The replicate group of ``number`` (gloo or watched NCCL, :mod:`.groups`)."""
        prefix = f"epoch{number}"
        if self.layout.group_size > 1:
            prefix += f"/shard{self.layout.group_rank}"
        return build_group(
            PrefixStore(prefix, self.store), rank, size, device=self.device,
            timeout=self.timeouts.collective, patience_s=self.timeouts.heartbeat_s,
            abandon=lambda: self.latest_epoch() > number,
        )  # fmt: skip
