"""Rank bodies for ``test_run_ranks.py``: module level, so forked and spawned ranks find them."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def sum_ranks(rank: int, world_size: int, scale: int) -> tuple[int, int]:
    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    return rank, int(t.item())


def read_env(rank: int, world_size: int, name: str) -> tuple[str | None, bool]:
    """The variable as the rank sees it, and whether this module saw it at import."""
    return os.environ.get(name), name in _ENV_AT_IMPORT


def die_on(rank: int, world_size: int, victim: int) -> int:
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def raise_on(rank: int, world_size: int, victim: int) -> int:
    if rank == victim:
        raise ValueError(f"rank {rank} refuses")
    return rank


def sleep_on(rank: int, world_size: int, victim: int) -> int:
    if rank == victim:
        _stuck_here()
    return rank


def _stuck_here() -> None:
    time.sleep(600)


def say(rank: int, world_size: int, text: str) -> None:
    print(f"{text} from rank {rank}", flush=True)
    print(f"{text} on stderr", file=sys.stderr, flush=True)


def write_pid_then_sleep(rank: int, world_size: int, folder: str) -> None:
    with open(os.path.join(folder, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)


def parent_and_path(rank: int, world_size: int) -> tuple[int, list[str]]:
    return os.getppid(), list(sys.path)


_ENV_AT_IMPORT = frozenset(os.environ)
