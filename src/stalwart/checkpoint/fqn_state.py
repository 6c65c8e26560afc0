"""Model and optimizer state keyed by parameter FQN, through ``torch.distributed.checkpoint``.

``TrainingState(fqn_optimizer_state=True)`` builds its model and optimizer state with DCP's
``get_state_dict`` and restores it with ``set_state_dict``: optimizer state keyed by the
parameter's name rather than its index, so pipeline stages and multi-part models do not
collide and FSDP2/TP state stays sharded. The parts' states are merged into one dict of each
kind; each part takes its own keys back on load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.optim import Optimizer

from stalwart.errors import StateMismatchError

__all__ = ["fqn_state_dicts", "set_fqn_state_dicts"]


def _parts(model: Any, optimizer: Any) -> list[tuple[nn.Module, Optimizer]]:
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    optims = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if len(models) != len(optims):
        raise ValueError(f"{len(models)} model parts but {len(optims)} optimizers")
    return list(zip(models, optims, strict=True))


def fqn_state_dicts(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and optimizer state of every part, merged; optimizer keys are parameter FQNs."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    msd: dict[str, Any] = {}
    osd: dict[str, Any] = {}
    for part, opt in _parts(model, optimizer):
        m, o = get_state_dict(part, opt, options=opts)
        msd.update(m)
        osd.update(o)
    return msd, osd


def set_fqn_state_dicts(
    model: Any, optimizer: Any, state_dict: Mapping[str, Any], strict: bool
) -> None:
    """Restore every part from merged FQN-keyed state (each part takes its own keys).

    ``set_state_dict`` runs non-strict (each part would take the others' keys for unexpected
    ones), so a strict load first checks the keys of all parts together.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    if strict:
        _check_model_keys(model, state_dict["model"])
    opts = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
    for part, opt in _parts(model, optimizer):
        # set_state_dict fills a fresh optimizer's state only after a zero step that it
        # skips when any gradient exists, and then silently loads no state: hide them.
        grads = {p: p.grad for g in opt.param_groups for p in g["params"]} if not opt.state else {}
        for p in grads:
            p.grad = None
        try:
            set_state_dict(
                part,
                opt,
                model_state_dict=dict(state_dict["model"]),
                optim_state_dict=dict(state_dict["optimizer"]),
                options=opts,
            )
        finally:
            for p, grad in grads.items():
                p.grad = grad


def _check_model_keys(model: Any, loaded: Mapping[str, Any]) -> None:
    """Refuse, as a strict ``nn.Module.load_state_dict`` does, a model state that lacks keys
    of the parts or holds keys none of them has. A lacking parameter would also leave its
    optimizer state unloadable (Adam's then fails deep in ``Optimizer.load_state_dict``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    parts = model if isinstance(model, (list, tuple)) else [model]
    expected = {k for part in parts for k in get_model_state_dict(part)}
    found = {"Missing": expected - set(loaded), "Unexpected": set(loaded) - expected}
    if any(found.values()):
        raise StateMismatchError(
            "Error(s) in loading the model state of TrainingState(fqn_optimizer_state=True):"
            + "".join(
                f"\n\t{what} key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(keys))
                for what, keys in found.items()
                if keys
            )
            + "\nbuild the model as it was saved, or load with strict=False to load what matches"
        )
