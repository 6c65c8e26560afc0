"""Fresh optimizers primed before a load (``stalwart.checkpoint.fresh_optimizers``).

A zero step at a learning rate of zero creates the state a load then fills in place (the loads
prime optimizers of DTensors only: ``test_fresh_optimizer_dist.py``); it must not move a
parameter or lose a gradient, must skip what it cannot prime, and a load into a fresh optimizer
must then train on exactly as the optimizer that was saved.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import stalwart
from stalwart.checkpoint import Checkpointer
from stalwart.checkpoint.fresh_optimizers import prime_fresh_optimizers

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1),
    "adam-tensor-lr": lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.01)),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_the_zero_step_moves_no_parameter_and_keeps_the_gradients(kind: str) -> None:
    model = _model()
    opt = OPTIMIZERS[kind](model.parameters())
    params = list(model.parameters())
    params[0].grad = torch.full_like(params[0], 3.0)  # one gradient set, the others None
    before = [p.detach().clone() for p in params]
    lrs = [g["lr"] for g in opt.param_groups]
    prime_fresh_optimizers({"nested": [opt]})
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert torch.equal(params[0].grad, torch.full_like(params[0], 3.0))
    assert all(p.grad is None for p in params[1:])
    assert [g["lr"] for g in opt.param_groups] == lrs
    moments = [v for p in params for v in opt.state[p].values() if v.dim() > 0]
    assert moments and all(v.shape in {p.shape for p in params} for v in moments)


def test_what_cannot_be_primed_is_left_as_it_was() -> None:
    model = _model()
    lbfgs = torch.optim.LBFGS(model.parameters())  # its step needs a closure
    by_fqn = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prime_fresh_optimizers(
        [lbfgs, stalwart.TrainingState(model=model, optimizer=by_fqn, fqn_optimizer_state=True)]
    )
    assert not lbfgs.state and not by_fqn.state
    trained = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, trained, 0)
    buffers = [s["momentum_buffer"].clone() for s in trained.state.values()]
    prime_fresh_optimizers(stalwart.TrainingState(model=model, optimizer=trained))
    assert all(torch.equal(s["momentum_buffer"], b)
               for s, b in zip(trained.state.values(), buffers, strict=True))  # fmt: skip


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_fresh_optimizer_loads_and_trains_on_as_the_saved_one(tmp_path: Path, kind: str) -> None:
    model = _model()
    opt = OPTIMIZERS[kind](model.parameters())
    for s in range(2):
        _step(model, opt, s)
    fresh_model = _model()
    fresh_opt = OPTIMIZERS[kind](fresh_model.parameters())
    with Checkpointer(tmp_path) as ck:
        ck.save(2, stalwart.TrainingState(model=model, optimizer=opt))
        ck.load(stalwart.TrainingState(model=fresh_model, optimizer=fresh_opt))
    _step(model, opt, 2)
    _step(fresh_model, fresh_opt, 2)
    for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(p, q)
        assert opt.state[p].keys() == fresh_opt.state[q].keys()
        assert all(torch.equal(opt.state[p][k], fresh_opt.state[q][k]) for k in opt.state[p])
