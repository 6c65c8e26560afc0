"""Rank bodies for test_preemption_dist.py (module-level: run_ranks pickles them)."""

from __future__ import annotations

import signal

import torch

import stalwart


def signal_one_rank(rank: int, world: int, root: str) -> tuple[int, int]:
    """Only rank 1 gets SIGUSR1 (at step 3); every rank must save step 3 and exit together."""
    state = {"w": torch.full((8,), float(rank))}
    ckpt = stalwart.Checkpointer(root)
    with stalwart.PreemptionGuard((signal.SIGUSR1,)) as preemption:
        for step in range(1, 100):
            state["w"] += 1
            if rank == 1 and step == 3:
                signal.raise_signal(signal.SIGUSR1)
            try:
                preemption.save_and_exit_if_requested(ckpt, step, {f"r{rank}": state["w"]})
            except SystemExit as e:
                return step, int(e.code or 0)
    return -1, 0
