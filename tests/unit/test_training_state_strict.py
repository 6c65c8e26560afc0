"""TrainingState(fqn_optimizer_state=True) loads as strictly as the index-keyed path does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stalwart import Checkpointer, TrainingState
from stalwart.checkpoint.memory.snapshot import Snapshot
from stalwart.errors import StateMismatchError

pytestmark = pytest.mark.timeout(120)


def _trained(optimizer: type[torch.optim.Optimizer]) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    opt = optimizer(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


def _state(model: nn.Module, opt: Any) -> dict[str, Any]:
    return {"t": TrainingState(model=model, optimizer=opt, rng=False, fqn_optimizer_state=True)}


def _bigger(optimizer: type[torch.optim.Optimizer]) -> tuple[nn.Module, Any]:
    """The saved model plus a layer the checkpoint does not hold."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    return model, optimizer(model.parameters(), lr=0.1)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam])
@pytest.mark.parametrize("where", ["disk", "memory"])
def test_a_strict_load_names_the_model_keys_the_checkpoint_lacks(
    tmp_path: Path, optimizer: type[torch.optim.Optimizer], where: str
) -> None:
    # SGD loaded silently, leaving layer 1 as initialised; Adam failed with "float()
    # argument must be ... not 'dict'" from deep inside Optimizer.load_state_dict
    saved = _state(*_trained(optimizer))
    ckpt = Checkpointer(tmp_path / "ck")
    ckpt.save(1, saved)
    snapshot = Snapshot.capture(saved, 1)
    target = _state(*_bigger(optimizer))
    with pytest.raises(
        StateMismatchError, match=r'Missing key\(s\) in state_dict: "1.bias", "1.weight"'
    ):
        ckpt.load(target, 1) if where == "disk" else snapshot.restore_into(target)


def test_a_strict_load_names_keys_no_part_holds(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "ck")
    model, opt = _bigger(torch.optim.SGD)
    ckpt.save(1, _state(model, opt))
    smaller, small_opt = _trained(torch.optim.SGD)
    with pytest.raises(StateMismatchError, match=r'Unexpected key\(s\) in state_dict: "1.bias"'):
        ckpt.load(_state(smaller, small_opt), 1)


def test_a_non_strict_load_takes_what_matches(tmp_path: Path) -> None:
    model, opt = _trained(torch.optim.SGD)
    ckpt = Checkpointer(tmp_path / "ck")
    ckpt.save(1, _state(model, opt))
    bigger, big_opt = _bigger(torch.optim.SGD)
    layer1 = bigger[1].weight.detach().clone()
    ckpt.load(_state(bigger, big_opt), 1, strict=False)
    assert torch.equal(bigger[0].weight, model[0].weight)
    assert torch.equal(bigger[1].weight, layer1)  # nothing saved for it: left as it was
