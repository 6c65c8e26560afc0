"""Campaigns: the fast engine's outcomes equal the naive copy-flip-forward loop's, PVF
tables and intervals, criteria, activation faults, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from stalwart import inject, models, vulnerability
from stalwart.errors import ConfigError
from stalwart.vulnerability import FixedTrials, PVFOptions, UntilWidth, sample_faults


@pytest.fixture(scope="module")
def digits() -> models.ReferenceModel:
    return models.load("digits-cnn")


def _same(a: vulnerability.CampaignResult, b: vulnerability.CampaignResult) -> None:
    for c in a.criteria:
        assert np.array_equal(a.failed[c], b.failed[c]), c
        assert np.array_equal(a.rate[c], b.rate[c], equal_nan=True), c


def test_fast_engine_matches_naive_copy_loop_on_digits(digits: models.ReferenceModel) -> None:
    x = digits.inputs[0][:120]
    # every bit of every tensor, including exponent-MSB flips that overflow to Inf/NaN
    faults = sample_faults(digits.model, 12, per_tensor=True, seed=3)
    faults.faults += [
        inject.Fault(t, i, 1 << 30) for t in ("conv1.weight", "fc1.weight") for i in range(0, 70, 7)
    ]
    crit = ["top1", "top5", "dev>0.05"]
    fast = vulnerability.run_campaign(digits.model, x, faults, crit)
    slow = vulnerability.run_campaign(digits.model, x, faults, crit, engine="copy")
    assert fast.manifest["engine"] == "fast" and slow.manifest["engine"] == "copy"
    _same(fast, slow)
    assert fast.failed["top1"].sum() > 0 and not fast.failed["top1"].all()
    assert (fast.failed["top5"] <= fast.failed["top1"]).all()  # top-5 is the looser criterion


class Mixed(nn.Module):
    """Embedding, LayerNorm, a shared get_attr parameter: the generic fast paths."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 8, mode="sum")
        self.norm = nn.LayerNorm(8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(ids, offsets)) * self.scale
        return self.head(torch.tanh(h))


