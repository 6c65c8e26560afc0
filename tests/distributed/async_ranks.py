"""Per-rank bodies for the asynchronous-save tests (spawned by run_ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import stalwart


def expected_weight(step: int, rank: int) -> torch.Tensor:
    return torch.full((256, 256), float(step * 10 + rank))


def lazy_saves_beside_training_collectives(rank: int, world: int, root: str) -> list[int]:
    """Lazy saves persist in the background while the main thread all-reduces every step."""
    ckpt = stalwart.Checkpointer(root)
    weight = torch.nn.Parameter(expected_weight(0, rank))
    opt = torch.optim.SGD([weight], lr=1.0)
    ckpt.guard(opt)
    for step in range(1, 6):
        with torch.no_grad():
            weight.copy_(expected_weight(step, rank))
        ckpt.save_async(step, {f"w{rank}": weight, "step": step}, lazy=True)
        grad = torch.ones_like(weight)
        dist.all_reduce(grad)  # training traffic on the default group, concurrently
        weight.grad = grad
        opt.step()  # waits for the copy; the checkpoint must hold expected_weight(step)
    ckpt.wait()
    steps = ckpt.steps()
    for step in steps:
        tree = ckpt.load(None, step)
        for r in range(world):
            assert torch.equal(tree[f"w{r}"], expected_weight(step, r)), (step, r)
    ckpt.close()
    return steps


def open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


def per_save_checkpointers_release_their_group(rank: int, world: int, root: str) -> list[int]:
    """A Checkpointer built and closed per save (as an integration may do) keeps no group.

    Each save_async of a new Checkpointer makes a gloo group for its background work (a
    connection to every other rank); closing the Checkpointer releases it, so the process's
    open descriptors stay flat over many saves instead of growing by a group each.
    """
    state = {f"w{rank}": expected_weight(1, rank)}
    counts = []
    for step in range(1, 13):
        with stalwart.Checkpointer(root) as ck:
            ck.save_async(step, state).wait()
        dist.barrier()
        counts.append(open_fds())
    return counts
