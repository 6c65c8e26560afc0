"""Per-rank bodies of the erasure-coding tests, run by ``stalwart.testing.run_ranks``.

Every rank builds a deterministic state from ``(rank, step)`` (different sizes per rank, so
some ranks' blobs end before the group's padded length and their last pieces are empty),
captures a snapshot, protects it, then the ranks named lost drop everything they held and
rebuild; they check the rebuilt state against the state regenerated from the seed.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from stalwart.checkpoint.capture import HostBuffer
from stalwart.checkpoint.memory.erasure import ErasureGroup
from stalwart.checkpoint.memory.snapshot import Snapshot
from stalwart.errors import CorruptCheckpointError

Scenario = tuple[int, int, str, list[int], str, int, int]
"""(k, m, codec, lost ranks of the sub-group, layout, first global rank, sub-group size)."""


@functools.cache
def _mesh(world: int) -> DeviceMesh:
    return init_device_mesh("cpu", (world,))


def make_state(rank: int, world: int, step: int, *, zeros: bool = False) -> dict[str, Any]:
    """The state ``rank`` holds at ``step``; ``zeros`` gives a same-shaped, wiped target."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    rows = 4 * (rank + 1) ** 2  # blobs from ~1 KiB (rank 0) to tens of KiB
    full = torch.randn(2 * world + 1, 6, generator=torch.Generator().manual_seed(step))
    chunks = full.chunk(world)  # Shard(0) splits like torch.chunk: 3,3,3,2 and none for 5
    local = chunks[rank].clone() if rank < len(chunks) else full[:0].clone()
    state: dict[str, Any] = {
        "w": torch.randn(rows, 16, generator=g),
        "bf": torch.randn(rank + 3, 5, generator=g).to(torch.bfloat16),
        "i8": torch.randint(-128, 127, (37 * rank + 1,), generator=g, dtype=torch.int8),
        "scalar": torch.tensor(float(rank * 10 + step)),
        "empty": torch.empty(0, 3),
        "meta": {"rank": rank, "step": step, "name": f"r{rank}"},
        "dt": DTensor.from_local(
            local,
            _mesh(world),
            [Shard(0)],
            run_check=False,
            shape=full.shape,
            stride=full.stride(),
        ),
    }
    if zeros:
        for key in ("w", "bf", "i8", "scalar"):
            state[key].zero_()
        state["dt"].to_local().zero_()
    return state


def _assert_same(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    for key in ("w", "bf", "i8", "scalar", "empty"):
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, (what, key)
        assert torch.equal(
            a[key].view(torch.uint8) if a[key].dim() else a[key],
            b[key].view(torch.uint8) if b[key].dim() else b[key],
        ), (what, key)
    assert torch.equal(a["dt"].to_local(), b["dt"].to_local()), (what, "dt")


def scenarios(rank: int, world: int, todo: list[Scenario]) -> list[Any]:
    """Run each scenario on its own gloo sub-group of ranks ``[first, first + size)``.

    In each: protect step ``i``, lose ``lost`` (ranks of the sub-group), rebuild. One outcome
    per scenario: ``("ok", stats)``, ``("error", message)`` for a CorruptCheckpointError, or
    ``("skip", None)`` on ranks outside the sub-group. The state's DTensor lives on a mesh of
    the whole world; the sub-group is only the erasure traffic's process group, so its
    ranks differ from global ranks (``first > 0``) as with a dedicated checkpoint group.
    """
    # new_group is collective over the world: create every sub-group on every rank, in order.
    groups = [dist.new_group(list(range(f, f + n)), backend="gloo") for *_, f, n in todo]
    out: list[Any] = []
    buf, parity_buf = HostBuffer(), HostBuffer()
    for step, ((k, m, codec, lost, layout, first, size), pg) in enumerate(
        zip(todo, groups, strict=True), start=1
    ):
        if not first <= rank < first + size:
            out.append(("skip", None))
            continue
        eg = ErasureGroup(k, m, pg, codec, layout=layout, timeout_s=60)
        assert eg.rank == rank - first
        state = make_state(rank, world, step)
        protected: Any = eg.protect(
            Snapshot.capture(state, step, buffer=buf), parity_buffer=parity_buf
        )
        assert protected.redundancy_nbytes >= m * protected.piece_nbytes
        if eg.rank in lost:
            protected = None  # the memory is gone: snapshot, parity, peers' indexes
            state = make_state(rank, world, step, zeros=True)
        try:
            rebuilt = eg.rebuild(lost, protected, buffer=HostBuffer())
        except CorruptCheckpointError as e:
            out.append(("error", str(e)))
            continue
        if eg.rank in lost:
            assert rebuilt is not None and rebuilt.step == step
            tree = rebuilt.restore_into(state)
            assert tree["meta"] == {"rank": rank, "step": step, "name": f"r{rank}"}
            _assert_same(state, make_state(rank, world, step), f"rank {rank} step {step}")
        else:
            assert rebuilt is None
        assert eg.last_protect is not None and eg.last_rebuild is not None
        stats = {"protect": vars(eg.last_protect), "rebuild": vars(eg.last_rebuild)}
        out.append(("ok", {**stats, "group": eg.members, "lost": eg.rank in lost}))
    return out
