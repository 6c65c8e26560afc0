"""Silent data corruption on one process: exact bit flips, per-tensor digests that name the
flipped tensor, the suspects of a table, the chaos schedule, and fleet rows from event logs."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import stalwart
from stalwart.diagnose.fleet import read_fleet
from stalwart.elastic.events import EventKind, EventLog
from stalwart.elastic.fleet_log import write_fleet_log
from stalwart.elastic.sdc import SKELETON, first_difference, majority_ranks, tensor_digests
from stalwart.errors import ConfigError
from stalwart.testing import chaos
from stalwart.testing.bitflip import BitFlip, bit_range, flip_bit, flip_in_state


def _state(seed: int = 0) -> stalwart.TrainingState:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(4, 8)).sum().backward()
    opt.step()
    return stalwart.TrainingState(model=model, optimizer=opt)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("bit", [0, 7, 22, 23, 30, 31])
def test_a_flip_changes_exactly_one_bit_of_one_element(bit: int) -> None:
    t = torch.randn(5, 7, generator=torch.Generator().manual_seed(bit))
    before = t.clone()
    old, new = flip_bit(t, 11, bit)
    xor = (t.view(-1).view(torch.int32) ^ before.view(-1).view(torch.int32)).tolist()
    assert [i for i, v in enumerate(xor) if v] == [11]
    assert xor[11] & 0xFFFFFFFF == 1 << bit
    # the values returned are the element's before and after (NaN when the flip made one)
    assert _same(old, float(before.view(-1)[11])) and _same(new, float(t.view(-1)[11]))
    flip_bit(t, 11, bit)
    assert torch.equal(t, before), "a second flip restores the value"


def test_bit_classes_sign_exponent_and_finite_low_mantissa() -> None:
    assert list(bit_range(torch.float32, "sign")) == [31]
    assert list(bit_range(torch.float32, "exponent")) == list(range(23, 31))
    assert list(bit_range(torch.bfloat16, "mantissa")) == list(range(7))
    t = torch.tensor([0.75, -3.0])
    flip_bit(t, 1, 31)
    assert t.tolist() == [0.75, 3.0]
    for bit in bit_range(torch.float32, "low-mantissa"):
        x = torch.tensor([0.123])
        old, new = flip_bit(x, 0, bit)
        assert math.isfinite(new) and 0 < abs(new - old) < abs(old) * 2**-11
    with pytest.raises(ConfigError, match="bit class"):
        bit_range(torch.float32, "fraction")
    with pytest.raises(ConfigError, match="floating"):
        bit_range(torch.int64, "sign")


def test_a_seeded_flip_is_reproducible_and_travels_in_the_chaos_env() -> None:
    flip = BitFlip(worker=2, step=12, bit_class="exponent", prefix="optimizer.", seed=7)
    schedule = chaos.KillSchedule(flips=(flip,))
    assert chaos.KillSchedule.from_env(schedule.to_env()) == schedule
    a, b = _state(), _state()
    hit_a, hit_b = flip_in_state(a, flip), flip_in_state(b, flip)
    assert hit_a == hit_b and hit_a[0].startswith("optimizer.") and 23 <= hit_a[2] <= 30
    with pytest.raises(ConfigError, match="step >= 1"):
        BitFlip(worker=0, step=0)
    with pytest.raises(ConfigError, match="no tensor"):
        flip_in_state(a, BitFlip(worker=0, step=1, tensor="model.9.weight"))


def test_per_tensor_digests_name_the_flipped_tensor() -> None:
    a, b = _state(), _state()
    names, rows_a = tensor_digests(a)
    assert names[0] == SKELETON and "model.2.weight" in names
    assert first_difference(names, tensor_digests(b)[1], rows_a) is None
    flip_in_state(b, BitFlip(worker=0, step=1, tensor="model.2.weight", index=3, bit=2))
    assert first_difference(names, tensor_digests(b)[1], rows_a) == "model.2.weight"
    assert first_difference(names, rows_a[:-1], rows_a) == SKELETON, "another structure"


def test_majority_ranks_never_decide_a_tie() -> None:
    assert majority_ranks([(9, "a"), (9, "a"), (9, "b")]) == ([0, 1], "a")
    assert majority_ranks([(9, "a"), (9, "b")]) == ([], None)
    assert majority_ranks([(8, "b"), (9, "a"), (9, "a")]) == ([1, 2], "a")
    assert majority_ranks([(9, "a"), (9, "a"), (9, "b"), (9, "b")]) == ([], None)


class _Announcer:
    """What chaos.install needs of a job: listeners, and the state a flip corrupts."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.listeners: list[Any] = []

    def add_listener(self, fn: Any) -> None:
        self.listeners.append(fn)

    def announce(self, event: str, step: int) -> None:
        for fn in self.listeners:
            fn(event, step)


