"""Per-rank bodies for the recovery-ladder tests (spawned by run_ranks, gloo on CPU).

Each rank keeps its own checkpoint tiers (a folder per rank, a process group of its own for
the checkpointer), as the members of an elastic job do; the ladder agrees over the world.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stalwart import TrainingState
from stalwart.checkpoint import Checkpointer, KeepLast, Tier, TieredCheckpointer
from stalwart.checkpoint.policy import EveryNSteps
from stalwart.elastic.ladder import LadderReport, RecoveryLadder
from stalwart.elastic.state import digest
from stalwart.errors import CheckpointNotFoundError


def own_group(rank: int, world: int) -> Any:
    """A process group holding this rank alone (every rank creates every one, in order)."""
    mine = None
    for r in range(world):
        g = dist.new_group([r], backend="gloo")
        if r == rank:
            mine = g
    return mine


def make_state() -> TrainingState:
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    return TrainingState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def set_step(state: TrainingState, step: int) -> TrainingState:
    """The state's values at ``step`` (the same on every rank: replicated state)."""
    with torch.no_grad():
        for i, p in enumerate(state.model.parameters()):
            p.fill_(step + i / 10)
    return state


def at_step(state: TrainingState) -> float:
    return float(next(state.model.parameters()).detach().flatten()[0])


def flip_pack_byte(root: Path, step: int) -> None:
    """Flip one byte in the data (pack) file of ``step``: on-disk corruption."""
    (pack,) = sorted((root / "packs").glob(f"step-{step:020d}-*.pack"))
    raw = bytearray(pack.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    pack.write_bytes(bytes(raw))


def summary(report: LadderReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return {
        "step": report.step,
        "tier": report.tier,
        "lost": report.steps_lost,
        "rejected": [
            (r.step, r.tier, list(r.ranks), r.reason.split(":")[0]) for r in report.rejected
        ],
        "source": report.source,
    }


def durable_per_rank(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Steps 2, 4, 6 on each rank's disk; rank 2 lacks 6; rank 1's step 4 is corrupt."""
    root = Path(tmp) / f"rank{rank}"
    ck = Checkpointer(root, process_group=own_group(rank, world))
    for step in (2, 4, 6):
        if not (step == 6 and rank == 2):
            ck.save(step, {"train": set_step(make_state(), step)})
    out: dict[str, Any] = {}
    state = make_state()
    report = RecoveryLadder(ck).resume({"train": state}, dist.group.WORLD, last_committed=7)
    out["partial"] = (summary(report), at_step(state))
    if rank == 1:
        flip_pack_byte(root, 4)
    state = make_state()
    report = RecoveryLadder(ck).resume({"train": state}, dist.group.WORLD, last_committed=7)
    out["corrupt"] = (summary(report), at_step(state))
    ck.close()
    return out


def _tiers(tmp: Path, rank: int, world: int, group: Any) -> TieredCheckpointer:
    return TieredCheckpointer(
        [
            Tier.memory(every=EveryNSteps(1), keep=KeepLast(2), keep_in=tmp / f"shm{rank}"),
            Tier.durable("local", tmp / f"local{rank}", every=EveryNSteps(4), keep=KeepLast(3)),
        ],
        process_group=group,
    )


def tiered(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Memory then local disk, a corrupt snapshot on one rank, a restart, replicated sharing."""
    folder, group = Path(tmp), own_group(rank, world)
    tc = _tiers(folder, rank, world, group)
    state = make_state()
    for step in range(1, 7):  # memory keeps 5, 6; local holds 4
        tc.save(step, set_step(state, step))
    out: dict[str, Any] = {}
    target = make_state()
    out["newest"] = summary(RecoveryLadder(tc).resume(target, dist.group.WORLD)), at_step(target)
    if rank == 1:  # memory corruption of the newest snapshot, on one rank only
        tc.memory.find(6).data.view(-1)[3] ^= 0x10
    target = make_state()
    out["bad_memory"] = (
        summary(RecoveryLadder(tc).resume(target, dist.group.WORLD)),
        at_step(target),
    )
    tc.close()
    # The whole job restarts: new processes' tiers; the tmpfs snapshots outlived them.
    # Rank 0's node kept its memory (steps 5 and 6); the others were replaced (no memory).
    if rank != 0:
        for f in (folder / f"shm{rank}").iterdir():
            f.unlink()
    tc = _tiers(folder, rank, world, group)
    target = make_state()
    strict = RecoveryLadder(tc).resume(target, dist.group.WORLD, last_committed=6)
    out["restart_strict"] = summary(strict), at_step(target)
    target = make_state()
    shared = RecoveryLadder(tc, replicated=True).resume(target, dist.group.WORLD, last_committed=6)
    out["restart_replicated"] = summary(shared), at_step(target), digest(target, shared.step)
    tc.close()
    return out


def nothing(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """No tier holds a step: a new job (None), or a job that had committed (an error)."""
    ck = Checkpointer(Path(tmp) / f"rank{rank}", process_group=own_group(rank, world))
    ladder = RecoveryLadder(ck)
    out: dict[str, Any] = {"fresh": ladder.resume({"train": make_state()}, dist.group.WORLD)}
    try:
        ladder.resume({"train": make_state()}, dist.group.WORLD, last_committed=12)
    except CheckpointNotFoundError as e:
        out["lost"] = str(e)
    if rank == 0:  # only rank 0 has a step, and it is corrupt
        ck.save(3, {"train": set_step(make_state(), 3)})
        flip_pack_byte(Path(tmp) / "rank0", 3)
    try:
        RecoveryLadder(ck, replicated=True).resume({"train": make_state()}, dist.group.WORLD)
    except CheckpointNotFoundError as e:
        out["corrupt"] = str(e)
    ck.close()
    return out


def replica_groups(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """2 replica groups x 2 shards: shard ``s`` holds its own values; group 1 lost its memory.

    Ranks 0, 1 are group 0 (shards 0, 1), ranks 2, 3 group 1; the replicate groups are
    {0, 2} (shard 0) and {1, 3} (shard 1). Memory keeps steps 5, 6 (group 0 only, after the
    restart), local disk step 4 on every rank.
    """
    folder = Path(tmp)
    own = own_group(rank, world)
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    shard, replica = rank % 2, rank // 2
    sg, rg = shard_groups[replica], replicate_groups[shard]
    tc = _tiers(folder, rank, world, own)
    state = make_state()
    for step in range(1, 7):
        tc.save(step, set_step(state, 10 * step + shard))
    if replica == 1:
        tc.drop_memory()  # group 1 was replaced: its memory is gone
    out: dict[str, Any] = {}
    for mode in ("strict", "replicated"):
        target = make_state()
        ladder = RecoveryLadder(tc, replicated=mode == "replicated")
        report = ladder.resume(target, rg, shard_group=sg, last_committed=6)
        out[mode] = summary(report), at_step(target)
    if rank == 1:  # shard 1's only memory copy of step 6 is damaged: shard 1 is not covered
        tc.memory.find(6).data.view(-1)[3] ^= 0x10
    target = make_state()
    report = RecoveryLadder(tc, replicated=True).resume(target, rg, shard_group=sg)
    out["uncovered"] = summary(report), at_step(target)
    tc.close()
    return out
