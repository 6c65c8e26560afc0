"""The SDC exclusion policy's parts on real files, and gradient bit flips by class.

The policy travels from the launcher to its workers as ``policy.json`` in the events folder;
a worker counts the verdicts that named it from its own event file (distinct checks; a split
with no majority and a gradient-norm outlier are not verdicts). The end-to-end run (a worker
named twice leaves with ``EXIT_EXCLUDED`` and is not replaced) is in
``tests/distributed/test_sdc.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import stalwart
from stalwart.elastic import launch
from stalwart.elastic.events import EventLog, SdcSuspect
from stalwart.elastic.sdc import (
    POLICY_FILE,
    exclusion_threshold,
    verdicts_against,
    write_policy,
)
from stalwart.errors import ConfigError
from stalwart.testing.bitflip import bit_range, flip_grad
from stalwart.testing.chaos import GradFlip, KillSchedule


def test_the_policy_file_is_written_read_and_removed(tmp_path: Path) -> None:
    assert exclusion_threshold(tmp_path) == 0, "no file: off"
    write_policy(tmp_path, 3)
    assert exclusion_threshold(tmp_path) == 3
    write_policy(tmp_path, 0)
    assert not (tmp_path / POLICY_FILE).exists() and exclusion_threshold(tmp_path) == 0


def test_verdicts_count_distinct_checks_that_single_the_worker_out(tmp_path: Path) -> None:
    log = EventLog(tmp_path, 4)

    def named(step: int, suspect: int, rule: str, epoch: int = 1) -> None:
        log.record(SdcSuspect(step=step, epoch=epoch, suspect=suspect, tensor=None,
                              decided_by=rule))  # fmt: skip

    named(10, 4, "majority")
    named(10, 4, "majority")  # the same check written twice counts once
    named(12, 4, "nonfinite-count")
    named(15, 4, "rollback")  # a split names everyone: not a verdict
    named(16, 4, "grad-norm")  # a signal, the step kept: not a verdict
    named(20, 7, "majority")  # another worker, in worker 4's file
    named(25, 4, "majority", epoch=2)
    log.close()
    assert verdicts_against(tmp_path, 4) == 3
    assert verdicts_against(tmp_path, 7) == 0, "each worker counts from its own file"


def test_the_launcher_refuses_a_negative_threshold_and_rdzv(tmp_path: Path) -> None:
    script = tmp_path / "never.py"
    with pytest.raises(ConfigError, match="exclude_suspect_after"):
        launch(script, nproc=2, exclude_suspect_after=-1, events_dir=tmp_path / "e")
    with pytest.raises(ConfigError, match="rdzv"):
        launch(script, nproc=2, exclude_suspect_after=2, rdzv="127.0.0.1:1", nnodes="1:2")


@pytest.mark.parametrize("bit_class", ["sign", "exponent", "mantissa", "low-mantissa"])
def test_a_grad_flip_flips_one_bit_of_its_class_and_travels(bit_class: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    state = stalwart.TrainingState(model=model, optimizer=torch.optim.SGD(model.parameters()))
    model(torch.randn(5, 4)).sum().backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    flip = GradFlip(2, 9, index=-1, bit_class=bit_class, seed=5)
    (back,) = KillSchedule.from_env(KillSchedule(grad_flips=(flip,)).to_env()).grad_flips
    assert back == flip or (math.isnan(back.value) and back.bit_class == bit_class)
    name = flip_grad(state, back)
    after = dict(model.named_parameters())[name].grad
    diff = (after.view(-1).view(torch.int32) ^ before[name].view(-1).view(torch.int32)).tolist()
    changed = [(i, d) for i, d in enumerate(diff) if d]
    assert len(changed) == 1, "one element"
    bit = (changed[0][1] & 0xFFFFFFFF).bit_length() - 1
    assert changed[0][1] & 0xFFFFFFFF == 1 << bit and bit in bit_range(torch.float32, bit_class)
    for other, grad in before.items():
        if other != name:
            assert torch.equal(dict(model.named_parameters())[other].grad, grad)


def test_a_grad_flip_of_an_unknown_class_is_refused() -> None:
    with pytest.raises(ConfigError, match="bit_class"):
        GradFlip(0, 1, bit_class="middle")
