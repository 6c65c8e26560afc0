"""The recovery ladder: every member resumes together from the newest step that verifies.

When no live member holds the committed state (every holder died, or the whole job was
restarted), the state must come from the checkpoint tiers, and every member must come back
at the *same* step: a member resuming at another step than its peers would train a state
nobody else has. :class:`RecoveryLadder` does that, collectively over the job's process group:

1. **List.** Each member lists the steps each tier holds for it: the memory tier's snapshots
   (in this process, or on a tmpfs ``keep_in`` folder that outlived a crashed process), then
   each durable tier (local disk, remote) in the order the
   :class:`~stalwart.checkpoint.TieredCheckpointer` was given them; a plain
   :class:`~stalwart.checkpoint.Checkpointer` is one durable tier.
2. **Agree on the order.** One all-gather of the listings; every member orders the same
   candidates the same way: newest step first, and for one step the fastest tier first. A
   candidate (step, tier) that some member does not hold is skipped (recorded as rejected),
   unless the state is ``replicated`` (below).
3. **Load and verify, together.** Every member loads the candidate (a memory snapshot is
   checked against its digest, a durable step's chunks against their checksums as they are
   read) and the outcomes are all-gathered: when every member loaded it, that is the step;
   when any member failed, *every* member moves on to the next candidate (the same step from
   a slower tier, or an older step), so members never end on different steps.
4. **Report.** A :class:`LadderReport`: the step resumed, the tier, the steps lost (the last
   committed step known minus the step resumed), the candidates rejected and why. When
   nothing verifies, every member raises the same
   :class:`~stalwart.errors.CheckpointNotFoundError`, naming what was tried.

**Replicated state** (data parallelism: every member holds the whole state). With
``replicated=True`` a candidate needs one holder, not all: the holders load it, the lowest
rank that verified sends it to every other member peer to peer
(:func:`~stalwart.elastic.state.send_state`), so the snapshot kept in one surviving node's
memory serves a job whose other nodes were replaced. Without it each member must load its
own copy. **Replica groups** (``shard_group``): the members are every rank of every group,
member ``replica * G + shard``; a candidate must verify for every shard, and ``replicated``
shares shard ``i`` along the replicate group (rank ``i`` of each group) only.

A state that does not fit a checkpoint (other keys, shapes, dtypes) is not a fault to climb
past: :class:`~stalwart.errors.StateMismatchError` is raised on every member at once. Neither
is an unexpected error (a bug): it is raised on every member, naming the rank it came from.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from stalwart.checkpoint import Checkpointer, TieredCheckpointer
from stalwart.elastic.groups import device_of
from stalwart.elastic.rungs import Rung, rungs_of
from stalwart.elastic.state import receive_state, send_state
from stalwart.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    DistributedError,
    StateMismatchError,
    StorageError,
)

__all__ = ["LadderReport", "RecoveryLadder", "RejectedStep"]

log = logging.getLogger(__name__)

_SHOWN = 8  # rejected candidates spelled out in an error message


@dataclass(frozen=True)
class RejectedStep:
    """A candidate the ladder passed over.

    Attributes:
        step: the step (None: the tier could not even be listed).
        tier: the tier's name.
        ranks: the members it failed on, or that lacked it (member indices: the rank, or
            ``replica * G + shard`` with replica groups of ``G``).
        reason: why, in words (the first failing member's error).
    """

    step: int | None
    tier: str
    ranks: tuple[int, ...]
    reason: str

    def __str__(self) -> str:
        what = f"step {self.step}" if self.step is not None else "listing"
        return f"{what} ({self.tier}) on rank(s) {list(self.ranks)}: {self.reason}"


@dataclass(frozen=True)
class LadderReport:
    """Where every member's state came from; the same on every member but ``source``.

    Attributes:
        step: the step every member resumed at.
        tier: the tier it was loaded from.
        steps_lost: the last committed step known minus ``step``.
        last_known: the newest step known to have committed: the caller's
            ``last_committed``, or the newest step any tier listed, whichever is newer.
        rejected: the candidates passed over, newest first.
        source: the member that sent this member the state (replicated), else None.
        seconds: wall time on this member.
    """

    step: int
    tier: str
    steps_lost: int
    last_known: int
    rejected: tuple[RejectedStep, ...] = ()
    source: int | None = None
    seconds: float = field(default=0.0, compare=False)


class _Members:
    """The job's members for the ladder's few collectives: replicas x shards, or one process.

    A member's index is ``replica * shards + shard`` (its replica group's ranks are
    consecutive); without shard groups it is the member's rank in ``group``.
    """

    def __init__(self, group: dist.ProcessGroup | None, shard_group: Any = None) -> None:
        self.group, self.shard_group = group, shard_group
        self.replica, self.replicas = (group.rank(), group.size()) if group else (0, 1)
        self.shard: int = shard_group.rank() if shard_group is not None else 0
        self.shards: int = shard_group.size() if shard_group is not None else 1
        self.index = self.replica * self.shards + self.shard
        self.size = self.replicas * self.shards

    def all_gather(self, obj: Any) -> list[Any]:
        """Every member's JSON-able ``obj``, by member index (replicate dimension, then shard)."""
        by_replica = _gather_json(self.group, obj)
        by_shard = _gather_json(self.shard_group, by_replica)
        return [by_shard[s][r] for r in range(self.replicas) for s in range(self.shards)]

    def covered(self, members: list[int]) -> bool:
        """Whether ``members`` hold one replica at least of every shard."""
        return all(
            any(r * self.shards + s in members for r in range(self.replicas))
            for s in range(self.shards)
        )

    def column(self, members: list[int]) -> list[int]:
        """The replicas of this member's shard among ``members``."""
        return [r for r in range(self.replicas) if r * self.shards + self.shard in members]


