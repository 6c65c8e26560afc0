"""Per-rank bodies of ``test_shared_load_dist.py``: replicated loads read once by the group.

Module level because ``spawn``-ed ranks import them by name. Every rank builds the same
replicated state from a seed, so each knows what a load must give back.
"""

from __future__ import annotations

import resource
import signal
from typing import Any

import torch

from stalwart.checkpoint import Checkpointer, CheckpointOptions
from stalwart.checkpoint.durable import shared_read
from stalwart.errors import CorruptCheckpointError, DistributedError

PIECE_BYTES = 8 << 10
"""Pieces this small cut the larger tensors into several pieces spread over the ranks."""


def replicated(version: int) -> dict[str, Any]:
    """The same state on every rank: tensors of several sizes, one of them 0-dim."""
    g = torch.Generator().manual_seed(version)
    return {
        "big": torch.randn(64, 96, generator=g),  # 24 KiB: three pieces
        "mid": torch.randn(40, 33, generator=g).to(torch.bfloat16),
        "ints": torch.randint(0, 1000, (77,), generator=g),
        "scalar": torch.tensor(float(version)),
        "step": version,
    }


def _zeros() -> dict[str, Any]:
    return {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
        for k, v in replicated(0).items()
    }


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def save_then_load(
    rank: int,
    world: int,
    root: str,
    shared: bool | None,
    shm: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> int:
    """Save version 1, load it into zeros (shared reads on, off, or None: by the store);
    return bytes read.

    ``shm``: pieces pass through files in /dev/shm (else gloo broadcasts).
    ``storage_options``: for a URL ``root`` (an S3 bucket on the test's moto server).
    """
    shared_read.PIECE_BYTES = PIECE_BYTES
    shared_read.SHARED_READS = shared
    shared_read.SHM_READS = shm
    opts = CheckpointOptions(chunk_bytes=4096)
    with Checkpointer(root, options=opts, storage_options=storage_options) as ck:
        ck.save(1, replicated(1))
        state = _zeros()
        ck.load(state)
        _same(state, replicated(1))
        assert ck.last_load is not None
        return ck.last_load.bytes_read


def collectives_of_a_load(rank: int, world: int, root: str, shared: bool | None) -> dict[str, int]:
    """Save version 1, then count the collectives one load of it runs, by kind."""
    import torch.distributed as dist

    shared_read.SHARED_READS = shared
    kinds = ("all_gather_object", "broadcast_object_list", "all_reduce", "all_gather", "broadcast")
    with Checkpointer(root, options=CheckpointOptions(chunk_bytes=4096)) as ck:
        ck.save(1, replicated(1))
        state, calls = _zeros(), dict.fromkeys(kinds, 0)
        originals = {k: getattr(dist, k) for k in kinds}

        def counting(kind: str) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                calls[kind] += 1
                return originals[kind](*args, **kwargs)

            return call

        for k in kinds:
            setattr(dist, k, counting(k))
        try:
            ck.load(state)
        finally:
            for k in kinds:
                setattr(dist, k, originals[k])
        _same(state, replicated(1))
        return calls


def save_then_load_capped(rank: int, world: int, root: str) -> int:
    """``save_then_load`` with shared reads forced, and rank 1 unable to make a file past 8 KiB
    once saved (``RLIMIT_FSIZE``; ``SIGXFSZ`` ignored, so the call fails with ``EFBIG``)."""
    shared_read.PIECE_BYTES = PIECE_BYTES
    shared_read.SHARED_READS = True
    with Checkpointer(root, options=CheckpointOptions(chunk_bytes=4096)) as ck:
        ck.save(1, replicated(1))
        if rank == 1:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 10, resource.RLIM_INFINITY))
        state = _zeros()
        ck.load(state)
        _same(state, replicated(1))
        assert ck.last_load is not None
        return ck.last_load.bytes_read


def save_versions(rank: int, world: int, root: str) -> None:
    """Steps 1 and 2 of the replicated state."""
    with Checkpointer(root, options=CheckpointOptions(chunk_bytes=4096)) as ck:
        ck.save(1, replicated(1))
        ck.save(2, replicated(2))


def load_damaged(rank: int, world: int, root: str) -> tuple[str, str, int]:
    """Load the newest (damaged) step without, then with, fallback (shared reads on)."""
    shared_read.PIECE_BYTES = PIECE_BYTES
    shared_read.SHARED_READS = True
    with Checkpointer(root) as ck:
        try:
            ck.load(_zeros())
            kind, msg = "none", ""
        except (CorruptCheckpointError, DistributedError) as e:
            kind, msg = type(e).__name__, str(e)
        state = _zeros()
        ck.load(state, fallback=True)
        _same(state, replicated(1))
        assert ck.last_load is not None
        return kind, msg, ck.last_load.step
