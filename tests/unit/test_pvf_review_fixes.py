"""Fixes from the PVF review, each checked against brute force on a tiny model: in-place ops
and tied weights in the fast engine, PVF of groups that span several tensors under
stratified sampling, float64 outputs above float32's range, bfloat16 inputs in protections,
and bit-narrowing rounds on a model mixing float32 and float16."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from stalwart import vulnerability
from stalwart.errors import ConfigError
from stalwart.inject import BitFlip, Fault, activation_faults
from stalwart.inject.bits import layout_of
from stalwart.protect import ABFT, ActivationClipping, SelectiveBitProtection, evaluate
from stalwart.protect.base import row_fingerprints
from stalwart.vulnerability import (
    CampaignResult,
    FaultList,
    FixedTrials,
    PVFOptions,
    UntilWidth,
    estimate,
    pvf,
    run_campaign,
    sample_faults,
)
from stalwart.vulnerability.engine import FastEngine
from stalwart.vulnerability.output_checks import flat_rows

Judge = Callable[[torch.Tensor, torch.Tensor], bool]


def _top1(golden: torch.Tensor, y: torch.Tensor) -> bool:
    """The ``top1`` criterion, by hand: some input's class changed or went non-finite."""
    return bool(((y.argmax(-1) != golden.argmax(-1)) | ~torch.isfinite(y).all(-1)).any())


def _dev(tau: float) -> Judge:
    """The ``dev>tau`` criterion, by hand."""

    def judge(golden: torch.Tensor, y: torch.Tensor) -> bool:
        g, f = golden.reshape(len(golden), -1), y.reshape(len(y), -1)
        diff = (torch.nan_to_num(f, nan=torch.inf) - g).abs().amax(-1)
        over = diff / (g.abs().amax(-1) + 1e-30) > tau
        return bool((over | ~torch.isfinite(f).all(-1)).any())

    return judge


def _flip(p: torch.Tensor, index: int, mask: int) -> None:
    """XOR ``mask`` into element ``index``'s storage word (twice restores it)."""
    layout = layout_of(p.dtype)
    raw = p.data.view(layout.storage).view(-1)
    if mask >= 1 << (layout.bits - 1):  # the sign bit of a signed storage word
        mask -= 1 << layout.bits
    raw[index] ^= torch.tensor(mask, dtype=layout.storage)


def _brute(model: nn.Module, x: torch.Tensor, faults: list[Fault], judge: Judge) -> np.ndarray:
    """Flip, run the whole model, judge, restore: one forward per fault."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        golden = model(x)
        out = []
        for f in faults:
            _flip(params[f.target], f.index, f.mask)
            out.append(judge(golden, model(x)))
            _flip(params[f.target], f.index, f.mask)
    return np.array(out)


def _every_fault(model: nn.Module, names: list[str] | None = None) -> FaultList:
    """Every (tensor, element, bit) of the model's parameters, with their populations."""
    faults, pop = [], {}
    for name, p in model.named_parameters():
        if names is None or name in names:
            bits = layout_of(p.dtype).bits
            pop[name] = p.numel() * bits
            faults += [Fault(name, i, 1 << b) for i in range(p.numel()) for b in range(bits)]
    return FaultList(faults, 0, "bitflip", pop)


# -- 1. in-place ops -----------------------------------------------------------------------


def _inplace_mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 3)).eval()
    return model, torch.randn(3, 4)


def test_fast_engine_keeps_golden_values_an_in_place_relu_would_overwrite() -> None:
    model, x = _inplace_mlp()
    engine = FastEngine(model, (x,))
    node = next(n for n in engine.nodes if n.target == "0")
    with torch.no_grad():
        assert torch.equal(engine.env[node], model[0](x))  # pre-ReLU, negatives included
    faults = _every_fault(model, ["0.weight", "0.bias"])
    res = run_campaign(model, x, faults, "dev>0.05")
    assert res.manifest["engine"] == "fast"
    assert np.array_equal(res.failed["dev>0.05"], _brute(model, x, faults.faults, _dev(0.05)))


