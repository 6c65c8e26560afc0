"""Error models act on real storage bits and undo exactly, for every supported dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from stalwart import inject
from stalwart.errors import ConfigError, UnsupportedValueError
from stalwart.inject import Fault

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
]


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(inject.bits.layout_of(t.dtype).storage).clone()


def _tensor(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, generator=g) * 3
    return (x.round().to(dtype) if not dtype.is_floating_point else x.to(dtype)).contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_bit_flips_exactly_one_storage_bit_and_undoes(dtype: torch.dtype) -> None:
    t = _tensor(dtype)
    before = _raw(t)
    layout = inject.bits.layout_of(dtype)
    for bit in range(layout.bits):
        with inject.bitflip(t, index=7, bit=bit) as inj:
            diff = (_raw(t) ^ before).view(-1)
            assert int(diff[7]) & ((1 << layout.bits) - 1) == 1 << bit
            assert int((diff != 0).sum()) == 1
            (change,) = inj.changes
            assert change.before ^ change.after == 1 << bit
        assert torch.equal(_raw(t), before)


def test_known_values() -> None:
    t = torch.tensor([1.5, 0.25])
    with inject.bitflip(t, index=0, bit=31):
        assert t[0].item() == -1.5
    with inject.bitflip(t, index=1, bit=30):  # exponent MSB: 2**-2 -> 2**126
        assert t[1].item() == 2.0**126
    q = torch.tensor([1, -2], dtype=torch.int8)
    with inject.bitflip(q, index=0, bit=7):
        assert q[0].item() == -127
    b = torch.tensor([1.0], dtype=torch.bfloat16)
    with inject.bitflip(b, index=0, bit=[7, 8]):  # bf16 exponent LSBs
        assert b.item() != 1.0
    assert b.item() == 1.0


def test_undo_on_exception_and_nan() -> None:
    model = nn.Linear(4, 3)
    before = model.weight.detach().clone()
    with (
        pytest.raises(RuntimeError, match="boom"),
        inject.bitflip(model, "weight", index=(1, 2), bit=[23, 24, 25, 26, 27, 28, 29, 30]),
    ):
        assert not torch.equal(model.weight.detach(), before)
        raise RuntimeError("boom")
    assert torch.equal(model.weight.detach().view(torch.int32), before.view(torch.int32))


def test_stuck_at_and_random_value() -> None:
    t = torch.tensor([0.0, 1.0])
    with inject.stuck_at(t, index=1, bit=31, value=1):
        assert t[1].item() == -1.0
    with inject.stuck_at(t, index=1, bit=31, value=0):
        assert t[1].item() == 1.0  # already 0: stuck-at-0 changes nothing
    with inject.random_value(t, index=0, value=7.25):
        assert t[0].item() == 7.25
    assert t.tolist() == [0.0, 1.0]


@pytest.mark.parametrize(
    "model_",
    [
        inject.BitFlip(field="exponent"),
        inject.MultiBitFlip(3),
        inject.BurstFlip(4),
        inject.StuckAt(0),
        inject.RandomValue(),
        inject.RandomValue(-1.0, 1.0),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2])
def test_error_models_replay_and_undo(model_: inject.ErrorModel, dtype: torch.dtype) -> None:
    lin = nn.Linear(6, 5).to(dtype)
    layout = inject.bits.layout_of(dtype)
    idx, masks, op = model_.draw(layout, lin.weight.numel(), 20, np.random.default_rng(1))
    idx2, masks2, _ = model_.draw(layout, lin.weight.numel(), 20, np.random.default_rng(1))
    assert idx.tolist() == idx2.tolist() and masks == masks2  # seeded: replayable
    faults = [Fault("weight", int(i), m, op) for i, m in zip(idx, masks, strict=True)]
    before = _raw(lin.weight)
    with inject.apply_faults(lin, faults) as inj:
        assert len(inj) == len(faults)
    assert torch.equal(_raw(lin.weight), before)
    if isinstance(model_, inject.MultiBitFlip):
        assert all(bin(m).count("1") == 3 for m in masks)
    if isinstance(model_, inject.BurstFlip):
        assert all(
            bin(m).count("1") == 4 and bin(m).strip("0b").count("0") == 0
            for m in [m >> (m & -m).bit_length() - 1 for m in masks]
        )


def test_ber_flips_about_p_times_bits_and_undoes() -> None:
    model = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 10))
    before = {n: _raw(p) for n, p in model.named_parameters()}
    total = sum(p.numel() for p in model.parameters()) * 32
    with inject.ber(model, 1e-3, seed=5) as inj:
        flipped = sum(bin(c.before ^ c.after).count("1") for c in inj.changes)
        assert abs(flipped - total * 1e-3) < 5 * (total * 1e-3) ** 0.5
    for n, p in model.named_parameters():
        assert torch.equal(_raw(p), before[n])


def test_activation_faults_hit_one_sample_each() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    x = torch.randn(4, 8)
    golden = model(x)
    faults = [Fault("0", index=2, mask=1 << 30, kind="activation", sample=1)]
    with inject.activation_faults(model, faults):
        out = model(x)
    changed = (out != golden).any(1)
    assert changed.tolist() == [False, True, False, False]
    assert torch.equal(model(x), golden)  # hooks removed


def test_refused_activation_faults_leave_no_hook_on_the_model() -> None:
    # One target is a typo: the refusal came after the good target's hook was on, and since
    # the caller never got the injector it could not remove it; every later forward was
    # corrupted. Now every target is checked before any hook goes on.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    x = torch.randn(4, 8)
    golden = model(x)
    faults = [Fault(t, index=2, mask=1 << 30, kind="activation") for t in ("0", "nope")]
    with pytest.raises(ConfigError, match="no module 'nope'"):
        inject.activation_faults(model, faults)
    assert not model[0]._forward_hooks
    assert torch.equal(model(x), golden)


def test_gradient_and_optimizer_state_faults() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    model(torch.randn(2, 3)).sum().backward()
    g = model.weight.grad.clone()  # type: ignore[union-attr]
    m = opt.state[model.weight]["exp_avg"].clone()
    faults = [
        Fault("weight", 0, 1 << 31, kind="grad"),
        Fault("weight", 1, 1 << 31, kind="optim", state="exp_avg"),
    ]
    with inject.apply_faults(model, faults, optimizer=opt):
        assert model.weight.grad[0, 0] == -g[0, 0]  # type: ignore[index]
        assert opt.state[model.weight]["exp_avg"][0, 1] == -m[0, 1]
    assert torch.equal(model.weight.grad, g)
    assert torch.equal(opt.state[model.weight]["exp_avg"], m)


def test_bad_input_errors_say_what_to_do() -> None:
    model = nn.Linear(3, 2)
    with pytest.raises(ConfigError, match=r"matches no parameter.*available: weight, bias"):
        inject.targets.select_tensors(model, "conv*")
    with pytest.raises(ConfigError, match=r"bit 32 is outside float32.*0..31"):
        inject.bitflip(model, "weight", index=0, bit=32)
    with pytest.raises(ConfigError, match=r"bit 16 is outside bfloat16.*0..15"):
        inject.bitflip(model.weight.detach().bfloat16(), index=0, bit=16)
    with pytest.raises(UnsupportedValueError, match=r"complex64.*supported"):
        inject.bitflip(torch.zeros(2, dtype=torch.complex64), index=0, bit=1)
    with pytest.raises(ConfigError, match="index 6 is outside"):
        inject.bitflip(model, "weight", index=6, bit=1)
    with pytest.raises(ConfigError, match="did you mean: weight"):
        inject.bitflip(model, "weigth", index=0, bit=1)
    with pytest.raises(ConfigError, match=r"no .grad yet"):
        inject.apply_faults(model, [Fault("weight", 0, 1, kind="grad")])
    assert set(inject.targets.select_tensors(model, "*", module_types=[nn.Linear])) == {
        "weight",
        "bias",
    }
