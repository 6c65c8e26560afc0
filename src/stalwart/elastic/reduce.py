"""Averaging gradients and buffers over the members: one all-reduce per dtype, in place.

Every member packs the same tensors in the same order (the optimizer's parameters, then the
model's floating-point buffers), so a SUM all-reduce of the packed buffer followed by a
division by the member count gives every member the same bytes: gloo's ring algorithm
reduces each chunk once and copies the result to everybody. A control vector (votes and the
change flag, see :mod:`stalwart.elastic.job`) rides in the first buffer, so a step costs one
collective.

**Adasum** (Maleki et al., arXiv 2006.02924) is the other reduction: two gradients ``a`` and
``b`` combine as ``a + b - (a·b / 2|a|²) a - (a·b / 2|b|²) b``, a sum when they are orthogonal
and an average when they are parallel, so the learning rate depends less on the number of
members. It is applied per tensor (per layer, as the paper prescribes), with dot products and
norms accumulated in float64, over a *binomial tree* that works for any world size:

    level d = 1, 2, 4, ...:  rank r with r % 2d == d sends its partial to r - d and stops;
                             rank r with r % 2d == 0 combines adasum(own, received from r + d)
    then rank 0 broadcasts the root to everyone.

For 4 ranks this is ``adasum(adasum(g0, g1), adasum(g2, g3))`` (Horovod's pairing); for 3 it is
``adasum(adasum(g0, g1), g2)``. Horovod's recursive vector-halving spreads the arithmetic over
the ranks but needs a power of two; the tree needs none, and because only rank 0 computes the
root and broadcasts it, every rank holds the same bytes by construction (no reliance on two
ranks' arithmetic agreeing bit for bit). The price: rank 0 receives log2(n) full vectors. The
partials travel in float32 (float64 if any input is float64), so bf16/fp16 gradients are
rounded once, at the end. :func:`adasum_reference` runs the same tree in one process and gives
the same bytes as :func:`adasum`.

Horovod's ``DistributedOptimizer(op=Adasum)`` reduces the weight delta of a local optimizer
step; here, as a DDP communication hook does, the raw gradients are combined.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from stalwart.elastic.dtensors import local_part
from stalwart.elastic.groups import device_of
from stalwart.errors import ConfigError

__all__ = [
    "REDUCTIONS",
    "adasum",
    "adasum_hook",
    "adasum_pair",
    "adasum_reference",
    "average_",
    "reduce_",
]

REDUCTIONS = ("mean", "adasum")
"""The gradient reductions :meth:`stalwart.elastic.Job.data_parallel` accepts."""


def _grad_or_zeros(p: torch.Tensor) -> torch.Tensor:
    # A member whose parameter got no gradient contributes zeros, as DDP does.
    return p.grad if p.grad is not None else torch.zeros_like(p)


def average_(
    params: list[torch.Tensor],
    buffers: list[torch.Tensor],
    control: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    contributors: int | None = None,
) -> torch.Tensor:
    """Average ``params``' gradients and ``buffers`` over ``group`` in place; sum ``control``.

    ``contributors``: how many members contribute (None: all of ``group``); the others are
    listeners (:mod:`stalwart.elastic.catchup`) that pass zeros and take the mean, which is
    then the sum over the contributors divided by their count, the same bytes on every rank.

    A sharded gradient (a ``DTensor``: FSDP2 inside a replica group) is averaged by its local
    shard, over the ranks that hold the same shard in the other groups. The buffers travel on
    the gradients' device (gloo: CPU; NCCL: CUDA); ``control`` comes back on the CPU.

    Returns:
        The summed control vector (``control`` itself for a world of one).

    Raises:
        RuntimeError: the all-reduce failed (a member died or timed out); nothing was written
            back, so gradients and buffers are as they were.
    """
    if group is None or group.size() == 1:
        return control
    if contributors is not None and not 1 <= contributors <= group.size():
        raise ConfigError(f"contributors={contributors}: between 1 and the group's {group.size()}")
    size = group.size() if contributors is None else contributors
    grads = [_grad_or_zeros(p) for p in params]
    tensors = [local_part(g) for g in grads] + list(buffers)
    device = device_of(group)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    if not by_dtype:
        by_dtype[control.dtype] = []
    flats: list[tuple[list[int], torch.Tensor]] = []
    for n, (dtype, idx) in enumerate(by_dtype.items()):
        parts = [tensors[i].detach().reshape(-1).to(device) for i in idx]
        if n == 0:
            parts.append(control.to(device, dtype))
        flats.append((idx, torch.cat(parts)))
    works = [group.allreduce([flat]) for _, flat in flats]
    for w in works:
        w.wait()
    for n, (idx, flat) in enumerate(flats):
        offset = 0
        for i in idx:
            t = tensors[i]
            t.copy_(flat[offset : offset + t.numel()].view_as(t).div_(size))
            offset += t.numel()
        if n == 0:
            control = flat[offset:].to("cpu", control.dtype)
    for p, g in zip(params, grads, strict=True):
        if p.grad is None:
            p.grad = g
    return control


# -- Adasum --------------------------------------------------------------------------------


def _wire_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype partials travel in: float64 if any input is, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _combine_(a: torch.Tensor, b: torch.Tensor) -> None:
    """``a <- adasum(a, b)`` for two 1-D slices of one tensor, accumulated in float64.

    A zero-norm side contributes nothing and takes no coefficient, so ``adasum(0, b) == b``.
    """
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    dot = float(torch.dot(a64, b64))
    aa, bb = float(torch.dot(a64, a64)), float(torch.dot(b64, b64))
    ca = dot / (2.0 * aa) if aa > 0.0 else 0.0
    cb = dot / (2.0 * bb) if bb > 0.0 else 0.0
    a.copy_(a64 * (1.0 - ca) + b64 * (1.0 - cb))


def _combine_flat_(a: torch.Tensor, b: torch.Tensor, numels: Sequence[int]) -> None:
    """Combine two packed buffers tensor by tensor (segments of ``numels`` elements)."""
    offset = 0
    for n in numels:
        _combine_(a[offset : offset + n], b[offset : offset + n])
        offset += n


def _pack(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0, dtype=dtype)
    return torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])


def _unpack(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view(t.shape).to(t.dtype).clone())
        offset += t.numel()
    return out


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two tensors of one shape: ``a + b - (a·b/2|a|²) a - (a·b/2|b|²) b``.

    Orthogonal inputs add, equal inputs give themselves back, and the result does not depend
    on the order of the operands. Computed in float64, returned in ``a``'s dtype.

    Raises:
        ConfigError: the shapes differ.
    """
    if a.shape != b.shape:
        raise ConfigError(f"adasum_pair: shapes {tuple(a.shape)} and {tuple(b.shape)} differ; "
                          "Adasum combines two gradients of the same tensor")  # fmt: skip
    wire = _wire_dtype((a, b))
    flat = _pack([a], wire)
    _combine_(flat, _pack([b], wire))
    return flat.view(a.shape).to(a.dtype)


