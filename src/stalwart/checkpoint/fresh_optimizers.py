"""Fresh optimizers given their state before a load, so the loaded state lands in place.

A torch optimizer creates its state (Adam's moments, SGD's momentum buffer) at its first step.
A load into a fresh optimizer, the usual case when a job starts again, has no tensor to fill:
the loader handed ``load_state_dict`` new plain tensors, and where FSDP2 shards a parameter (a
DTensor) the next step failed on the mix ("got mixed torch.Tensor and DTensor"). Before a load,
each fresh optimizer in the state takes one step with zero gradients and a learning rate of
zero, as ``torch.distributed.checkpoint.state_dict`` does before its own loads: the state then
exists, shaped and placed like its parameters, and the load fills it in place. The parameters
do not move (every update, AdamW's decay included, is scaled by the zero rate), the gradients
are put back as they were, and what the step wrote into the state is overwritten by the load.

The loads prime only optimizers of sharded parameters (``sharded_only``): a plain optimizer
takes the loaded plain tensors as they are, and its zero step would only cost time on the
restart's path (here 0.1 to 0.4 s per GB of AdamW state, and 10 s the first time in a process).
The step runs the optimizer's step hooks, as any step does. An optimizer whose step needs a
closure (L-BFGS) or refuses a zero step is left as it was.
A ``TrainingState`` built with ``fqn_optimizer_state`` is left alone: its loads go through
``set_state_dict``, which prepares the optimizer itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from stalwart.checkpoint.durable.plan import is_dtensor
from stalwart.checkpoint.training_state import TrainingState

__all__ = ["prime_fresh_optimizers"]

log = logging.getLogger(__name__)


def prime_fresh_optimizers(state: Any, *, sharded_only: bool = False) -> None:
    """Give every fresh optimizer held in ``state`` its state (module docstring); with
    ``sharded_only``, those whose parameters include a DTensor."""
    for optimizer in _optimizers(state, set()):
        if not optimizer.state and (not sharded_only or _sharded(optimizer)):
            _prime(optimizer)


def _sharded(optimizer: Optimizer) -> bool:
    return any(is_dtensor(p) for g in optimizer.param_groups for p in g["params"])


def _optimizers(obj: Any, seen: set[int]) -> Iterator[Optimizer]:
    """The optimizers in a state tree: held directly, in containers, or by a TrainingState."""
    if obj is None or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, Optimizer):
        yield obj
    elif isinstance(obj, TrainingState):
        if not obj.fqn_optimizer_state:
            yield from _optimizers(obj.optimizer, seen)
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _optimizers(value, seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _optimizers(value, seen)


def _prime(optimizer: Optimizer) -> None:
    """One step of ``optimizer`` with zero gradients at a learning rate of zero."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not params:
        return
    grads = {p: p.grad for p in params}
    rates = [(g, g["lr"]) for g in optimizer.param_groups if "lr" in g]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group, lr in rates:
            group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
        optimizer.step()
    except Exception as e:  # a closure needed, or a zero step refused: load as before
        optimizer.state.clear()
        log.debug("%s was not primed before the load: %s", type(optimizer).__name__, e)
    finally:
        for group, lr in rates:
            group["lr"] = lr
        for p, grad in grads.items():
            p.grad = grad
