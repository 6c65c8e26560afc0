"""Selective bit protection as stored redundancy (shadow + parity), measured, next to the
modelled SECDED row; false-alarm rates of every detector on clean held-out inputs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from stalwart import inject, models, protect, vulnerability
from stalwart.errors import ConfigError


def _linear(dtype: torch.dtype = torch.float32, n: int = 20) -> tuple[nn.Module, nn.Linear]:
    torch.manual_seed(0)
    lin = nn.Linear(n, 3, bias=False)
    lin.weight.data = lin.weight.data.to(dtype)
    model = nn.Sequential()
    model.add_module("fc", lin)
    return model.eval(), lin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_shadow_corrects_protected_bits_before_each_forward(dtype: torch.dtype) -> None:
    model, lin = _linear(dtype)
    clean = lin.weight.detach().clone()
    sbp = protect.ShadowBitProtection(model, ("sign", "exponent"))
    lay = inject.bits.layout_of(dtype)
    top, mant = lay.bits - 2, 0  # an exponent bit and a mantissa bit
    faults = [
        inject.Fault("fc.weight", 0, 1 << top),  # protected: corrected
        inject.Fault("fc.weight", 1, 1 << mant),  # unprotected: stays
        inject.Fault("fc.weight", 2, (1 << top) | (1 << (lay.bits - 1))),  # 2 protected flips
    ]
    with inject.apply_faults(model, faults):
        assert sbp.check() == 2  # words 0 and 2 differ from their shadow
        w, c = lin.weight.detach().view(-1), clean.view(-1)
        assert w[0].view(lay.storage) == c[0].view(lay.storage)
        assert w[1].view(lay.storage) != c[1].view(lay.storage)
        assert w[2].view(lay.storage) == c[2].view(lay.storage)  # parity even: ambiguous
        assert (sbp.corrected, sbp.ambiguous, sbp.uncorrectable) == (2, 1, 0)
    assert torch.equal(lin.weight.view(lay.storage), clean.view(lay.storage))


def test_shadow_check_runs_on_use_and_parity_arbitrates() -> None:
    model, lin = _linear()
    sbp = protect.ShadowBitProtection(model)
    x = torch.randn(4, 20)
    golden = model(x)
    with sbp.attach(model), torch.no_grad():
        with inject.bitflip(lin, "weight", index=(1, 3), bit=30):
            assert torch.equal(model(x), golden)  # the pre-hook restored the word
        assert sbp.checks == 1 and sbp.alarms == 1
    store = sbp.stores["fc.weight"]
    store.shadow[5] ^= 1  # a fault in the shadow itself: the word's parity still holds
    assert sbp.check() == 1 and sbp.shadow_repaired == 1
    assert sbp.check() == 0  # the shadow was refreshed from the intact word
    raw = lin.weight.detach().view(torch.int32).view(-1)
    store.shadow[6] ^= 1
    raw[6] ^= 1 << 24  # both copies fail parity: detected, left alone
    assert sbp.check() == 1 and sbp.uncorrectable == 1
    raw[6] ^= 1 << 24


def test_shadow_cost_is_the_stored_bytes() -> None:
    model, _ = _linear(n=20)  # 60 fp32 words
    sbp = protect.ShadowBitProtection(model, ("sign", "exponent"))
    store = sbp.stores["fc.weight"]
    assert store.shadow.dtype == torch.int16  # 9 bits a word
    cost = sbp.cost(model)
    assert cost["extra_bytes"] == 60 * 2 + math.ceil(60 / 8)
    assert cost["protected_bits_share"] == pytest.approx(9 / 32)
    assert cost["storage_overhead"] == pytest.approx(cost["extra_bytes"] / (60 * 4))
    assert sbp.false_alarms(model, ()) == 0.0
    with pytest.raises(ConfigError, match="no floating-point parameter"):
        protect.ShadowBitProtection(model, tensors="top.*")


def test_evaluate_labels_measured_and_modelled_rows_with_false_alarms() -> None:
    ref = models.load("digits-cnn")
    m = ref.model
    split = protect.split_inputs((ref.inputs[0][:160],), ref.labels[:160], 0.5, seed=1)
    faults = vulnerability.sample_faults(m, 30, seed=2, error=inject.BitFlip(field="exponent"))
    ps = [
        protect.SelectiveBitProtection(),
        protect.ShadowBitProtection(m),
        protect.ActivationClipping(m, split.calibration),
        protect.ABFT(m, split.calibration),
    ]
    res = {r.name: r for r in protect.evaluate(m, split.evaluation, faults, ps, repeats=2)}
    assert res["sbp"].basis == "modelled" and math.isnan(res["sbp"].overhead)
    assert math.isnan(res["sbp"].overhead_s)
    shadow = res["sbp-shadow"]
    assert shadow.basis == "measured" and not math.isnan(shadow.overhead_s)
    assert shadow.failures == 0 and shadow.false_alarm_rate == 0.0  # every flip is covered
    assert shadow.cost["extra_bytes"] > res["sbp"].cost["extra_bytes"]  # stored, not counted
    for name in ("clip", "abft"):
        assert 0.0 <= res[name].false_alarm_rate <= 1.0
    # Scored on its own calibration inputs a detector never fires: the rate is held-out only.
    assert ps[2].false_alarms(m, split.calibration) == 0.0
    assert ps[3].false_alarms(m, split.calibration) == 0.0
    table = protect.ProtectionResults(res.values()).to_arrow()
    assert {"basis", "false_alarm_rate", "overhead_s"} <= set(table.column_names)


def test_clip_false_alarms_count_inputs_outside_the_bounds() -> None:
    model, _ = _linear(n=4)
    model = nn.Sequential(model, nn.Linear(3, 2)).eval()
    cal = (torch.ones(10, 4) * 0.1,)
    clip = protect.ActivationClipping(model, cal)
    held = torch.ones(8, 4) * 0.1
    held[:2] *= 50  # two inputs far outside what calibration saw
    assert clip.false_alarms(model, (held,)) == pytest.approx(2 / 8)