def test_activation_faults_before_an_in_place_relu_match_brute_force() -> None:
    model, x = _inplace_mlp()
    faults = [
        Fault("0", i, 1 << b, kind="activation", sample=s)
        for s in range(3)
        for i in range(5)
        for b in range(32)
    ]
    with torch.no_grad():
        golden = model(x)
        truth = []
        for f in faults:
            with activation_faults(model, [f]):
                y = model(x)
            truth.append(_top1(golden[f.sample : f.sample + 1], y[f.sample : f.sample + 1]))
    res = run_campaign(model, x, FaultList(faults, 0), "top1")
    assert res.manifest["engine"] == "fast"
    assert np.array_equal(res.failed["top1"], np.array(truth))


class _ReadAfterWrite(nn.Module):
    """Reads ``h`` after ``relu_`` rectified it: the graph's kept ``h`` is not the model's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        y = torch.relu_(h)
        return self.head(h + y)


def test_a_value_read_after_an_in_place_write_still_matches_brute_force() -> None:
    torch.manual_seed(0)
    model, x = _ReadAfterWrite().eval(), torch.randn(3, 4)
    faults = _every_fault(model, ["fc.weight"])
    res = run_campaign(model, x, faults, "top1")
    assert np.array_equal(res.failed["top1"], _brute(model, x, faults.faults, _top1))


# -- 2. tied weights -----------------------------------------------------------------------


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


class _ReadTwice(nn.Module):
    """``a.weight`` is read by its module and as an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.a(x)) + x @ self.a.weight.t())


@pytest.mark.parametrize("make", [_Tied, _ReadTwice])
def test_a_tensor_several_nodes_read_matches_brute_force(make: type[nn.Module]) -> None:
    torch.manual_seed(1)
    model, x = make().eval(), torch.randn(8, 4)
    faults = _every_fault(model, ["a.weight"])
    res = run_campaign(model, x, faults, "top1")
    assert np.array_equal(res.failed["top1"], _brute(model, x, faults.faults, _top1))


# -- 3. groups of several tensors under stratified sampling ---------------------------------


