"""Silent data corruption: name the tensor a parity mismatch is in, and the member that holds it.

The whole-state digest (:func:`stalwart.elastic.state.digest`) stays the quick check that runs
at every parity point. Only when it differs do the members compute one xxh3-128 per tensor of
the canonical state (plus one row for the non-tensor skeleton) and all-gather them
(:func:`examine`): a few collectives on the rare path, nothing on the common one.

* With a strict majority at the disputed step, every member outside it is a suspect
  (``decided_by="majority"``); the tensor named is the first, in FQN order, whose digest
  differs from the majority's.
* With no majority (two members) nothing says which copy is right, and nothing is decided by
  rank: every member of the split is named (``decided_by="rollback"``), with the first tensor
  in which it differs from another, and all of them roll back to the last agreed state and
  recompute (:mod:`stalwart.elastic.parity`). Comparing the recomputed state with the
  disputed copies does not single one out either: the corrupted member's gradients entered
  both copies' updates, so neither disputed copy equals the recomputed one.

With replica groups each rank compares its own shard (rank ``i`` of every group on the
replicate dimension); a rank whose shard agreed names no tensor.

**Exclusion** (``stalwart run --exclude-suspect-after N``; off by default): the launcher writes
the policy to ``policy.json`` in the events folder (:data:`POLICY_FILE`). A worker that has
been named by a verdict (:data:`VERDICTS`: a parity majority, or its own non-finite
gradients; not a split with no majority, which names everyone, nor a gradient-norm outlier,
a signal whose step is kept) in ``N`` distinct checks leaves at once with
:data:`EXIT_EXCLUDED` (:func:`leave_if_excluded`), its count read back from its own event
file; the launcher does not replace it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from stalwart.elastic.dtensors import local_part
from stalwart.elastic.events import EventKind, read_lines
from stalwart.elastic.groups import agree, device_of
from stalwart.elastic.state import canonical_tree
from stalwart.environment import read
from stalwart.tree import dtype_name, flatten

__all__ = [
    "EXIT_EXCLUDED",
    "POLICY_FILE",
    "SKELETON",
    "VERDICTS",
    "Evidence",
    "examine",
    "exclusion_threshold",
    "first_difference",
    "leave_if_excluded",
    "majority_ranks",
    "tensor_digests",
    "verdicts_against",
    "write_policy",
]

log = logging.getLogger(__name__)

SKELETON = "(non-tensor state)"  # the row for everything in the state that is not a tensor
EXIT_EXCLUDED = 12
"""A worker's exit code when the exclusion policy removed it (the launcher does not replace it)."""
POLICY_FILE = "policy.json"  # in the events folder: {"exclude_suspect_after": N}
VERDICTS = ("majority", "nonfinite-count")  # the rules that single out one member


