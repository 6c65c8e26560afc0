"""DTensor leaves (FSDP2 or tensor parallel inside a replica group), in one place.

A replica's state may hold ``DTensor`` leaves; what the elastic job sends, hashes and
reduces is each leaf's local shard, and a receiver rebuilds the DTensor on its own mesh from
the sender's spec (global shape, stride, placements). ``torch.distributed.tensor`` is
imported only where a DTensor must be built or read: :func:`is_dtensor` needs no import,
since no DTensor can exist before its module is (it costs 0.5 s of a worker's start here).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from stalwart.errors import ConfigError

__all__ = ["as_like", "dtensor_spec", "is_dtensor", "local_part", "rebuild_dtensor"]


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``DTensor`` (without importing its module)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a ``DTensor`` (sharing its storage); any other tensor itself."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def dtensor_spec(t: torch.Tensor) -> dict[str, Any] | None:
    """A DTensor's global shape, stride and placements, as JSON (None: a plain tensor)."""
    if not is_dtensor(t):
        return None
    from torch.distributed.tensor import Replicate, Shard

    placements: list[list[Any]] = []
    for p in t.placements:
        if isinstance(p, Shard):
            placements.append(["shard", p.dim])
        elif isinstance(p, Replicate):
            placements.append(["replicate"])
        else:
            raise ConfigError(
                f"a state tensor is a DTensor with placement {p}: only Shard and Replicate "
                "placements can be sent to a replica (reduce partial tensors before committing)"
            )
    return {"shape": list(t.shape), "stride": list(t.stride()), "placements": placements}


def rebuild_dtensor(local: torch.Tensor, spec: dict[str, Any], like: torch.Tensor | None,
             mesh: Any) -> torch.Tensor:  # fmt: skip
    """A DTensor from a received local shard, on the receiver's mesh (``like``'s, if any)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if like is not None and isinstance(like, DTensor):
        mesh = like.device_mesh
        local = local.to(like.to_local().device)
    elif mesh is not None:
        local = local.to(mesh.device_type)
    else:
        raise ConfigError(
            "received a sharded (DTensor) state but this member holds no DTensor to take the "
            "device mesh from: shard the model (fully_shard(model, mesh=job.shard_mesh)) "
            "before the first step, on every member"
        )
    placements = [Shard(p[1]) if p[0] == "shard" else Replicate() for p in spec["placements"]]
    shape, stride = torch.Size(spec["shape"]), tuple(spec["stride"])
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def as_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` (a received local shard) as a tensor placed like ``like``: a DTensor on
    ``like``'s mesh with its placements, shape and stride when ``like`` is one; else on its
    device."""
    if not is_dtensor(like):
        return local.to(like.device)
    from torch.distributed.tensor import DTensor

    assert isinstance(like, DTensor)
    local = local.to(like.to_local().device)
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())  # fmt: skip
