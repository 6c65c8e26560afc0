"""An activation fault writes the same word with autograd on as under no_grad (the
straight-through ``output + (out - output)`` rounded it away), and the gradient passes."""

from __future__ import annotations

import torch
from torch import nn

from stalwart.inject import Fault, activation_faults


def test_the_faulted_word_is_exact_with_autograd_on() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    x = torch.ones(1, 4, requires_grad=True)
    fault = Fault("0", index=0, mask=1 << 29, kind="activation")  # an exponent bit
    with torch.no_grad():
        clean = model(x)[0, 0].clone()
    with activation_faults(model, [fault]):
        with torch.no_grad():
            quiet = model(x)[0, 0].clone()
        live = model(x)
    flipped = (clean.view(torch.int32) ^ (1 << 29)).view(torch.float32)
    assert torch.equal(quiet, flipped) and torch.equal(live[0, 0].detach(), flipped)
    live.sum().backward()  # as if unfaulted: d(sum)/dx is the weights' column sums
    assert torch.allclose(x.grad, model[0].weight.sum(0, keepdim=True))
