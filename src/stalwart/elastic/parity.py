"""Verified parity: compare members' (step, digest), pick the state to keep, repair the rest.

Policy (the same on every member, computed from the same all-gathered table, so every member
takes the same decision without further messages):

1. **Ahead wins.** Members are grouped by (committed step, digest). The group with the
   highest step wins: a member ahead committed a step whose all-reduce completed on it with
   every member's contribution, so it is a valid step of the old membership, and the members
   behind (whose copy of that all-reduce failed) roll forward to it rather than everyone
   rolling back.
2. **Then the majority.** Among groups at the same step, the one with most members wins; a
   tie goes to the group holding the lowest rank.
3. The lowest rank of the winning group broadcasts its state; every member outside that group
   loads it. Members then compare digests again, and a second disagreement is an error (the
   state is not deterministic, e.g. a tensor the optimizer does not own changes between
   ``state_dict()`` calls).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from stalwart.elastic.state import digest, receive_state, send_state
from stalwart.errors import DistributedError

__all__ = ["ParityResult", "gather_digests", "reconcile"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParityResult:
    """What one reconciliation found and did.

    Attributes:
        agreed: every member already held the same (step, digest).
        source: the rank whose state won (None when agreed).
        received: this member loaded the winner's state.
        mismatch: members at the same step held different digests (silent divergence).
        table: (step, digest) per rank, before any repair.
    """

    agreed: bool
    source: int | None
    received: bool
    mismatch: bool
    table: list[tuple[int, str]]


def gather_digests(
    step: int, hexdigest: str, group: dist.ProcessGroup | None
) -> list[tuple[int, str]]:
    """All-gather every member's (committed step, 128-bit hex digest), in rank order."""
    if group is None:
        return [(step, hexdigest)]
    words = np.frombuffer(bytes.fromhex(hexdigest), dtype=np.int64)
    mine = torch.tensor([step, int(words[0]), int(words[1])], dtype=torch.int64)
    out = [torch.empty(3, dtype=torch.int64) for _ in range(group.size())]
    group.allgather([out], [mine]).wait()
    table = []
    for t in out:
        raw = np.asarray(t[1:].tolist(), dtype=np.int64).tobytes()
        table.append((int(t[0]), raw.hex()))
    return table


def choose_source(table: list[tuple[int, str]]) -> int:
    """The rank whose state every member should hold (policy in the module docstring)."""
    groups: dict[tuple[int, str], list[int]] = {}
    for rank, entry in enumerate(table):
        groups.setdefault(entry, []).append(rank)
    best = max(groups.items(), key=lambda kv: (kv[0][0], len(kv[1]), -min(kv[1])))
    return min(best[1])


def reconcile(
    state: Any,
    step: int,
    rank: int,
    group: dist.ProcessGroup | None,
) -> tuple[int, ParityResult]:
    """Bring every member of ``group`` to the same state; collective, call on every member.

    Args:
        state: this member's state object (``state_dict`` / ``load_state_dict``).
        step: this member's committed step.
        rank: this member's rank in ``group``.
        group: the epoch's process group (None: a world of one, nothing to do).

    Returns:
        The committed step this member now holds, and what was found.

    Raises:
        RuntimeError: a collective failed (a peer died): the caller starts a new epoch.
        DistributedError: members still disagree after a repair.
    """
    table = gather_digests(step, digest(state, step), group)
    if len(set(table)) == 1 or group is None:
        return step, ParityResult(True, None, False, False, table)
    steps = [s for s, _ in table]
    mismatch = any(  # at step 0 everyone is fresh: the first sync is not a divergence
        table[i][0] == table[j][0] > 0 and table[i][1] != table[j][1]
        for i in range(len(table))
        for j in range(i)
    )
    src = choose_source(table)
    received = table[rank] != table[src]
    if rank == src:
        send_state(state, step, src, group)
    else:
        new_step = receive_state(state, src, group, load=received)
        step = new_step if received else step
    log.info("parity: steps %s, rank %d sent its state (step %d)", steps, src, table[src][0])
    after = gather_digests(step, digest(state, step), group)
    if len(set(after)) != 1:
        raise DistributedError(
            f"members still disagree after repairing from rank {src}: {after}; the state "
            "is not deterministic (does state_dict() return values that change between "
            "calls?) or the members' models differ in structure"
        )
    return step, ParityResult(False, src, received, mismatch, table)
