"""Per-rank bodies for the keep_in + erasure tests (spawned by run_ranks)."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from stalwart.checkpoint.memory.erasure import XorCodec
from stalwart.checkpoint.memory.tiers import Tier, TieredCheckpointer
from stalwart.checkpoint.policy import EveryNSteps, KeepLast
from stalwart.errors import CorruptCheckpointError


def state_at(step: int, rank: int) -> dict[str, Any]:
    """Each rank's own tensor (a plain tensor under one name is replicated on disk)."""
    return {f"rank{rank}": torch.full((8,), float(100 * rank + step)), "step": step}


def blank(rank: int) -> dict[str, Any]:
    return {f"rank{rank}": torch.zeros(8), "step": -1}


def _tiers(rank: int, root: str, codec: Any = "auto") -> TieredCheckpointer:
    return TieredCheckpointer(
        [
            Tier.memory(keep=KeepLast(2), keep_in=f"{root}/shm-rank{rank}"),
            Tier.durable("disk", f"{root}/disk", every=EveryNSteps(2)),
        ],
        erasure=(1, 1),
        codec=codec,
    )


def restart_without_one_node(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save steps 1-3 (memory with parity; disk at step 2) and stop; restart with rank 1's
    tmpfs gone: rank 0 reloads its snapshots from keep_in, without parity."""
    tc = _tiers(rank, root)
    for step in (1, 2, 3):
        tc.save(step, state_at(step, rank))
    tc.close()
    if rank == 1:
        shutil.rmtree(f"{root}/shm-rank1")  # the node was replaced
    restarted = _tiers(rank, root)
    held = [(type(s).__name__, s.step) for s in restarted.snapshots]
    target = blank(rank)
    report = restarted.recover(target)
    assert torch.equal(target[f"rank{rank}"], state_at(report.step, rank)[f"rank{rank}"])
    restarted.close()
    return {"held": held, "source": report.source, "step": report.step, "why": report.attempts}


class EncodeFailsOnce(XorCodec):
    """XOR, but the first encode after ``arm()`` raises (a peer that timed out, say)."""

    armed = False

    def encode(self, data: Sequence[np.ndarray], parity: Sequence[np.ndarray]) -> bytes:
        if self.armed:
            self.armed = False
            raise RuntimeError("simulated transient encode failure")
        return super().encode(data, parity)


def one_failed_protect(rank: int, world: int, root: str) -> dict[str, Any]:
    """Step 3's erasure protect fails; steps 4 and 5 are kept and recovered as usual."""
    codec = EncodeFailsOnce(1)
    tc = _tiers(rank, root, codec)
    errors = {}
    for step in range(1, 6):
        codec.armed = step == 3
        try:
            tc.save(step, state_at(step, rank))
        except CorruptCheckpointError as e:
            errors[step] = str(e)
    kept = tc.memory.steps()
    target = blank(rank)
    report = tc.recover(target)
    assert torch.equal(target[f"rank{rank}"], state_at(5, rank)[f"rank{rank}"])
    tc.close()
    reopened = _tiers(rank, root)  # the keeper holds no index for the failed step
    on_tmpfs = [s.step for s in reopened.snapshots]
    reopened.close()
    return {"errors": errors, "kept": kept, "source": report.source, "on_tmpfs": on_tmpfs}