def adasum_reference(per_rank: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """Adasum of ``per_rank[r]`` (rank ``r``'s tensors) in one process, by :func:`adasum`'s tree.

    Returns the same bytes as :func:`adasum` on a world of ``len(per_rank)`` ranks: use it to
    test the distributed version, or to simulate a world in one process.
    """
    if not per_rank:
        raise ConfigError("adasum_reference needs at least one rank's tensors")
    like = list(per_rank[0])
    wire = _wire_dtype(like)
    numels = [t.numel() for t in like]
    flats = [_pack(ts, wire) for ts in per_rank]
    n, d = len(flats), 1
    while d < n:
        for r in range(0, n - d, 2 * d):
            _combine_flat_(flats[r], flats[r + d], numels)
        d *= 2
    return _unpack(flats[0], like)


def adasum(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Adasum-reduce each of ``tensors`` over ``group``; new tensors, the inputs are untouched.

    Collective: every rank passes tensors of the same shapes and dtypes, in the same order.
    The result is identical, byte for byte, on every rank (see the module docstring).

    Raises:
        RuntimeError: a send, receive or the broadcast failed (a rank died or timed out).
    """
    if group is None or group.size() == 1:
        return [t.detach().clone() for t in tensors]
    rank, size = group.rank(), group.size()
    wire = _wire_dtype(tensors)
    numels = [t.numel() for t in tensors]
    flat = _pack(tensors, wire)
    d = 1
    while d < size:
        if rank % (2 * d) == d:
            group.send([flat], rank - d, d).wait()
            break
        if rank + d < size:
            partner = torch.empty_like(flat)
            group.recv([partner], rank + d, d).wait()
            _combine_flat_(flat, partner, numels)
        d *= 2
    group.broadcast(flat, 0).wait()
    return _unpack(flat, tensors)


def adasum_hook(
    state: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: Adasum over ``state`` (a process group; None: the default one).

    ``model.register_comm_hook(None, adasum_hook)``. A bucket packs several parameters'
    gradients; Adasum is applied to each parameter's slice separately. The hook blocks until
    the reduction is done and returns a completed future.

    Raises:
        ConfigError: the bucket's buffer is not the concatenation of its gradients.
    """
    group = state if state is not None else dist.group.WORLD
    buffer = bucket.buffer()
    grads = bucket.gradients()
    if sum(g.numel() for g in grads) != buffer.numel():
        raise ConfigError(
            f"adasum_hook: bucket {bucket.index()} holds {buffer.numel()} elements but its "
            f"gradients {sum(g.numel() for g in grads)}; Adasum needs unpadded buckets"
        )
    views, offset = [], 0
    for g in grads:
        views.append(buffer[offset : offset + g.numel()].view(g.shape))
        offset += g.numel()
    for view, out in zip(views, adasum(views, group), strict=True):
        view.copy_(out)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut


# DDP's register_comm_hook compares the annotations with the classes themselves, and
# ``from __future__ import annotations`` made them strings: give it the classes.
adasum_hook.__annotations__.update(bucket=dist.GradBucket, state=dist.ProcessGroup | None)
adasum_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def reduce_(
    params: list[torch.Tensor],
    buffers: list[torch.Tensor],
    control: torch.Tensor,
    group: dist.ProcessGroup | None,
    op: str = "mean",
) -> torch.Tensor:
    """Reduce ``params``' gradients by ``op`` (see :data:`REDUCTIONS`), average ``buffers``.

    ``"mean"`` is :func:`average_`. ``"adasum"`` runs :func:`adasum` on the gradients, then
    :func:`average_` on the buffers and ``control``; gradients are written back only after
    both succeeded, so a failure leaves gradients and buffers as they were.

    Returns:
        The summed control vector.

    Raises:
        RuntimeError: a collective failed (a member died or timed out).
    """
    if op == "mean":
        return average_(params, buffers, control, group)
    if op != "adasum":
        raise ConfigError(f"reduce={op!r} is not a reduction; use one of {REDUCTIONS}")
    if group is None or group.size() == 1:
        return control
    combined = adasum([_grad_or_zeros(p) for p in params], group)
    control = average_([], buffers, control, group)
    for p, g in zip(params, combined, strict=True):
        if p.grad is None:
            p.grad = g
        else:
            p.grad.copy_(g)
    return control