def test_generic_paths_and_rows_match_naive() -> None:
    torch.manual_seed(0)
    model = Mixed().eval()
    ids = torch.randint(0, 12, (60,))  # rows 12..19 are never read: those faults are masked
    offsets = torch.arange(0, 60, 3)
    faults = sample_faults(model, 150, seed=1, error=inject.MultiBitFlip(2))
    fast = vulnerability.run_campaign(model, (ids, offsets), faults, ["top1", "dev>0.01"])
    slow = vulnerability.run_campaign(
        model, (ids, offsets), faults, ["top1", "dev>0.01"], engine="naive"
    )
    _same(fast, slow)
    rows = inject.targets.rows_read(ids, 20)
    read = sample_faults(model, 50, targets="emb.weight", rows={"emb.weight": rows}, seed=2)
    assert all(f.index // 8 in set(rows.tolist()) for f in read)


def test_pvf_by_bit_table_and_intervals(digits: models.ReferenceModel) -> None:
    opts = PVFOptions(by="bit", stop=FixedTrials(640), seed=0)
    report = vulnerability.pvf(digits.model, digits.inputs[0][:100], "top1", opts)
    t = report.table.to_pydict()
    assert list(t)[:6] == ["group", "trials", "failures", "pvf", "low", "high"]
    assert sum(t["trials"]) == 640
    assert all(lo <= p <= hi for lo, p, hi in zip(t["low"], t["pvf"], t["high"], strict=True))
    pvf = dict(zip(t["group"], t["pvf"], strict=True))
    assert pvf["30"] == max(pvf.values()) > 0.2  # exponent MSB dominates
    assert max(pvf[str(b)] for b in range(0, 16)) == 0.0  # low mantissa bits are masked
    p, lo, hi = report.overall["top1"]
    assert lo <= p <= hi
    again = vulnerability.pvf(digits.model, digits.inputs[0][:100], "top1", opts)
    assert again.table.equals(report.table)  # seeded: reproducible


def test_sequential_stopping_and_side_by_side(digits: models.ReferenceModel) -> None:
    stop = UntilWidth(0.12, trials=160, max_trials=2000)
    opts = PVFOptions(by="tensor", stop=stop, seed=1)
    report = vulnerability.pvf(digits.model, digits.inputs[0][:60], ["top1", "top5"], opts)
    rows = [r for r in report.rows if r.criterion == "top1"]
    assert all((r.high - r.low) / 2 <= 0.12 for r in rows) or len(report.result) >= 2000
    side = report.side_by_side().to_pydict()
    assert set(side) >= {"group", "pvf_top1", "pvf_top5"}


def test_activation_faults_one_per_sample(digits: models.ReferenceModel) -> None:
    x = digits.inputs[0][:40]
    faults = vulnerability.sample_activation_faults(
        digits.model, (x,), 80, modules=["fc1", "conv2"], seed=0, error=inject.BitFlip(bit=30)
    )
    res = vulnerability.run_campaign(digits.model, x, faults, "top1")
    dep = vulnerability.run_campaign(digits.model, x, faults, "top1", independent_samples=False)
    # packing 50 faults per forward gives the same per-sample outcome as one per forward
    assert np.array_equal(res.failed["top1"], dep.failed["top1"] & (dep.rate["top1"] > 0))
    assert 0 < res.failed["top1"].sum() < len(faults)


def test_user_criterion_and_set_level(digits: models.ReferenceModel) -> None:
    x, y = digits.inputs[0][:80], digits.labels[:80]
    faults = sample_faults(digits.model, 60, targets="fc2.*", seed=0)

    def big_change(golden: torch.Tensor, faulty: torch.Tensor) -> torch.Tensor:
        return (faulty - golden).abs().amax(-1) > 1.0

    res = vulnerability.run_campaign(digits.model, x, faults, [big_change, "accuracy"], labels=y)
    assert res.criteria == ["big_change", "acc-drop>0"]
    assert np.isnan(res.rate["acc-drop>0"]).all()
    table = res.table()
    assert {"layer", "bit", "dtype", "failed", "failed_big_change"} <= set(table.column_names)


def test_bad_input_errors(digits: models.ReferenceModel) -> None:
    x = digits.inputs[0][:10]
    faults = sample_faults(digits.model, 4, seed=0)
    with pytest.raises(ConfigError, match=r"needs one logit per input.*\(10, 10\)"):
        vulnerability.run_campaign(digits.model, x, faults, "decision")
    with pytest.raises(ConfigError, match="needs the evaluation labels"):
        vulnerability.run_campaign(digits.model, x, faults, "accuracy")
    with pytest.raises(ConfigError, match="unknown criterion"):
        vulnerability.run_campaign(digits.model, x, faults, "top-one")
    with pytest.raises(ConfigError, match="matches no parameter"):
        sample_faults(digits.model, 4, targets="encoder.*")
    with pytest.raises(ConfigError, match="by must be one of"):
        PVFOptions(by="neuron")
    digits.model.train()
    try:
        with pytest.raises(ConfigError, match=r"training mode.*model.eval\(\)"):
            vulnerability.run_campaign(digits.model, x, faults, "top1")
    finally:
        digits.model.eval()


def test_fault_list_save_load_roundtrip(tmp_path, digits: models.ReferenceModel) -> None:
    faults = sample_faults(digits.model, 30, seed=4, error=inject.RandomValue())
    faults.save(tmp_path / "f.parquet")
    back = vulnerability.FaultList.load(tmp_path / "f.parquet")
    assert back.faults == faults.faults and back.seed == 4 and back.population == faults.population


@pytest.mark.parametrize("shape", [(50, 6), (50,)], ids=["classes", "logit"])
def test_judging_only_changed_inputs_gives_the_full_verdicts(shape: tuple[int, ...]) -> None:
    from stalwart.vulnerability import judging

    g = torch.Generator().manual_seed(0)
    golden = torch.randn(*shape, generator=g)
    out = golden.unsqueeze(0).repeat(40, *[1] * len(shape))
    hit = torch.randint(0, 50, (40, 3), generator=g)
    for k in range(40):  # a few inputs per trial change: large, tiny, NaN, Inf
        out[k, hit[k]] = out[k, hit[k]] * torch.randn(3, *shape[1:], generator=g) * 3
    out[3, hit[3, 0]], out[5, hit[5, 1]] = torch.nan, torch.inf
    out[7, hit[7, 2]] = golden[hit[7, 2]] + 1e-7
    names = ["top1", "top2", "dev>0.05"] if len(shape) == 2 else ["decision", "ctr>0.01"]
    crits = vulnerability.criteria.criteria(names, None)
    assert judging._changed_inputs(golden, out) is not None  # the shortcut is taken
    fast = judging.judge(crits, golden, out)
    slow = judging.judge([_Wrapped(c) for c in crits], golden, out)  # not row-wise: full
    for c in crits:
        assert torch.equal(fast[0][c.name], slow[0][c.name]), c.name
    torch.testing.assert_close(fast[1], slow[1], rtol=0, atol=0, equal_nan=True)
    same = judging.judge(crits, golden, golden.unsqueeze(0).repeat(3, *[1] * len(shape)))
    assert all(not f.any() for f in same[0].values())  # nothing changed: nothing judged


class _Wrapped:
    """A criterion the campaign does not know to be row-wise (judged on every input)."""

    rowwise = False

    def __init__(self, c: vulnerability.Criterion) -> None:
        self.c, self.name, self.set_level = c, c.name, c.set_level

    def judge(self, golden: torch.Tensor, faulty: torch.Tensor) -> torch.Tensor:
        return self.c.judge(golden, faulty)

    def margin(self, golden: torch.Tensor, faulty: torch.Tensor) -> torch.Tensor | None:
        return self.c.margin(golden, faulty)


class _UserTop1:
    """A user-written criterion that declares itself row-wise (not a built-in class); it
    counts the (trial, input) pairs it is asked to judge."""

    rowwise = True
    name, set_level = "user_top1", False

    def __init__(self) -> None:
        self.pairs = 0

    def check(self, golden: torch.Tensor) -> None:
        return None

    def judge(self, golden: torch.Tensor, faulty: torch.Tensor) -> torch.Tensor:
        self.pairs += faulty.shape[0] * faulty.shape[1]
        return (faulty.argmax(-1) != golden.argmax(-1)) | ~torch.isfinite(faulty).all(-1)

    def margin(self, golden: torch.Tensor, faulty: torch.Tensor) -> torch.Tensor:
        return vulnerability.criteria.Top1().margin(golden, faulty)


def test_user_rowwise_criterion_takes_the_fast_path(digits: models.ReferenceModel) -> None:
    x = digits.inputs[0][:40]
    faults = vulnerability.sample_activation_faults(
        digits.model, (x,), 60, modules=["fc1", "conv2"], seed=1, error=inject.BitFlip(bit=30)
    )
    kw = {"independent_samples": False}  # every input judged: the changed-pairs path applies
    ref = vulnerability.run_campaign(digits.model, x, faults, "top1", **kw)
    crit = _UserTop1()
    user = vulnerability.run_campaign(digits.model, x, faults, crit, **kw)
    # the declared attribute, not the class, chose the fast path: only the (trial, input)
    # pairs whose output changed were judged, not every trial on every input
    assert 0 < crit.pairs < len(faults) * len(x)
    assert np.array_equal(user.failed["user_top1"], ref.failed["top1"])
    assert np.array_equal(user.rate["user_top1"], ref.rate["top1"], equal_nan=True)


class _Undeclared:
    """A criterion written before ``rowwise`` was declared."""

    name, set_level = "old", False

    def judge(self, golden: torch.Tensor, faulty: torch.Tensor) -> torch.Tensor:
        return faulty.argmax(-1) != golden.argmax(-1)


def test_criterion_without_rowwise_warns_and_is_judged_whole() -> None:
    with pytest.warns(DeprecationWarning, match="rowwise"):
        c = vulnerability.criteria.criterion(_Undeclared())  # type: ignore[arg-type]
    assert not vulnerability.criteria.is_rowwise(c)
