"""Where a :class:`~stalwart.elastic.Job` runs (:class:`World`), its first epoch, its device.

Under ``stalwart run`` the first epoch is joined through the coordinator
(:mod:`stalwart.elastic.membership`), after the replica group's own process group is built
(:func:`stalwart.elastic.groups.build_shard_group`). Under ``torchrun`` the job uses the
default process group (gloo, or NCCL on CUDA); with replica groups of ``G`` ranks it lays
the world out as a 2-D ``DeviceMesh`` ``(replicate, shard)`` (consecutive ranks form a
group), so a script written for ``stalwart run --group-size G`` runs unchanged on a fixed
world, where a failed collective raises instead of healing. One process is a world of one.

:func:`pick_device` decides the device of the job's collectives, and so the backend
(:func:`stalwart.elastic.groups.backend_for`): the one asked for, else the device of the
state's first tensor off the CPU (a model on CUDA: NCCL), else the CPU (gloo).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist

from stalwart.elastic.dtensors import local_part
from stalwart.elastic.groups import backend_for, build_shard_group
from stalwart.elastic.membership import Epoch, Membership
from stalwart.elastic.protocol import WorkerEnv, from_env
from stalwart.elastic.state import canonical_tree
from stalwart.elastic.timeouts import DEFAULT_TIMEOUT_S, Timeouts
from stalwart.environment import torchrun_world
from stalwart.errors import ConfigError
from stalwart.tree import flatten

__all__ = ["World", "coordinator_client", "first_epoch", "fixed_epoch", "pick_device"]


class World(StrEnum):
    """Where a :class:`~stalwart.elastic.Job` runs, and so how it finds its members."""

    ELASTIC = "elastic"  # stalwart run's coordinator: members come and go
    TORCHRUN = "torchrun"  # the default process group, a fixed world
    SINGLE = "single"  # one process, no collectives

    @classmethod
    def detect(cls) -> World:
        """The world the environment says: ``stalwart run``, then ``torchrun``, else one process."""
        if from_env() is not None:
            return cls.ELASTIC
        world = torchrun_world()
        return cls.TORCHRUN if world is not None and world[1] > 1 else cls.SINGLE


def coordinator_client(
    world: World, min_size: int, timeout_s: float | None, join_timeout_s: float | None,
    warmup: Callable[[], object] | None = None, *, announce: bool = True,
) -> tuple[WorkerEnv | None, Timeouts, Membership | None]:  # fmt: skip
    """A job's settings from ``stalwart run`` (None in another world), its timeouts (the one
    timeout: ``timeout_s``, else ``stalwart run --timeout``, else the default) and its
    coordinator client (``warmup``, ``announce``: :class:`Membership`'s).

    Raises:
        ConfigError: ``world`` is elastic, but no ``stalwart run`` started this process.
    """
    env = from_env() if world is World.ELASTIC else None
    if world is World.ELASTIC and env is None:
        raise ConfigError(
            "Job(world='elastic') needs the coordinator: run the script with `stalwart run`"
        )
    if timeout_s is None:  # 0 is a setting, refused by Timeouts as a negative one is
        timeout_s = env.timeout_s if env else DEFAULT_TIMEOUT_S
    timeouts = Timeouts(
        timeout_s=timeout_s, hang_override_s=env.hang_s if env else 0.0,
        join_override_s=join_timeout_s,
    )  # fmt: skip
    membership = None if env is None else Membership(env, min_size, timeouts=timeouts,
                                                      warmup=warmup, announce=announce)  # fmt: skip
    return env, timeouts, membership


def first_epoch(world: World, membership: Membership | None, group_size: int | None,
                device: torch.device, timeouts: Timeouts,
                timeout_s: float | None) -> tuple[Epoch, dist.ProcessGroup | None]:  # fmt: skip
    """The job's first epoch and its replica group's own process group (None: groups of one).

    Under ``stalwart run``: join the first epoch; with replica groups (G > 1) build the
    group's process group and return a placeholder epoch (number 0) instead: the job joins at
    its first step boundary, once the model is sharded on that group's mesh and the state
    holds it (a replacement group heals there).

    Raises:
        ConfigError: ``group_size`` differs from the launcher's ``--group-size``.
    """
    if membership is None:  # torchrun keeps torch's default timeout unless one is given
        return fixed_epoch(world, group_size or 1, device, timeout_s)
    layout = membership.layout
    if group_size is not None and group_size != layout.group_size:
        raise ConfigError(
            f"Job(group_size={group_size}), but `stalwart run` started groups of "
            f"{layout.group_size}: pass --group-size {group_size} to stalwart run, or leave "
            "group_size out (it is read from the launcher)"
        )
    membership.device = device
    if layout.group_size == 1:
        return membership.join(0, timeouts.join_s), None
    shard_group = build_shard_group(membership.store, layout, device, timeouts.collective)
    membership.shard_group = shard_group
    return Epoch(0, (membership.wid,), 0, None, (), layout.group_rank), shard_group


def pick_device(device: str | torch.device | None, state: Any, local_rank: int) -> torch.device:
    """The device of a job's collectives (module docstring); sets the current CUDA device.

    ``"cuda"`` without an index is ``cuda:{local_rank % device_count}`` (the worker's slot).
    """
    if device is None:
        device = torch.device("cpu")
        for leaf in flatten(canonical_tree(state)).leaves.values():
            where = local_part(leaf.tensor).device
            if where.type != "cpu":
                device = where
                break
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
    return device


def fixed_epoch(
    world: str, group_size: int, device: torch.device, timeout_s: float | None = None
) -> tuple[Epoch, dist.ProcessGroup | None]:
    """The one epoch of ``torchrun`` (``world == "torchrun"``) or of a single process, and the
    replica group's own process group (None without replica groups).

    Raises:
        ConfigError: the group size does not divide the world (or exceeds one process).
    """
    if world != "torchrun":
        if group_size != 1:
            raise ConfigError(
                f"Job(group_size={group_size}) in a single process: replica groups need "
                f"{group_size} ranks or more; run under `stalwart run --group-size "
                f"{group_size}` or torchrun"
            )
        return Epoch(0, (0,), 0, None), None
    if not dist.is_initialized():
        kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        dist.init_process_group(backend_for(device), **kwargs)  # type: ignore[arg-type]
    size, rank = dist.get_world_size(), dist.get_rank()
    if group_size == 1:
        return Epoch(0, tuple(range(size)), rank, dist.group.WORLD), None
    if size % group_size:
        raise ConfigError(
            f"Job(group_size={group_size}) under torchrun with {size} ranks: the group size "
            "must divide the number of ranks"
        )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (size // group_size, group_size),
                            mesh_dim_names=("replicate", "shard"))  # fmt: skip
    groups = tuple(tuple(range(g, g + group_size)) for g in range(0, size, group_size))
    epoch = Epoch(0, tuple(range(size)), rank // group_size, mesh.get_group("replicate"),
                  groups, rank % group_size)  # fmt: skip
    return epoch, mesh.get_group("shard")
