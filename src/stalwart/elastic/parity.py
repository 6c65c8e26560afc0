"""Verified parity: compare members' (step, digest), pick the state to keep, repair the rest.

Policy (the same on every member, computed from the same all-gathered table, so every member
takes the same decision without further messages):

1. **Ahead wins.** Members are grouped by (committed step, digest). The highest step wins: a
   member ahead committed a step whose all-reduce completed on it with every member's
   contribution, so it is a valid step of the old membership, and the members behind (whose
   copy of that all-reduce failed) roll forward to it rather than everyone rolling back.
2. **Then a strict majority.** Among the members at the highest step, a group holding more
   than half of them wins (3 members, 2 agree: the odd one is repaired), and the odd ones are
   SDC suspects (:mod:`stalwart.elastic.sdc` names them and the first differing tensor).
   Their gradients entered every member's updates since the last agreed state, so when every
   member holds an agreed copy not yet rolled back to, all of them load it and the loop
   recomputes (as in 3., the decision stays ``majority``); otherwise (and at the final check
   of ``close()``, after which nothing recomputes) the minority is repaired from the
   majority's current state.
3. **No majority: evidence, never rank.** When the members at the highest step split with
   no strict majority (two members, two digests; 1-1-1; 2-2), nothing says which copy is
   right: every member loads the :class:`~stalwart.elastic.state.AgreedState` it recorded at
   the last parity check where all members agreed, the members compare again (ahead wins
   among the copies: a member whose last record failed may hold an older one) and the
   training loop recomputes the steps since (``job.step`` goes back). A transient fault is
   gone on the recomputation; a second split before the job agrees on a later step is a
   persistent one (non-deterministic kernels, a faulty device) and raises
   :class:`~stalwart.errors.DistributedError`. At step 0 everyone is fresh: members whose
   fresh states differ (seeds) are synced from the lowest rank, which is not a divergence.
4. Every member of the winning group sends a slice of its state, peer to peer
   (:mod:`stalwart.elastic.heal`); every member outside that group loads it. Members then
   compare digests again, and a second disagreement is an error (the state is not
   deterministic, e.g. a tensor the optimizer does not own changes between
   ``state_dict()`` calls). Holders neither hash nor copy their unchanged state again
   (:meth:`AgreedState.keep`); a receiver's agreed copy adopts the bytes it received.

The decision is returned (:class:`Decision`, in :class:`ParityResult`); :class:`ParityCheck`,
the job's collaborator, keeps the agreed copy and writes the decision in its
``parity-mismatch`` event.

**Replica groups.** With ``G > 1`` ranks per replica group, each rank digests its own shard
and the replicate dimension of shard ``i`` all-gathers rank ``i``'s (step, digest) of every
group; the ``G`` ranks of a group then all-gather these columns over their shard group
(:func:`gather_table`), so every rank of the job holds the same table with one row per
group, its digest the hash of the group's per-shard digests. The policy runs on that table:
a group's decision (ahead, majority, rollback) is one decision for all its ranks, and a heal
is rank ``i`` of the chosen group sending shard ``i`` to rank ``i`` of the others, every
shard in parallel on its own replicate group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from stalwart.elastic.events import EventLog, ParityMismatch, SdcSuspect, StateReceived
from stalwart.elastic.groups import all_or_none, device_of
from stalwart.elastic.heal import heal
from stalwart.elastic.membership import Epoch
from stalwart.elastic.sdc import VERDICTS, Evidence, examine, leave_if_excluded
from stalwart.elastic.state import AgreedState, digest
from stalwart.errors import DistributedError

__all__ = [
    "Decision",
    "ParityCheck",
    "ParityResult",
    "choose_source",
    "gather_digests",
    "gather_table",
    "reconcile",
]

log = logging.getLogger(__name__)


class Decision(StrEnum):
    """Which rule of the policy (module docstring) chose the state every member holds."""

    AGREED = "agreed"  # every member already held the same (step, digest)
    AHEAD = "ahead"  # the members at the highest step agreed among themselves
    MAJORITY = "majority"  # a strict majority at the highest step
    FRESH = "fresh"  # step 0, fresh states that differ: synced from the lowest rank
    ROLLBACK = "rollback"  # no majority: back to the last agreed state, to be recomputed


@dataclass(frozen=True)
class ParityResult:
    """What one reconciliation found and did.

    Attributes:
        agreed: every member already held the same (step, digest).
        source: the rank whose state every member now holds (None when agreed; after a
            rollback, the rank whose agreed copy was sent).
        received: this member loaded another member's state.
        mismatch: members at the same step held different digests (silent divergence).
        table: (step, digest) per rank, before any repair.
        decision: the rule that chose the state.
        rolled_back_from: the step the members left when they rolled back (no majority, or
            a majority whose suspect's updates are undone by recomputing).
        evidence: the per-tensor comparison of a mismatch (:func:`.sdc.examine`).
    """

    agreed: bool
    source: int | None
    received: bool
    mismatch: bool
    table: list[tuple[int, str]]
    decision: Decision = Decision.AGREED
    rolled_back_from: int | None = None
    evidence: Evidence | None = None


def gather_digests(
    step: int, hexdigest: str, group: dist.ProcessGroup | None
) -> list[tuple[int, str]]:
    """All-gather every member's (committed step, 128-bit hex digest), in rank order."""
    if group is None:
        return [(step, hexdigest)]
    rows = _allgather_rows(_row(step, hexdigest), group)
    return [(int(t[0]), _hex(t)) for t in rows]


def _row(step: int, hexdigest: str) -> torch.Tensor:
    words = np.frombuffer(bytes.fromhex(hexdigest), dtype=np.int64)
    return torch.tensor([step, int(words[0]), int(words[1])], dtype=torch.int64)


def _hex(row: torch.Tensor) -> str:
    return np.asarray(row[1:].tolist(), dtype=np.int64).tobytes().hex()


def _allgather_rows(mine: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every member's ``mine`` (same shape) over ``group``, in rank order, on the CPU."""
    device = device_of(group)
    out = [torch.empty_like(mine, device=device) for _ in range(group.size())]
    group.allgather([out], [mine.to(device)]).wait()
    return [t.cpu() for t in out]


def gather_table(
    step: int, hexdigest: str, group: Any, shard_group: Any = None
) -> list[tuple[int, str]]:
    """One (step, digest) row per replica (group), the same on every rank of the job.

    Without replica groups (``shard_group`` None) this is :func:`gather_digests`. With them,
    row ``r`` is group ``r``'s lowest step and the xxh3-128 of its ranks' (step, digest) in
    rank order (module docstring): collectives on the replicate group, then the shard group.
    """
    table = all_or_none(shard_group, lambda: gather_digests(step, hexdigest, group))
    if shard_group is None:
        return table
    column = torch.stack([_row(s, d) for s, d in table])  # replicas x 3, this shard
    columns = _allgather_rows(column, shard_group)  # by rank in the group
    out = []
    for r in range(len(table)):
        h = xxhash.xxh3_128()
        for col in columns:
            h.update(f"{int(col[r][0])}:{_hex(col[r])}|".encode())
        out.append((min(int(col[r][0]) for col in columns), h.hexdigest()))
    return out


def choose_source(table: list[tuple[int, str]]) -> tuple[int | None, Decision]:
    """The rank whose state every member should hold, and the rule that chose it.

    Returns ``(None, Decision.ROLLBACK)`` when the members at the highest step (> 0) split
    with no strict majority (policy in the module docstring).
    """
    top = max(s for s, _ in table)
    groups: dict[str, list[int]] = {}
    for rank, (s, d) in enumerate(table):
        if s == top:
            groups.setdefault(d, []).append(rank)
    at_top = sum(len(r) for r in groups.values())
    best = max(groups.values(), key=lambda ranks: (len(ranks), -min(ranks)))
    if len(groups) == 1:
        return min(best), Decision.AHEAD
    if top == 0:
        return min(best), Decision.FRESH
    if 2 * len(best) > at_top:
        return min(best), Decision.MAJORITY
    return None, Decision.ROLLBACK


def _mismatch(table: list[tuple[int, str]]) -> bool:
    # at step 0 everyone is fresh: the first sync is not a divergence
    return any(
        table[i][0] == table[j][0] > 0 and table[i][1] != table[j][1]
        for i in range(len(table))
        for j in range(i)
    )


def reconcile(
    state: Any,
    step: int,
    rank: int,
    group: dist.ProcessGroup | None,
    agreed: AgreedState | None = None,
    shard_group: Any = None,
    *,
    majority_rollback: bool = True,
) -> tuple[int, ParityResult]:
    """Bring every member of ``group`` to the same state; collective, call on every member.

    Args:
        state: this member's state object (``state_dict`` / ``load_state_dict``).
        step: this member's committed step.
        rank: this member's rank in ``group``.
        group: the epoch's process group (None: a world of one, nothing to do).
        agreed: this member's copy of the last agreed state: rolled back to when the members
            split with no majority, and recorded again when they end in agreement. None:
            a split raises instead.
        shard_group: this member's replica group (None: groups of one); decisions are then
            taken per group (module docstring).
        majority_rollback: with a majority, roll everyone back to the agreed state (rule 2);
            False repairs the minority from the majority (the final check of ``close()``,
            after which no loop recomputes).

    Returns:
        The committed step this member now holds, and what was found.

    Raises:
        RuntimeError: a collective failed (a peer died): the caller starts a new epoch.
        DistributedError: members still disagree after a repair; or they split with no
            majority and there is no agreed state, or it happened again since the last one.
    """
    if group is None:  # a world of one compares with nobody: no digest (seconds at GiBs)
        return step, ParityResult(True, None, False, False, [])
    table = gather_table(step, mine := digest(state, step), group, shard_group)
    if len(set(table)) == 1:
        if agreed is not None:
            agreed.record(state, step)
        return step, ParityResult(True, None, False, False, table)
    src, decision = choose_source(table)
    mismatch = _mismatch(table)
    evidence = examine(state, table, group, shard_group, agreed) if mismatch else None
    rolled_from, held = None, None
    spare: dict[str, torch.Tensor] = {}  # leaves a heal received that nothing else holds
    redo = majority_rollback and evidence is not None and evidence.can_roll_back
    if src is None or (decision is Decision.MAJORITY and redo):
        # no majority; or a majority whose suspect's gradients entered everyone's updates
        # since the last agreed state: everyone goes back to it and recomputes
        rolled_from = max(s for s, _ in table)
        step, src, received = _roll_back_all(state, step, rank, table, agreed, group, shard_group)
    else:
        received = table[rank] != table[src]
        held = None if received else mine  # a holder: its state unchanged since ``mine``
        step = _heal(state, step, rank, table, src, group, shard_group, spare)
    log.info("parity (%s): steps %s, rank %s sent its state", decision, [s for s, _ in table], src)
    _check_repaired(state, step, src, group, shard_group, agreed, held, spare)
    return step, ParityResult(False, src, received, mismatch, table, decision, rolled_from,
                              evidence)  # fmt: skip


def _roll_back_all(state: Any, step: int, rank: int, table: list[tuple[int, str]],
                   agreed: AgreedState | None, group: Any,
                   shard_group: Any) -> tuple[int, int | None, bool]:  # fmt: skip
    """Every member loads its agreed copy; copies that differ then follow the policy once."""
    rolled_from = max(s for s, _ in table)
    step = _roll_back(state, step, table, agreed)
    table2 = gather_table(step, digest(state, step), group, shard_group)
    if len(set(table2)) == 1:
        return step, None, False
    src, _ = choose_source(table2)
    if src is None:
        raise DistributedError(
            f"the members' agreed states differ after rolling back from step "
            f"{rolled_from} ({table2}); restart from the durable checkpoint"
        )
    received = table2[rank] != table2[src]
    step = _heal(state, step, rank, table2, src, group, shard_group, {})
    return step, src, received


def _check_repaired(state: Any, step: int, src: int | None, group: Any, shard_group: Any,
                    agreed: AgreedState | None, held: str | None,
                    spare: dict[str, Any]) -> None:  # fmt: skip
    """Compare the digests after a repair (a disagreement left is an error), record the agreed
    copy; a holder (``held``: its unchanged digest) keeps its own (:meth:`AgreedState.keep`)."""
    after = gather_table(step, held or digest(state, step), group, shard_group)
    if len(set(after)) != 1:
        raise DistributedError(
            f"members still disagree after repairing from rank {src}: {after}; the state "
            "is not deterministic (does state_dict() return values that change between "
            "calls?) or the members' models differ in structure"
        )
    if agreed is not None and (held is None or not agreed.keep(step)):
        agreed.record(state, step, spare)


def _heal(state: Any, step: int, rank: int, table: list[tuple[int, str]], src: int,
          group: Any, shard_group: Any, spare: dict[str, Any]) -> int:  # fmt: skip
    """Every member holding ``table[src]`` sends a slice of its state to each other member.

    Peer to peer over sockets, all holders at once (:mod:`stalwart.elastic.heal`); returns
    the step this member holds. With replica groups every shard is sent at once, each on its
    replicate group; a failure on one shard fails the heal on every rank of the group
    (:func:`~.groups.all_or_none`). ``spare``: see :func:`~stalwart.elastic.heal.heal`.
    """
    holders = [r for r, row in enumerate(table) if row == table[src]]
    return all_or_none(shard_group, lambda: heal(state, step, rank, holders, group, spare=spare))


def _roll_back(
    state: Any, step: int, table: list[tuple[int, str]], agreed: AgreedState | None
) -> int:
    """Load this member's agreed copy (a member with none, e.g. a newcomer, keeps its state)."""
    top = max(s for s, _ in table)
    if agreed is None or agreed.step is None:
        if step < top:
            return step  # not one of the disputed copies: the others' agreed copies win
        raise DistributedError(
            f"members hold different states at step {top} ({table}) with no majority, and "
            "this member has no agreed state to roll back to; restart from the durable "
            "checkpoint, or run with 3 or more members so that a majority can decide"
        )
    if agreed.rollbacks >= 1:
        raise DistributedError(
            f"members hold different states at step {top} ({table}) again after rolling "
            f"back to the agreed step {agreed.step} and recomputing: the divergence is "
            "persistent (non-deterministic kernels: torch.use_deterministic_algorithms(True); "
            "or a faulty device). With no majority nothing says which member is right: "
            "restart from the durable checkpoint, or run with 3 or more members"
        )
    log.warning("parity: no majority at step %d; rolling back to step %d", top, agreed.step)
    return agreed.restore(state)


class ParityCheck:
    """A job's parity checks: the agreed copy to roll back to, and the events they write.

    Args:
        state: the job's replicated state.
        events: the job's event log: ``parity-mismatch`` (the table, the ``decision``, the
            worker id whose state was sent as ``source``, ``rolled_back_from``),
            ``state-received`` and ``sdc-suspect`` (:mod:`stalwart.elastic.sdc`: the workers
            outside a majority, ``majority``; every worker of a split, ``rollback``).
        shard_group: the member's replica group (None: groups of one).
    """

    def __init__(self, state: Any, events: EventLog, shard_group: Any = None) -> None:
        self.state = state
        self.events = events
        self.shard_group = shard_group
        self.agreed = AgreedState()
        self.last_decision: Decision | None = None

    def run(self, step: int, epoch: Epoch, why: str) -> int:
        """Reconcile the members of ``epoch`` (collective); returns the step this member holds.

        ``last_decision`` is :attr:`Decision.ROLLBACK` whenever the members went back to the
        agreed state (the loop recomputes), whatever rule named the suspect.

        Raises:
            RuntimeError: a collective failed; DistributedError: see :func:`reconcile`.
        """
        step, found = reconcile(self.state, step, epoch.rank, epoch.group, self.agreed,
                                self.shard_group, majority_rollback=why != "final")  # fmt: skip
        rolled = found.rolled_back_from is not None
        self.last_decision = Decision.ROLLBACK if rolled else found.decision
        src = None if found.source is None else epoch.worker(found.source)
        if found.mismatch:
            log.warning("parity mismatch (%s): %s; decided: %s", why, found.table, found.decision)
            self.events.record(ParityMismatch(
                step=step, epoch=epoch.number, table=[list(t) for t in found.table], why=why,
                decision=str(found.decision), source=src, rolled_back_from=found.rolled_back_from,
            ))  # fmt: skip
        if found.received:
            self.events.record(StateReceived(step=step, epoch=epoch.number, source=src, why=why))
        ev, named = found.evidence, self._suspect(found, epoch)
        if why != "final" and ev and ev.decided_by in VERDICTS and epoch.rank in named:
            leave_if_excluded(epoch.worker(epoch.rank))  # the exclusion policy (sdc.py)
        return step

    def _suspect(self, found: ParityResult, epoch: Epoch) -> dict[int, str | None]:
        """Write ``sdc-suspect`` for a majority's outsiders, or every member of a split;
        returns them (replica rank -> tensor)."""
        ev = found.evidence
        suspects = dict(ev.suspects) if ev is not None else {}
        if self.shard_group is not None:  # a rank whose own shard agreed names nobody
            suspects = {r: t for r, t in suspects.items() if t is not None}
        if ev is not None and suspects:
            self._write(max(s for s, _ in found.table), epoch, suspects, ev.decided_by)
        return suspects

    def _write(self, step: int, epoch: Epoch, suspects: dict[int, str | None], how: str) -> None:
        for replica, tensor in sorted(suspects.items()):
            wid = epoch.worker(replica)
            log.warning("sdc suspect (%s): worker %s at step %d, tensor %s", how, wid, step, tensor)
            self.events.record(SdcSuspect(step=step, epoch=epoch.number, suspect=wid,
                                          tensor=tensor, decided_by=how))  # fmt: skip