@pytest.fixture(scope="module")
def masked_mlp() -> tuple[nn.Module, torch.Tensor, dict[tuple[str, int, int], bool]]:
    """A model whose first layer's weight flips are mostly masked (3 of 4 inputs are zero),
    and every fault's outcome, by brute force."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).eval()
    x = torch.randn(6, 4)
    x[:, 1:] = 0
    faults = _every_fault(model)
    failed = _brute(model, x, faults.faults, _dev(0.05))
    return (
        model,
        x,
        {(f.target, f.index, f.mask): bool(v) for f, v in zip(faults, failed, strict=True)},
    )


def _looked_up(model: nn.Module, faults: FaultList, table: dict) -> CampaignResult:
    """The campaign result of ``faults``, outcomes read from the brute-force table."""
    failed = np.array([table[f.target, f.index, f.mask] for f in faults])
    n = len(faults)
    rate = {"dev>0.05": failed.astype(float)}
    no = np.zeros(n, bool)
    return CampaignResult(
        faults, ["dev>0.05"], {"dev>0.05": failed}, rate, no, no, faults.attributes(model), {}
    )


@pytest.mark.parametrize("by", ["layer", "component", "all"])
def test_groups_of_several_tensors_weigh_them_by_population(masked_mlp: tuple, by: str) -> None:
    model, _, table = masked_mlp
    sites = {n: p.numel() * 32 for n, p in model.named_parameters()}
    truth = {
        g: np.mean([v for (t, _, _), v in table.items() if by == "all" or t.startswith(g)])
        for g in ("0", "2")
    }
    truth["all"] = np.mean(list(table.values()))
    components = {"0": "0.*", "2": "2.*"}
    est: dict[str, list[float]] = {}
    covered: dict[str, int] = {}
    seeds = 40
    for seed in range(seeds):
        faults = sample_faults(model, 40, per_tensor=True, seed=seed)  # 40 per tensor
        report = estimate(_looked_up(model, faults, table), by, components=components)
        for r in report.rows:
            est.setdefault(r.group, []).append(r.pvf)
            covered[r.group] = covered.get(r.group, 0) + (r.low <= truth[r.group] <= r.high)
        p, lo, hi = report.overall["dev>0.05"]
        est.setdefault("overall", []).append(p)
        covered["overall"] = covered.get("overall", 0) + (lo <= truth["all"] <= hi)
    truth["overall"] = truth["all"]
    for g, values in est.items():
        assert abs(np.mean(values) - truth[g]) < 0.02, (g, np.mean(values), truth[g])
        assert covered[g] >= 0.85 * seeds, (g, covered[g])
    # one seed, by hand: each tensor's share of failures, weighed by its sites
    faults = sample_faults(model, 40, per_tensor=True, seed=0)
    res = _looked_up(model, faults, table)
    rates = {
        t: np.mean([table[f.target, f.index, f.mask] for f in faults if f.target == t])
        for t in sites
    }
    row = next(r for r in estimate(res, "layer").rows if r.group == "0")
    expect = (rates["0.weight"] * sites["0.weight"] + rates["0.bias"] * sites["0.bias"]) / (
        sites["0.weight"] + sites["0.bias"]
    )
    assert row.pvf == pytest.approx(expect) and row.low <= row.pvf <= row.high


def test_the_per_inference_rate_of_several_tensors_is_weighed_as_the_pvf(
    masked_mlp: tuple,
) -> None:
    # The rate was the plain mean over the group's trials: under stratified sampling a trial in
    # the 5-element bias counted as much as one in the 20-element weight.
    model, _, table = masked_mlp
    truth = {g: np.mean([v for (t, _, _), v in table.items() if t.startswith(g)]) for g in "02"}
    rates: dict[str, list[float]] = {"0": [], "2": []}
    covered = dict.fromkeys(rates, 0)
    seeds = 40
    for seed in range(seeds):
        faults = sample_faults(model, 40, per_tensor=True, seed=seed)
        res = _looked_up(model, faults, table)  # each fault's rate is its outcome, here
        res.rate["dev>0.05"][::7] = np.nan  # some trials judged no input: left out
        for r in estimate(res, "layer").rows:
            rates[r.group].append(r.rate)
            covered[r.group] += r.rate_low <= truth[r.group] <= r.rate_high
    for g in rates:
        assert abs(np.mean(rates[g]) - truth[g]) < 0.02, (g, np.mean(rates[g]), truth[g])
        assert covered[g] >= 0.85 * seeds, (g, covered[g])
    faults = sample_faults(model, 40, per_tensor=True, seed=0)
    row = next(r for r in estimate(_looked_up(model, faults, table), "layer").rows)
    assert row.rate == pytest.approx(row.pvf)  # rate = outcome: the same weighted mean


def test_pvf_by_layer_recombines_its_stratified_rounds(masked_mlp: tuple) -> None:
    model, x, table = masked_mlp
    report = pvf(model, x, "dev>0.05", PVFOptions(by="layer", stop=FixedTrials(400)))
    res = report.result
    assert res is not None
    truth = {g: np.mean([v for (t, _, _), v in table.items() if t.startswith(g)]) for g in "02"}
    for r in report.rows:
        assert r.low <= truth[r.group] <= r.high, (r, truth[r.group])
    _, lo, hi = report.overall["dev>0.05"]
    assert lo <= np.mean(list(table.values())) <= hi


# -- 4. float64 outputs --------------------------------------------------------------------


def test_a_finite_float64_output_above_float32_max_is_not_an_overflow() -> None:
    model = nn.Linear(2, 3).double().eval()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, 0.0], [0.0, 1.0], [0.0, 0.0]]))
        model.bias.zero_()
    x = torch.tensor([[1.0, 0.25]], dtype=torch.float64)
    faults = [Fault("weight", 0, 1 << 62)]  # 0.5 -> 2**1023: finite, the same class wins
    truth = _brute(model, x, faults, _top1)
    assert not truth[0]
    for engine in ("fast", "naive"):
        res = run_campaign(model, x, FaultList(faults, 0), ["top1", "top2"], engine=engine)
        assert res.failed["top1"][0] == truth[0] and not res.failed["top2"][0], engine
        assert not res.nonfinite[0]
    assert flat_rows(x, 1).dtype == torch.float64


# -- 5. bfloat16 inputs in protections -----------------------------------------------------


def test_protections_fingerprint_bfloat16_inputs_by_their_bytes() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).eval().to(torch.bfloat16)
    cal, x = torch.randn(8, 4).to(torch.bfloat16), torch.randn(8, 4).to(torch.bfloat16)

    def by_hand(t: torch.Tensor) -> frozenset[bytes]:
        raw = t.view(torch.int16).numpy()
        return frozenset(hashlib.blake2b(r.tobytes(), digest_size=16).digest() for r in raw)

    assert row_fingerprints((x,)) == by_hand(x)
    plain = torch.randn(4, 3)  # other dtypes keep the digests they had
    digest = lambda r: hashlib.blake2b(r.tobytes(), digest_size=16).digest()  # noqa: E731
    assert row_fingerprints((plain,)) == frozenset(digest(r) for r in plain.numpy())
    faults = [Fault("0.weight", i, 1 << 14) for i in range(0, 20, 3)]
    result = evaluate(model, (x,), FaultList(faults, 0), [SelectiveBitProtection()])
    assert result[0].baseline_failures == int(_brute(model, x, faults, _top1).sum())
    abft, clip = ABFT(model, (cal,)), ActivationClipping(model, (cal,))
    with pytest.raises(ConfigError, match="calibrated on 8"):
        evaluate(model, (cal,), FaultList(faults, 0), [abft])
    assert len(evaluate(model, (x,), FaultList(faults, 0), [clip])) == 1


# -- 6. narrowing bits on a model mixing float32 and float16 -------------------------------


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3).half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).half()).float()


def test_bit_rounds_narrow_per_dtype_on_a_mixed_model() -> None:
    torch.manual_seed(0)
    model, x = _Mixed().eval(), torch.randn(6, 4)
    stop = UntilWidth(0.08, trials=300, max_trials=1500)
    report = pvf(model, x, "dev>0.05", PVFOptions(by="bit", stop=stop))
    res = report.result
    assert res is not None and len(res) > 300  # narrowed rounds ran
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert all(f.bits[0] < layout_of(dtypes[f.target]).bits for f in res.faults)
    every = _every_fault(model)
    failed = _brute(model, x, every.faults, _dev(0.05))
    covered = 0
    for r in report.rows:
        truth = failed[[f.bits[0] == int(r.group) for f in every]].mean()
        covered += r.low <= truth <= r.high
    assert covered >= 0.85 * len(report.rows), covered


def test_a_list_of_bits_holds_per_dtype() -> None:
    rng = np.random.default_rng(0)
    half, single = layout_of(torch.float16), layout_of(torch.float32)
    masks, _ = BitFlip(bits=[3, 20]).masks(half, 50, rng)
    assert set(masks) == {1 << 3}
    assert set(BitFlip(bits=[3, 20]).masks(single, 50, rng)[0]) == {1 << 3, 1 << 20}
    with pytest.raises(ConfigError, match="no bit of float16"):
        BitFlip(bits=[20]).masks(half, 1, rng)
    with pytest.raises(ConfigError, match="in no dtype"):
        BitFlip(bits=[3, 70]).masks(single, 1, rng)
    assert vulnerability.sample_faults(_Mixed(), 10, error=BitFlip(bits=[3, 20]), seed=0)