def tensor_digests(state: Any) -> tuple[list[str], np.ndarray]:
    """The names (skeleton row first, then leaves in FQN order) and an ``n x 2`` int64 array of
    their xxh3-128 digests (a ``DTensor``: its local shard)."""
    flat = flatten(canonical_tree(state))
    names = [SKELETON, *sorted(flat.leaves)]
    out = np.empty((len(names), 2), dtype=np.int64)
    out[0] = _words(xxhash.xxh3_128_digest(json.dumps(flat.skeleton, sort_keys=True).encode()))
    for i, fqn in enumerate(names[1:], start=1):
        t = local_part(flat.leaves[fqn].tensor).detach().to("cpu").contiguous()
        h = xxhash.xxh3_128()
        h.update(f"{dtype_name(t.dtype)}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # hashed in place, no copy
        out[i] = _words(h.digest())
    return names, out


def _words(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.int64)


def first_difference(names: list[str], mine: np.ndarray, reference: np.ndarray) -> str | None:
    """The first name whose digest differs between two rows of :func:`tensor_digests`."""
    if mine.shape != reference.shape:
        return SKELETON  # a different structure
    diff = np.flatnonzero((mine != reference).any(axis=1))
    return names[int(diff[0])] if diff.size else None


def majority_ranks(table: list[tuple[int, str]]) -> tuple[list[int], str | None]:
    """The replicas at the highest step that hold its strict-majority digest, and that digest.

    ``([], None)`` when no digest at the highest step holds more than half of the replicas there.
    """
    top = max(s for s, _ in table)
    at_top = [(r, d) for r, (s, d) in enumerate(table) if s == top]
    counts: dict[str, list[int]] = {}
    for r, d in at_top:
        counts.setdefault(d, []).append(r)
    best = max(counts.values(), key=len)
    if 2 * len(best) <= len(at_top):
        return [], None
    return best, table[best[0]][1]


@dataclass(frozen=True)
class Evidence:
    """What the per-tensor comparison of a mismatch found (the same on every rank).

    Attributes:
        suspects: replica rank -> first differing tensor of this rank's shard (None: this
            shard agreed), for the replicas outside the majority; with no majority, every
            replica of the split.
        can_roll_back: every rank of the job holds an agreed copy it has not rolled back to
            yet, so every member can go back to it and recompute.
        decided_by: ``majority``, or ``rollback`` when no majority named one member.
    """

    suspects: dict[int, str | None]
    can_roll_back: bool
    decided_by: str = "majority"


def examine(state: Any, table: list[tuple[int, str]], group: Any, shard_group: Any,
            agreed: Any) -> Evidence:  # fmt: skip
    """Collective on every rank of the job: gather per-tensor digests after a mismatch.

    Args:
        state: this member's state.
        table: the (step, digest) per replica that disagreed.
        group: the replicate group; ``shard_group``: this rank's replica group (or None).
        agreed: this member's :class:`~stalwart.elastic.state.AgreedState` (or None).

    Raises:
        RuntimeError: a collective failed (a peer died).
    """
    names, mine = tensor_digests(state)
    ready = agreed is not None and agreed.step is not None and agreed.rollbacks == 0
    head = torch.tensor([mine.shape[0], int(ready)], dtype=torch.int64)
    heads = _gather(head, group)
    counts = {int(h[0]) for h in heads}
    flags = sum(int(h[1]) for h in heads) == len(heads)
    votes = agree(shard_group, [float(flags)])[0]
    can_roll_back = votes >= (1 if shard_group is None else shard_group.size())
    how = "majority" if majority_ranks(table)[0] else "rollback"
    if len(counts) != 1:  # different structures: name the skeleton
        return Evidence(_suspects(table, None), can_roll_back, how)
    rows = [r.numpy() for r in _gather(torch.from_numpy(mine.copy()), group)]
    return Evidence(_suspects(table, (names, rows)), can_roll_back, how)


_Rows = tuple[list[str], list[np.ndarray]]  # names, every replica's per-tensor digests


def _suspects(table: list[tuple[int, str]], found: _Rows | None) -> dict[int, str | None]:
    """Outside a majority: the suspects; no majority: every member of the split at the top."""
    top = max(s for s, _ in table)
    good, digest_hex = majority_ranks(table)
    at_top = [r for r, (s, _) in enumerate(table) if s == top]
    bad = [r for r in at_top if table[r][1] != digest_hex] if good else at_top
    if found is None:
        return dict.fromkeys(bad, SKELETON)
    names, rows = found

    def other(r: int) -> int:  # the majority's first rank, or the first that differs from r
        return good[0] if good else next(o for o in at_top if table[o][1] != table[r][1])

    return {r: first_difference(names, rows[r], rows[other(r)]) for r in bad}


def _gather(mine: torch.Tensor, group: Any) -> list[torch.Tensor]:
    device = device_of(group)
    out = [torch.empty_like(mine, device=device) for _ in range(group.size())]
    group.allgather([out], [mine.to(device)]).wait()
    return [t.cpu() for t in out]


def write_policy(events: Path, exclude_suspect_after: int) -> None:
    """The launcher's side: write the exclusion policy beside the event files (0: none)."""
    path = events / POLICY_FILE
    if exclude_suspect_after > 0:
        path.write_text(json.dumps({"exclude_suspect_after": exclude_suspect_after}) + "\n")
    else:
        path.unlink(missing_ok=True)


def exclusion_threshold(events: Path) -> int:
    """Verdicts after which a worker leaves (0: never), from the launcher's policy file."""
    try:
        return int(json.loads((events / POLICY_FILE).read_text())["exclude_suspect_after"])
    except FileNotFoundError:
        return 0


def verdicts_against(events: Path, wid: int) -> int:
    """Distinct checks (epoch, step, rule) whose verdict named worker ``wid``, from its own
    event file (every member writes every suspect, the suspect too)."""
    lines = read_lines(events / f"worker{wid}.jsonl")
    return len({
        (e.get("epoch"), e.get("step"), e["decided_by"]) for e in lines
        if e.get("kind") == EventKind.SDC_SUSPECT and e.get("suspect") == wid
        and e.get("decided_by") in VERDICTS
    })  # fmt: skip


def leave_if_excluded(wid: int) -> None:
    """After a verdict named worker ``wid`` (this process): exit with :data:`EXIT_EXCLUDED`
    when the launcher's policy says it has been named often enough.

    The process leaves *now* (``os._exit``): not through the job's ``close()`` at exit, which
    would wait for the others to agree on a final step. Its peers see its sockets close, as
    for a crash, and go on without it; every event line is already on disk (line-buffered).
    """
    folder = read("STALWART_ELASTIC_EVENTS")
    if folder is None:
        return
    after = exclusion_threshold(Path(folder))
    named = verdicts_against(Path(folder), wid) if after else 0
    if after and named >= after:
        log.error("worker %d excluded: named by %d SDC verdicts (--exclude-suspect-after %d)",
                  wid, named, after)  # fmt: skip
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_EXCLUDED)