def test_install_flips_once_after_the_commit_of_its_step() -> None:
    state, ref = _state(), _state()
    job = _Announcer(state)
    flip = BitFlip(worker=1, step=3, tensor="model.0.weight", index=0, bit=20)
    chaos.install(job, chaos.KillSchedule(flips=(flip,)), worker=1)
    job.announce("step-begin", 3)
    job.announce("collective-enter", 3)
    assert torch.equal(state.model[0].weight, ref.model[0].weight), "not before the commit"
    job.announce("commit", 3)
    diff = (state.model[0].weight != ref.model[0].weight).view(-1).nonzero().view(-1).tolist()
    assert diff == [0]
    job.announce("commit", 3)  # recomputed after a rollback: not again
    assert int((state.model[0].weight != ref.model[0].weight).sum()) == 1
    with pytest.raises(ConfigError, match="state"):
        chaos.install(_Announcer(None), chaos.KillSchedule(flips=(flip,)), worker=1)


def _write_run(folder: Path) -> None:
    host = {"hostname": "node-a", "cpu_model": "cpu-x", "kernel": "6.1"}
    for wid in (0, 1, 2, 3):
        log = EventLog(folder, wid)
        log.write(EventKind.START, pid=100 + wid, host={**host, "hostname": f"node-{wid}"})
        for step in range(1, 6 if wid != 1 else 3):
            log.write(EventKind.STEP, step=step, committed=True, epoch=1, members=[0, 1, 2], dt=0.1)
        if wid in (0, 2):  # both members of the majority write the same suspect: one fault
            log.write(EventKind.SDC_SUSPECT, step=5, epoch=1, suspect=3, tensor="model.0.weight",
                      decided_by="majority")  # fmt: skip
        log.close()
    launcher = EventLog(folder, -1, name="launcher.jsonl")
    for wid, old in ((0, None), (1, None), (2, None), (3, 1)):
        launcher.write(EventKind.SPAWNED, wid=wid, replaces=old)
    launcher.write(EventKind.EXITED, wid=1, rc=-9, stopped=False)
    launcher.write(EventKind.STRAGGLER, wid=2, own_median=0.3, others_median=0.1, ratio=3.0,
                   step=4)  # fmt: skip
    for wid in (0, 2, 3):
        launcher.write(EventKind.EXITED, wid=wid, rc=0, stopped=False)
    launcher.close()


def test_fleet_rows_from_an_events_folder_are_read_by_the_fleet_reader(tmp_path: Path) -> None:
    _write_run(tmp_path / "events")
    rows = write_fleet_log(tmp_path / "events", tmp_path / "fleet" / "run-1",
                           attributes={"job": "mlp"})  # fmt: skip
    ident = {(m["worker"], m["incarnation"], m["steps"]) for m in rows.members}
    assert ident == {(0, 0, 5), (1, 0, 2), (2, 0, 5), (1, 1, 5)}, "worker 3 replaces worker 1"
    faults = sorted((f["kind"], f["worker"], f["incarnation"], f["step"], f["decided_by"],
                     f["tensor"], f["host"]["hostname"]) for f in rows.faults)  # fmt: skip
    assert faults == [
        ("crash", 1, 0, 2, "exit-signal", None, "node-1"),
        ("sdc_suspect", 1, 1, 5, "parity-majority", "model.0.weight", "node-3"),
        ("straggler", 2, 0, 4, "step-time-outlier", None, "node-2"),
    ]
    log = read_fleet(tmp_path / "fleet")
    assert log.table.num_rows == 4
    with pytest.raises(ConfigError, match="stalwart run --events"):
        write_fleet_log(tmp_path / "nothing")
