"""The in-reduction signals' decision (:func:`stalwart.elastic.commit.grad_signals`) and the
``GradFlip`` chaos fault that feeds them: plain values and a real small model's gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import stalwart
from stalwart.elastic import Job
from stalwart.elastic.commit import DEFAULT_GRAD_NORM_K, AllReduceCommit, grad_signals
from stalwart.errors import ConfigError, DistributedError
from stalwart.testing.bitflip import flip_grad
from stalwart.testing.chaos import GradFlip, KillSchedule


def test_a_non_finite_count_names_its_member_and_only_it() -> None:
    assert grad_signals([0, 3, 0], [1.0, 1.0, 1.0], DEFAULT_GRAD_NORM_K) == ([1], [])
    assert grad_signals([0, 0], [1.0, 1.0], DEFAULT_GRAD_NORM_K) == ([], [])


def test_a_norm_far_above_the_others_median_is_an_outlier() -> None:
    # norms 1, 1.1, 50: 50 > 10 * median(1, 1.1)
    assert grad_signals([0, 0, 0], [1.0, 1.21, 2500.0], 10.0) == ([], [2])
    assert grad_signals([0, 0, 0], [1.0, 1.21, 81.0], 10.0) == ([], []), "9x is not 10x"


def test_the_norm_rule_needs_three_members_and_is_off_at_zero() -> None:
    assert grad_signals([0, 0], [1.0, 1e6], 10.0) == ([], [])
    assert grad_signals([0, 0, 0], [1.0, 1.0, 1e6], 0.0) == ([], [])


def test_a_non_finite_member_is_left_out_of_the_others_median() -> None:
    bad, outliers = grad_signals([0, 1, 0, 0], [1.0, 1e12, 1.0, 1.0], 10.0)
    assert (bad, outliers) == ([1], [])


def test_a_negative_factor_is_refused() -> None:
    with pytest.raises(ConfigError, match="grad_norm_k"):
        AllReduceCommit(grad_norm_k=-1.0)


def test_a_grad_flip_writes_one_element_and_travels_in_the_environment() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    state = stalwart.TrainingState(model=model, optimizer=torch.optim.SGD(model.parameters()))
    model(torch.randn(5, 4)).sum().backward()
    flip = GradFlip(1, 7, "2.weight", index=2)
    schedule = KillSchedule.from_env(KillSchedule(grad_flips=(flip,)).to_env())
    (back,) = schedule.grad_flips
    assert (back.worker, back.step, back.param, back.index) == (1, 7, "2.weight", 2)
    assert math.isnan(back.value)
    assert flip_grad(state, back) == "2.weight"
    grad = model[2].weight.grad.view(-1)
    assert math.isnan(float(grad[2])) and int(torch.isfinite(grad).sum()) == grad.numel() - 1
    with pytest.raises(ConfigError, match="no parameter"):
        flip_grad(state, GradFlip(1, 7, "nope"))


def test_non_finite_gradients_twice_at_one_step_are_not_transient() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    job = Job(stalwart.TrainingState(model=model, optimizer=opt), world="single")
    model = job.data_parallel(model)
    optimizer = job.optimizer(opt)
    before = [p.detach().clone() for p in model.parameters()]
    for attempt in range(2):
        optimizer.zero_grad()
        model(torch.full((3, 4), float("nan"))).sum().backward()
        if attempt == 0:
            optimizer.step()  # discarded: a transient flip would recompute clean
            assert job.step == 0
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        else:
            with pytest.raises(DistributedError, match="non-finite again at step 0"):
                optimizer.step()
    job.close()
