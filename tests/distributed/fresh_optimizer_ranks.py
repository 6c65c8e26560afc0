"""Rank bodies for ``test_fresh_optimizer_dist.py``: FSDP2 state loaded into a fresh optimizer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import stalwart
from stalwart.checkpoint import Checkpointer, EveryNSteps, KeepLast, Tier, TieredCheckpointer


def _build(world: int, kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An MLP sharded by ``fully_shard`` over ``world`` ranks, and a fresh optimizer."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same full weights on every rank before sharding
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if kind == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()


def _local(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's shards of every parameter and state tensor, as plain tensors."""
    out = []
    for p in model.parameters():
        out.append(p.to_local().clone())
        for v in opt.state[p].values():
            out.append((v.to_local() if hasattr(v, "to_local") else v).clone())
    return out


def load_into_fresh(rank: int, world: int, root: str, kind: str, tier: str) -> dict[str, Any]:
    """Train two steps, save (disk, or a memory tier), load into a fresh model and optimizer,
    then take the same next step on both: what each rank ends with, side by side."""
    model, opt = _build(world, kind)
    for s in range(2):
        _step(model, opt, s)
    fresh_model, fresh_opt = _build(world, kind)
    state = stalwart.TrainingState(model=model, optimizer=opt)
    fresh = stalwart.TrainingState(model=fresh_model, optimizer=fresh_opt)
    if tier == "disk":
        with Checkpointer(root) as ck:
            ck.save(2, state)
            ck.load(fresh)
    else:
        memory = Tier(name="memory", root=None, every=EveryNSteps(1), keep=KeepLast(1))
        with TieredCheckpointer([memory]) as tc:
            tc.save(2, state)
            tc.recover(fresh)
    kinds = sorted({type(v).__name__ for st in fresh_opt.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0})  # fmt: skip
    try:
        _step(fresh_model, fresh_opt, 2)
        error = ""
    except RuntimeError as e:
        error = str(e)
    _step(model, opt, 2)
    same = not error and all(
        torch.equal(a, b) for a, b in zip(_local(model, opt), _local(fresh_model, fresh_opt),
                                          strict=True)
    )  # fmt: skip
    return {"kinds": kinds, "error": error, "same": same}