def _gather_json(group: Any, obj: Any) -> list[Any]:
    """``obj`` from every rank of ``group`` (None: this process alone), as JSON bytes."""
    if group is None or group.size() == 1:
        return [obj]
    device, size = device_of(group), group.size()
    raw = json.dumps(obj, separators=(",", ":")).encode()
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
    mine = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    group.allgather([lengths], [mine]).wait()
    width = max(int(t.item()) for t in lengths)
    data = torch.zeros(width, dtype=torch.uint8)
    data[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(size)]
    group.allgather([out], [data.to(device)]).wait()
    return [
        json.loads(bytes(t[: int(n.item())].cpu().numpy()).decode())
        for t, n in zip(out, lengths, strict=True)
    ]


def _outcome(err: BaseException) -> tuple[str, str]:
    """``("bad", why)`` for a damaged or missing copy (climb on); ``("fatal", why)`` else."""
    why = f"{type(err).__name__}: {err}"[:300]
    if isinstance(err, StateMismatchError):
        return "fatal", why
    if isinstance(err, (CheckpointError, StorageError, DistributedError)):
        return "bad", why
    return "fatal", why


class RecoveryLadder:
    """Resume every member of a job from the newest step that verifies in the checkpoint tiers.

    Args:
        checkpoint: a :class:`~stalwart.checkpoint.Checkpointer` (one durable tier) or a
            :class:`~stalwart.checkpoint.TieredCheckpointer` (memory, then its durable tiers
            in order).
        replicated: every member holds the whole state (data parallelism): a step one member
            verified is sent to the others (module docstring).

    Example:
        >>> ladder = RecoveryLadder(tiered, replicated=True)  # doctest: +SKIP
        >>> report = ladder.resume(state, job_group, last_committed=120)
        >>> report.step, report.tier, report.steps_lost
        (100, 'local', 20)
    """

    def __init__(
        self, checkpoint: Checkpointer | TieredCheckpointer, *, replicated: bool = False
    ) -> None:
        self.checkpoint = checkpoint
        self.replicated = replicated
        self._rungs: list[Rung] = rungs_of(checkpoint)

    @property
    def tiers(self) -> list[str]:
        """The tiers' names, fastest first: the order in which one step is tried."""
        return [r.name for r in self._rungs]

    def listing(self) -> tuple[dict[str, list[int]], dict[str, str]]:
        """This member's steps per tier, and the tiers that could not be listed (and why)."""
        try:
            self.checkpoint.wait()  # saves in flight land (or fail) before anything is listed
        except (CheckpointError, StorageError) as e:
            log.warning("a checkpoint save in flight failed before recovery: %s", e)
        steps: dict[str, list[int]] = {}
        errors: dict[str, str] = {}
        for rung in self._rungs:
            try:
                steps[rung.name] = sorted({int(s) for s in rung.steps()})
            except (CheckpointError, StorageError) as e:  # e.g. a remote store unreachable
                steps[rung.name], errors[rung.name] = [], f"{type(e).__name__}: {e}"[:300]
        return steps, errors

    def resume(
        self,
        state: Any,
        group: dist.ProcessGroup | None = None,
        *,
        shard_group: Any = None,
        last_committed: int | None = None,
    ) -> LadderReport | None:
        """Load the newest step every member can load and verify into ``state``, in place.

        Collective: every member of the job calls it, with the same ``last_committed``.

        Args:
            state: this member's state (a stateful object such as
                :class:`~stalwart.TrainingState`, or a tree of tensors).
            group: the job's current (replicate) process group (None: one replica).
            shard_group: with replica groups, this member's own group (the shard
                dimension); the members are then every rank of every group, a candidate
                must verify for every shard, and ``replicated`` shares along ``group``.
            last_committed: the newest step the job is known to have committed (the
                coordinator's record), for ``steps_lost``; None when unknown.

        Returns:
            The report; None when no tier lists any step on any member and no step is known
            to have committed (a new job: nothing to resume, start from step 0).

        Raises:
            CheckpointNotFoundError: nothing verifies on every member (the message lists
                every candidate tried and why it was passed over), or nothing is stored
                although ``last_committed`` > 0.
            StateMismatchError: the state does not fit a stored step (every member raises).
            DistributedError: a member failed unexpectedly (every member raises).
        """
        t0 = time.perf_counter()
        members = _Members(group, shard_group)
        steps, errors = self.listing()
        table = members.all_gather({"steps": steps, "errors": errors})
        rejected = _listing_rejections(table)
        listed = [s for row in table for ss in row["steps"].values() for s in ss]
        last_known = max([*listed, last_committed or 0])
        if not listed:
            if not last_committed:
                return None
            raise self._nothing(rejected, f"the job committed step {last_committed}")
        found = self._climb(table, state, members, rejected)
        if found is None:
            raise self._nothing(rejected, f"{len(listed)} stored copies were listed")
        step, tier, source = found
        report = LadderReport(step, tier, last_known - step, last_known, tuple(rejected),
                              source, time.perf_counter() - t0)  # fmt: skip
        log.warning("recovered step %d from %s (%d steps lost; %d candidates rejected)",
                    step, tier, report.steps_lost, len(rejected))  # fmt: skip
        return report

    def _climb(
        self, table: list[dict[str, Any]], state: Any, members: _Members,
        rejected: list[RejectedStep],
    ) -> tuple[int, str, int | None] | None:  # fmt: skip
        """Try the candidates in order, together; (step, tier, source) of the first that
        every member loaded (or, replicated, one member loaded and sent); None: none did."""
        for step, tier in self._candidates(table):
            holders = [r for r, row in enumerate(table) if step in row["steps"][tier]]
            if not (members.covered(holders) if self.replicated else len(holders) == members.size):
                why = f"held by rank(s) {holders} of {members.size} only"
                missing = tuple(r for r in range(members.size) if r not in holders)
                rejected.append(RejectedStep(step, tier, missing, why))
                continue
            kind, why = self._try(step, tier, state, members.index in holders)
            outcomes = members.all_gather([kind, why])
            _raise_fatal(outcomes, step, tier)
            ok = [r for r, (k, _) in enumerate(outcomes) if k == "ok"]
            if len(ok) == members.size or (self.replicated and members.covered(ok)):
                return step, tier, self._share(state, step, ok, members)
            bad = [(r, w) for r, (k, w) in enumerate(outcomes) if k == "bad"]
            rejected.append(RejectedStep(step, tier, tuple(r for r, _ in bad), bad[0][1]))
        return None

    def _candidates(self, table: list[dict[str, Any]]) -> list[tuple[int, str]]:
        """Every (step, tier) any member listed: newest step first, then fastest tier."""
        order = {name: i for i, name in enumerate(self.tiers)}
        pairs = {(s, t) for row in table for t, ss in row["steps"].items() for s in ss}
        return sorted(pairs, key=lambda p: (-p[0], order[p[1]]))

    def _try(self, step: int, tier: str, state: Any, holds: bool) -> tuple[str, str]:
        if not holds:
            return "absent", ""
        rung = self._rungs[self.tiers.index(tier)]
        try:
            rung.load(step, state)
        except Exception as e:  # classified, then every member hears of it (no one hangs)
            log.warning("step %d from %s does not load here: %s", step, tier, e)
            return _outcome(e)
        return "ok", ""

    def _share(self, state: Any, step: int, ok: list[int], members: _Members) -> int | None:
        """Replicated: per shard, the lowest replica that verified sends to the others.

        Returns the member index this member received from (None: it loaded its own).
        """
        column = members.column(ok)  # replicas of this member's shard that loaded it
        if len(column) == members.replicas or members.group is None:
            return None
        src = min(column)
        if members.replica == src:
            send_state(state, step, src, members.group)
            return None
        receive_state(state, src, members.group, load=members.replica not in column)
        return None if members.replica in column else src * members.shards + members.shard

    def _nothing(self, rejected: list[RejectedStep], context: str) -> CheckpointNotFoundError:
        shown = "; ".join(str(r) for r in rejected[:_SHOWN])
        more = f"; and {len(rejected) - _SHOWN} more" if len(rejected) > _SHOWN else ""
        return CheckpointNotFoundError(
            f"no step verifies on every member in tiers {self.tiers} ({context}): "
            f"{shown or 'no tier holds any step'}{more}. Nothing can be resumed: check the "
            "checkpoint roots (a remote store reachable, the same paths as the saving run), "
            "or start the run again from step 0"
        )


def _listing_rejections(table: list[dict[str, Any]]) -> list[RejectedStep]:
    """Per tier that some member could not list: those members and the first one's error."""
    first: dict[str, str] = {}
    for row in table:
        for tier, why in row["errors"].items():
            first.setdefault(tier, why)
    return [
        RejectedStep(
            None, tier, tuple(r for r, row in enumerate(table) if tier in row["errors"]), why
        )
        for tier, why in first.items()
    ]


def _raise_fatal(outcomes: list[Any], step: int, tier: str) -> None:
    """Raise on every member when any member hit an error the ladder must not climb past."""
    fatal = [(r, why) for r, (kind, why) in enumerate(outcomes) if kind == "fatal"]
    if not fatal:
        return
    r, why = fatal[0]
    where = f"loading step {step} from {tier} on rank {r}"
    if why.startswith("StateMismatchError"):
        raise StateMismatchError(
            f"{where}: {why}; the state does not fit the checkpoint: build it as the saving "
            "run did (same model and optimizer), or resume with strict loading off by hand"
        )
    raise DistributedError(f"{where} failed unexpectedly: {why}")
