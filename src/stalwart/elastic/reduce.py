"""Averaging gradients and buffers over the members: one all-reduce per dtype, in place.

Every member packs the same tensors in the same order (the optimizer's parameters, then the
model's floating-point buffers), so a SUM all-reduce of the packed buffer followed by a
division by the member count gives every member the same bytes: gloo's ring algorithm
reduces each chunk once and copies the result to everybody. A control vector (votes and the
change flag, see :mod:`stalwart.elastic.job`) rides in the first buffer, so a step costs one
collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["average_"]


def _grad_or_zeros(p: torch.Tensor) -> torch.Tensor:
    # A member whose parameter got no gradient contributes zeros, as DDP does.
    return p.grad if p.grad is not None else torch.zeros_like(p)


def average_(
    params: list[torch.Tensor],
    buffers: list[torch.Tensor],
    control: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Average ``params``' gradients and ``buffers`` over ``group`` in place; sum ``control``.

    Returns:
        The summed control vector (``control`` itself for a world of one).

    Raises:
        RuntimeError: the all-reduce failed (a member died or timed out); nothing was written
            back, so gradients and buffers are as they were.
    """
    if group is None or group.size() == 1:
        return control
    size = group.size()
    tensors = [_grad_or_zeros(p) for p in params] + list(buffers)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    if not by_dtype:
        by_dtype[control.dtype] = []
    flats: list[tuple[list[int], torch.Tensor]] = []
    for n, (dtype, idx) in enumerate(by_dtype.items()):
        parts = [tensors[i].detach().reshape(-1) for i in idx]
        if n == 0:
            parts.append(control.to(dtype))
        flats.append((idx, torch.cat(parts) if parts else control.to(dtype)))
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
            control = flat[offset:].to(control.dtype)
    for p, g in zip(params, tensors[: len(params)], strict=True):
        if p.grad is None:
            p.grad = g
    return control
