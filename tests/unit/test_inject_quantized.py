"""Torch quantized tensors as targets: stored integers, scale and zero point, exact undo."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from stalwart import inject, vulnerability
from stalwart.errors import ConfigError


def _words(q: torch.Tensor) -> list[torch.Tensor]:
    """Stored integers, scales (as float64 bits) and zero points of a quantized tensor."""
    if q.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
        scales, zps = q.q_per_channel_scales(), q.q_per_channel_zero_points()
    else:
        scales, zps = torch.tensor([q.q_scale()]), torch.tensor([q.q_zero_point()])
    return [q.int_repr(), scales.to(torch.float64).view(torch.int64), zps.to(torch.int64)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_words(a), _words(b), strict=True))


@pytest.fixture(scope="module")
def qmlp() -> nn.Module:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(mlp, {nn.Linear}, dtype=torch.qint8).eval()


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _per_tensor() -> torch.Tensor:
    return torch.quantize_per_tensor(torch.linspace(-1, 1, 12), 0.01, 3, torch.qint8)


def _per_channel() -> torch.Tensor:
    scales, zps = torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0, 1, -2])
    return torch.quantize_per_channel(torch.randn(3, 4), scales, zps, 0, torch.qint8)


@pytest.mark.parametrize("make", [_per_tensor, _per_channel])
@pytest.mark.parametrize("part", ["values", "scale", "zero_point"])
def test_plain_tensor_parts_flip_in_place_and_undo(make, part: str) -> None:
    q = make()
    ref, ptr, before = q.clone(), q.untyped_storage().data_ptr(), q.dequantize()
    bits = {"values": 6, "scale": 60, "zero_point": 2}
    index = 0 if part != "values" and q.qscheme() == torch.per_tensor_affine else 1
    with inject.bitflip(q, part, index=index, bit=bits[part]) as inj:
        (change,) = inj.changes
        assert change.before ^ change.after == 1 << bits[part]
        after = q.dequantize()
        assert not torch.equal(after, before)
        if part == "values":  # exactly one element moved, by 64 steps of its scale
            diff = (after - before).flatten().nonzero().flatten().tolist()
            assert diff == [1]
    assert _same(q, ref)
    assert q.untyped_storage().data_ptr() == ptr  # the same tensor object and storage


@pytest.mark.parametrize("target", ["0.weight", "0.weight:scale", "0.weight:zero_point"])
def test_packed_dynamic_linear_weight_parts(qmlp: nn.Module, target: str) -> None:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    golden, w0 = qmlp(x), qmlp[0].weight()
    w_float = w0.dequantize()
    with inject.bitflip(qmlp, target, index=0, bit=5 if "scale" not in target else 62):
        w = qmlp[0].weight()
        assert not torch.equal(qmlp(x), golden)
        if target == "0.weight":  # one stored int8 moved by 2**5 steps
            delta = (w.dequantize() - w_float).flatten()
            assert delta.nonzero().flatten().tolist() == [0]
            assert abs(abs(float(delta[0])) - 32 * w0.q_scale()) < 1e-9
    assert _same(qmlp[0].weight(), w0)
    assert torch.equal(qmlp(x), golden)


def test_exceptions_and_ber_undo(qmlp: nn.Module) -> None:
    x = torch.randn(4, 8)
    golden, w0 = qmlp(x), qmlp[0].weight()
    with pytest.raises(KeyError), inject.bitflip(qmlp, "0.weight:zero_point", index=0, bit=4):
        raise KeyError("body failed")
    with inject.ber(qmlp, 0.02, "*", seed=2) as inj:
        assert {c.target.partition(":")[2] for c in inj.changes} >= {""}
    assert _same(qmlp[0].weight(), w0) and torch.equal(qmlp(x), golden)


def test_targets_listed_and_bad_names(qmlp: nn.Module) -> None:
    names = list(inject.targets.select_tensors(qmlp, "0.*", quantized=True))
    assert names == ["0.weight", "0.weight:scale", "0.weight:zero_point"]
    t = inject.targets.select_tensors(qmlp, "*:scale", quantized=True)
    assert {v.dtype for v in t.values()} == {torch.float64}
    with pytest.raises(ConfigError, match="not a quantized tensor"):
        inject.bitflip(nn.Linear(2, 2), "weight:scale", index=0, bit=1)
    with pytest.raises(ConfigError, match=":scale' or ':zero_point'"):
        inject.bitflip(qmlp, "0.weight:bias", index=0, bit=1)
    with pytest.raises(ConfigError, match="outside int8"):
        inject.bitflip(qmlp, "0.weight", index=0, bit=8)


def test_campaign_on_dynamically_quantized_mlp_reports_pvf_by_part(qmlp: nn.Module) -> None:
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(3))
    w0 = [qmlp[0].weight(), qmlp[2].weight()]
    reports = {
        engine: vulnerability.pvf(
            qmlp,
            x,
            ["top1", "dev>0.05"],
            vulnerability.PVFOptions(
                by="part", stop=vulnerability.FixedTrials(60), engine=engine, per_tensor=True
            ),
        )
        for engine in ("naive", "fast")
    }
    naive = reports["naive"]
    assert set(naive.table.column("group").to_pylist()) == {"values", "scale", "zero_point"}
    assert naive.result is not None and reports["fast"].result is not None
    for c in naive.criteria:  # same fault list, same outcomes, whichever engine
        assert (naive.result.failed[c] == reports["fast"].result.failed[c]).all()
    assert naive.result.manifest["dtypes"] == ["qint8"]
    assert "part" in naive.result.table().column_names
    assert _same(qmlp[0].weight(), w0[0]) and _same(qmlp[2].weight(), w0[1])
    # a NaN scale makes the next layer's dynamic quantization refuse: a failed trial
    nan = 0x7FF8000000000000
    faults = vulnerability.FaultList([inject.Fault("0.weight:scale", 0, nan, "assign")])
    res = vulnerability.run_campaign(qmlp, x, faults, "top1", engine="naive")
    assert res.failed["top1"][0] and res.nonfinite[0]
