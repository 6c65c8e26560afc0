"""Checkpoint-free recovery of a lost pipeline stage: from a replica, else from its neighbours.

After Blagoev, Ersoy and Chen, "All is Not Lost: LLM Recovery without Checkpoints"
(CheckFree, arXiv 2506.15461). When the worker of pipeline stage ``i`` dies and nothing was
saved, its replacement starts with freshly initialised weights. Two ways back:

* **replica** (exact): another data-parallel replica of stage ``i`` is alive; its weights are
  copied as they are (the same bytes).
* **neighbours** (CheckFree, approximate): an intermediate stage is rebuilt as the average of
  stages ``i - 1`` and ``i + 1``, weighted by their latest gradient norms,
  ``W_i = (a W_{i+1} + b W_{i-1}) / (a + b)`` with ``a = |g_{i+1}|``, ``b = |g_{i-1}|`` (equal
  weights when the norms are unknown or zero). Stacked blocks of a deep network resemble their
  neighbours, so training resumes from a much better point than a fresh initialisation.
* **neighbour copy** (CheckFree+, approximate): the first or last stage has one neighbour; its
  blocks are copied from it.

Only the entries the neighbours share with the lost stage (same name, shape and dtype) are
rebuilt: stage-specific parts (an embedding on the first stage, a head on the last) keep the
replacement's values unless a replica exists, and are listed in the record. The lost stage's
optimizer state is not recovered: build a fresh optimizer for it (:func:`fresh_optimizer`).

:func:`recover_stage` works on state dicts in one process; :func:`recover_over_gloo` moves
the weights between the ranks of a process group (point-to-point ``send``/``recv`` of each
source's serialised state dict, so names, shapes and dtypes travel and a replica's copy is
bit-exact) and returns the same record on every rank.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stalwart.errors import ConfigError

__all__ = [
    "StageRecovery",
    "average_states",
    "fresh_optimizer",
    "neighbour_weights",
    "plan_sources",
    "recover_over_gloo",
    "recover_stage",
]

State = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class StageRecovery:
    """How a lost stage was rebuilt.

    Attributes:
        stage: the lost stage's index.
        path: ``"replica"`` (exact), ``"neighbours"`` (CheckFree) or ``"neighbour-copy"``
            (CheckFree+, first or last stage).
        sources: the stages (or, over gloo, the ranks) the weights came from.
        weights: each source's weight (sums to 1).
        kept: entries of the lost stage no source had (left as the replacement's values).
    """

    stage: int
    path: str
    sources: tuple[int, ...]
    weights: tuple[float, ...]
    kept: tuple[str, ...] = ()

    @property
    def exact(self) -> bool:
        """True when the recovered weights are the lost ones (a replica was copied)."""
        return self.path == "replica"


def neighbour_weights(grad_norms: Sequence[float | None]) -> list[float]:
    """Normalised weights from the sources' gradient norms (equal if any is unknown or all 0)."""
    if not grad_norms:
        raise ConfigError("neighbour_weights(): no sources to weight")
    known = [g for g in grad_norms if g is not None and g >= 0]
    if len(known) < len(grad_norms) or sum(known) <= 0:
        return [1.0 / len(grad_norms)] * len(grad_norms)
    total = float(sum(known))
    return [float(g) / total for g in known]


def plan_sources(lost: int, stages: int) -> tuple[str, tuple[int, ...]]:
    """The path and source stages for rebuilding ``lost`` of ``stages`` without a replica."""
    if not 0 <= lost < stages or stages < 2:
        raise ConfigError(
            f"stage {lost} of {stages}: need 0 <= stage < stages and at least 2 stages "
            "(a one-stage model has no neighbour: restore it from a replica or checkpoint)"
        )
    if lost == 0:
        return "neighbour-copy", (1,)
    if lost == stages - 1:
        return "neighbour-copy", (stages - 2,)
    return "neighbours", (lost - 1, lost + 1)


def average_states(
    target: State, sources: Sequence[State], weights: Sequence[float]
) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """The weighted average of ``sources``' entries that match ``target``'s (name, shape, dtype).

    Floating-point entries are averaged in float64 and cast back; other entries are taken
    from the first source that has them. Returns the new state and the names kept from
    ``target`` because no source had them.
    """
    out: dict[str, torch.Tensor] = {}
    kept: list[str] = []
    for name, t in target.items():
        have = [
            (s[name], wt)
            for s, wt in zip(sources, weights, strict=True)
            if name in s and s[name].shape == t.shape and s[name].dtype == t.dtype
        ]
        if not have:
            out[name] = t.clone()
            kept.append(name)
        elif not t.is_floating_point():
            out[name] = have[0][0].clone()
        else:
            acc = torch.zeros_like(t, dtype=torch.float64)
            norm = sum(wt for _, wt in have)
            for s_t, wt in have:
                acc += (wt / norm) * s_t.to(torch.float64)
            out[name] = acc.to(t.dtype)
    return out, tuple(kept)


def recover_stage(
    module: nn.Module,
    lost: int,
    stages: Mapping[int, State],
    num_stages: int,
    *,
    grad_norms: Mapping[int, float] | None = None,
    replica: State | None = None,
) -> StageRecovery:
    """Rebuild ``module`` (the replacement of stage ``lost``) in place; return how.

    Args:
        module: the lost stage's module, freshly initialised.
        lost: its stage index.
        stages: state dicts of the live stages, by index (at least the neighbours).
        num_stages: how many stages the pipeline has.
        grad_norms: the live stages' latest gradient norms (weights; default: equal).
        replica: the state dict of a live replica of stage ``lost``: copied, exact.
    """
    own = module.state_dict()
    if replica is not None:
        module.load_state_dict({k: v.clone() for k, v in replica.items()})
        return StageRecovery(lost, "replica", (lost,), (1.0,))
    path, sources = plan_sources(lost, num_stages)
    missing = [s for s in sources if s not in stages]
    if missing:
        raise ConfigError(f"stage {lost}: the states of neighbour stages {missing} are needed")
    norms = [(grad_norms or {}).get(s) for s in sources]
    weights = neighbour_weights(norms)
    new, kept = average_states(own, [stages[s] for s in sources], weights)
    module.load_state_dict(new)
    return StageRecovery(lost, path, sources, tuple(weights), kept)


def fresh_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A new optimizer of the same class and hyper-parameters, with empty state."""
    groups = [{k: v for k, v in g.items()} for g in optimizer.param_groups]
    return type(optimizer)(groups, **optimizer.defaults)


def _send_state(module: nn.Module, grad_norm: float | None, dst: int, group: Any) -> None:
    buf = io.BytesIO()
    torch.save({"state": module.state_dict(), "norm": grad_norm}, buf)
    raw = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    dist.send(torch.tensor([raw.numel()], dtype=torch.int64), dst, group=group)
    dist.send(raw, dst, group=group)


def _recv_state(src: int, group: Any) -> tuple[dict[str, torch.Tensor], float | None]:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    raw = torch.empty(int(size[0]), dtype=torch.uint8)
    dist.recv(raw, src, group=group)
    got = torch.load(io.BytesIO(raw.numpy().tobytes()), weights_only=True)
    return got["state"], got["norm"]


def recover_over_gloo(
    module: nn.Module,
    *,
    lost_rank: int,
    sources: Sequence[int],
    grad_norm: float | None = None,
    replica: bool = False,
    stage: int = -1,
    group: dist.ProcessGroup | None = None,
) -> StageRecovery:
    """Send the sources' weights to ``lost_rank``, which rebuilds ``module`` (collective).

    Every rank of ``group`` calls it with the same ``lost_rank``, ``sources`` and ``replica``;
    ranks in ``sources`` send their stage's weights and ``grad_norm``; ``lost_rank`` averages
    them (or, with ``replica=True`` and one source, copies it exactly). The sources' modules
    must have the same entries as the lost one (identical blocks, or the replica).

    Returns:
        The record, the same on every rank.
    """
    if replica and len(sources) != 1:
        raise ConfigError(f"replica=True needs exactly one source rank, got {list(sources)}")
    me = dist.get_rank(group)
    if me in sources:
        _send_state(module, grad_norm, lost_rank, group)
    weights: list[float] = [1.0 / len(sources)] * len(sources)
    if me == lost_rank:
        got = [_recv_state(src, group) for src in sources]
        weights = [1.0] if replica else neighbour_weights([norm for _, norm in got])
        if replica:
            module.load_state_dict(got[0][0])
        else:
            module.load_state_dict(average_states(module.state_dict(), [st for st, _ in got],
                                                  weights)[0])  # fmt: skip
    shared = torch.tensor(weights, dtype=torch.float64)
    dist.broadcast(shared, lost_rank, group=group)
    path = "replica" if replica else ("neighbours" if len(sources) == 2 else "neighbour-copy")
    return StageRecovery(stage, path, tuple(sources), tuple(float(x) for x in shared))
