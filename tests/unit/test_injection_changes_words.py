"""``Injection.changes`` reports the word each edit wrote, also when one element is edited
twice (the live tensor then holds the second edit's word only)."""

from __future__ import annotations

import torch
from torch import nn

from stalwart import inject
from stalwart.inject import Fault


def _word(m: nn.Linear, i: int) -> int:
    return int(m.weight.detach().view(-1).view(torch.int32)[i]) & 0xFFFFFFFF


def test_element_edited_twice_lists_each_edit_with_its_own_after() -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    w0 = _word(m, 5)
    faults = [Fault("weight", 5, 1 << 30), Fault("weight", 5, 1 << 3)]
    with inject.apply_faults(m, faults) as inj:
        got = [(c.index, c.before, c.after) for c in inj.changes]
        assert _word(m, 5) == w0 ^ (1 << 30) ^ (1 << 3)
    w1 = w0 ^ (1 << 30)
    assert got == [(5, w0, w1), (5, w1, w1 ^ (1 << 3))]
    assert _word(m, 5) == w0  # restored
    # after restore the record still says what the injection did
    assert [(c.before, c.after) for c in inj.changes] == [(w0, w1), (w1, w1 ^ (1 << 3))]
