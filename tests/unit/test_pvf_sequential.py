"""A campaign is an object: sequential stopping appends rounds to one Campaign (golden outputs
and trace built once, earlier trials never judged again), with the same outcomes as the old
concatenate-and-rerun loop; PVF options and stopping rules are typed and validated."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from stalwart import inject, models, vulnerability
from stalwart.errors import ConfigError
from stalwart.vulnerability import (
    Campaign,
    FaultList,
    FixedTrials,
    PVFOptions,
    UntilWidth,
    estimate,
    run_campaign,
    sample_faults,
)
from stalwart.vulnerability.options import Engine, FaultKind, Interval


@pytest.fixture(scope="module")
def digits() -> models.ReferenceModel:
    return models.load("digits-cnn")


def _old_sequential(
    model: nn.Module, x: torch.Tensor, crits: list[str], stop: UntilWidth, seed: int
) -> vulnerability.CampaignResult:
    """The loop ``pvf`` ran before campaigns were objects: every round concatenates the fault
    lists and re-runs ``run_campaign`` over all trials so far (by="tensor", stratified)."""
    per_round = max(
        1, stop.trials // len(inject.targets.select_tensors(model, "*", quantized=True))
    )
    faults = FaultList([], seed, "", {})
    targets: object = "*"
    rnd = 0
    while True:
        part = sample_faults(
            model, per_round, targets=targets, seed=seed + 7919 * rnd, per_tensor=True
        )
        faults = FaultList(
            faults.faults + part.faults, seed, part.error, faults.population | part.population
        )
        result = run_campaign(model, x, faults, crits)
        rnd += 1
        wide = stop.next_round(estimate(result, "tensor"), len(faults))
        if not wide:
            return result
        targets = wide


class _Forwards:
    """Counts calls of the model's own forward (hooks on the root module)."""

    def __init__(self, model: nn.Module) -> None:
        self.n = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *_: object) -> None:
        self.n += 1


def test_rounds_append_without_rerunning_and_equal_the_old_loop(
    digits: models.ReferenceModel,
) -> None:
    x, crits = digits.inputs[0][:60], ["top1", "dev>0.05"]
    stop = UntilWidth(0.12, trials=160, max_trials=1200)
    forwards = _Forwards(digits.model)
    try:
        report = vulnerability.pvf(digits.model, x, crits, PVFOptions(stop=stop, seed=1))
        new_forwards = forwards.n
    finally:
        forwards.handle.remove()
    new = report.result
    assert new is not None and len(new) > 160  # more than one round ran
    old = _old_sequential(digits.model, x, crits, stop, seed=1)
    assert new.faults.faults == old.faults.faults
    for c in crits:
        assert np.array_equal(new.failed[c], old.failed[c]), c
        assert np.array_equal(new.rate[c], old.rate[c], equal_nan=True), c
    assert np.array_equal(new.nonfinite, old.nonfinite)
    assert new.attributes == old.attributes
    assert estimate(old, "tensor").rows == report.rows
    assert new.manifest["trials"] == len(new) and new.manifest["seed"] == old.manifest["seed"]
    # The model's own forward ran once for the golden output (which also checks the trace)
    # and once per trial the naive loop re-judged: no round traced again or re-ran old trials.
    assert new_forwards == 1 + int(new.rechecked.sum())
    assert new.manifest["rechecked"] == int(new.rechecked.sum())


def test_naive_engine_judges_each_trial_once(digits: models.ReferenceModel) -> None:
    x = digits.inputs[0][:20]
    forwards = _Forwards(digits.model)
    try:
        campaign = Campaign(digits.model, x, "top1", engine="naive")
        first = campaign.run(sample_faults(digits.model, 30, seed=0))
        second = campaign.run(sample_faults(digits.model, 20, seed=1))
    finally:
        forwards.handle.remove()
    assert forwards.n == 1 + 30 + 20  # golden, then one forward per new trial
    assert campaign.engine is Engine.NAIVE
    assert (len(first), len(second), len(campaign.result)) == (30, 20, 50)
    both = first.faults.faults + second.faults.faults
    assert campaign.result.faults.faults == both
    assert np.array_equal(
        campaign.result.failed["top1"],
        np.concatenate([first.failed["top1"], second.failed["top1"]]),
    )
    assert campaign.result.manifest["trials"] == 50


def test_extend_checks_its_inputs(digits: models.ReferenceModel) -> None:
    x = digits.inputs[0][:20]
    faults = sample_faults(digits.model, 8, targets="fc2.*", seed=0)
    a = run_campaign(digits.model, x, faults, "top1", engine="naive")
    b = run_campaign(digits.model, x, faults, "top5", engine="naive")
    with pytest.raises(ConfigError, match="same criteria"):
        a.extend(b)
    with pytest.raises(ConfigError, match="8 \\+ 8 trials"):
        a.extend(a, faults)
    both = a.extend(a)
    assert len(both) == 16 and both.manifest["trials"] == 16
    assert both.manifest["rechecked"] == 2 * a.manifest["rechecked"]


def test_options_are_typed_and_validated() -> None:
    opts = PVFOptions(engine="naive", interval="clopper-pearson", kind="param", error="bitflip")
    assert opts.engine is Engine.NAIVE and opts.interval is Interval.CLOPPER_PEARSON
    assert opts.kind is FaultKind.PARAM and isinstance(opts.error, inject.BitFlip)
    assert PVFOptions().stop == FixedTrials(2000) and PVFOptions(by="bit").stratified is False
    bad = [
        (dict(engine="turbo"), r"engine='turbo': use one of fast, naive, copy"),
        (dict(interval="bayes"), r"interval='bayes': use one of wilson, clopper-pearson"),
        (dict(kind="grad"), r"kind='grad': use one of param, activation"),
        (dict(by="neuron"), "by must be one of"),
        (dict(by="component"), "needs components="),
        (dict(stop=500), r"stop=500: expected a stopping rule such as FixedTrials"),
        (dict(confidence=95), "expected a level in"),
        (dict(error="cosmic"), "unknown error model"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ConfigError, match=message):
            PVFOptions(**kwargs)
    with pytest.raises(ConfigError, match=r"half_width=2\): expected a probability in \(0, 0.5\)"):
        UntilWidth(2)
    with pytest.raises(ConfigError, match="expected an integer >= 1"):
        FixedTrials(0)
    with pytest.raises(ConfigError, match="options must be a PVFOptions"):
        vulnerability.pvf(nn.Linear(2, 2).eval(), torch.zeros(1, 2), "top1", {"trials": 4})  # type: ignore[arg-type]


def test_activation_faults_by_module(digits: models.ReferenceModel) -> None:
    x = digits.inputs[0][:40]
    opts = PVFOptions(
        kind=FaultKind.ACTIVATION,
        targets=["fc1", "conv2"],
        error=inject.BitFlip(bit=30),
        stop=FixedTrials(40),
    )
    report = vulnerability.pvf(digits.model, x, "top1", opts)
    assert set(report.table.column("group").to_pylist()) == {"fc1", "conv2"}
    assert report.table.column("trials").to_pylist() == [20, 20]  # stratified per module
    assert report.result is not None and {f.kind for f in report.result.faults} == {"activation"}
