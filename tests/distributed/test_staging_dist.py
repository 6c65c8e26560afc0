"""Bounded staging in a real gloo job: FSDP2 shards and replicated tensors, saved with a cap.

Two ranks save an FSDP2 model + AdamW with ``max_staging_bytes`` far below each rank's
share; each rank's staging buffer stays within the cap (the buffer's own allocation
counters), and a load on the same two ranks, and one consolidated load, restore every byte.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import stalwart
from stalwart.checkpoint.options import CheckpointOptions
from stalwart.testing import run_ranks

pytestmark = pytest.mark.timeout(180)

CHUNK, CAP = 64 << 10, 192 << 10


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 256)).sum().backward()
    opt.step()
    return model, opt


def _local_values(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.to_local().clone() for p in model.parameters()]
    for st in opt.state.values():
        out += [v.to_local().clone() for k, v in sorted(st.items()) if k != "step"]
    return out


def capped_fsdp2_save(rank: int, world: int, root: str) -> tuple[int, int, int, int]:
    """Save with a cap, then zero and load; return (staged bytes, windows' packs, ok, total)."""
    model, opt = _model()
    extra = torch.arange(100_000, dtype=torch.float32)  # replicated: written by one rank
    state = {"model": model, "optim": opt, "extra": extra}
    want = _local_values(model, opt)
    opts = CheckpointOptions(chunk_bytes=CHUNK, max_staging_bytes=CAP)
    with stalwart.Checkpointer(root, opts) as ck:
        pending = ck.save_async(1, state)
        with torch.no_grad():  # the next steps may change everything at once
            for p in model.parameters():
                p.add_(1.0)
            extra.zero_()
        result = pending.wait()
        buf = pending.slot
        assert buf is not None
        staged = buf.allocated_bytes
        packs = len({c.pack for c in ck.manifest(1).chunks() if f"rank{rank:05d}" in c.pack})
        ck.load(state)
    got = _local_values(model, opt)
    ok = int(all(torch.equal(a, b) for a, b in zip(got, want, strict=True)))
    ok &= int(torch.equal(extra, torch.arange(100_000, dtype=torch.float32)))
    return staged, packs, ok, result.bytes_total


def test_a_capped_fsdp2_save_stages_within_the_cap_and_loads_exactly(tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    results = run_ranks(capped_fsdp2_save, 2, root, timeout_s=150)
    for staged, packs, ok, total in results:
        assert ok == 1
        assert 0 < staged <= CAP  # peak staging memory of the rank: one buffer, within the cap
        assert packs >= 2  # more than one window: the cap was binding
        assert total > 2 * CAP
    whole = stalwart.Checkpointer(root).load(None)  # the consolidated view, every byte
    assert torch.equal(whole["extra"], torch.arange(100_000, dtype=torch.float32))
    assert whole["model"]["0.weight"].shape == (512, 256)
