"""Campaigns on activation faults run on the fast engine and judge every trial as the naive
hook loop does: independent samples, dependent samples (a graph), an untraceable model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stalwart import inject, models, vulnerability
from stalwart.errors import ConfigError
from stalwart.vulnerability import sample_activation_faults


def _same(a: vulnerability.CampaignResult, b: vulnerability.CampaignResult) -> None:
    assert a.criteria == b.criteria
    for c in a.criteria:
        assert np.array_equal(a.failed[c], b.failed[c]), c
        assert np.array_equal(a.rate[c], b.rate[c], equal_nan=True), c
    assert np.array_equal(a.nonfinite, b.nonfinite)


class Graph(nn.Module):
    def __init__(self, n: int = 30) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        adj = (torch.rand(n, n, generator=g) < 0.1).float() + torch.eye(n)
        self.register_buffer("adj", adj / adj.sum(1, keepdim=True))
        self.lin1, self.lin2 = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adj @ self.lin2(F.relu(self.adj @ self.lin1(x)))


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if h.dim() == 2:  # control flow on a traced value: torch.fx cannot trace it
            h = F.relu(h)
        return self.fc2(h)


def test_activation_campaign_equals_naive_trial_for_trial() -> None:
    digits = models.load("digits-cnn")
    model, x = digits.model, digits.inputs[0][:40]
    faults = sample_activation_faults(model, (x,), 120, seed=1)
    faults.faults += sample_activation_faults(
        model, (x,), 40, seed=2, error=inject.BitFlip(bit=30)
    ).faults
    crit = ["top1", "top5", "dev>0.05"]
    fast = vulnerability.run_campaign(model, x, faults, crit)
    slow = vulnerability.run_campaign(model, x, faults, crit, engine="naive")
    assert fast.manifest["engine"] == "fast" and slow.manifest["engine"] == "naive"
    _same(fast, slow)
    assert 0 < fast.failed["top1"].sum() < len(faults)


@pytest.mark.parametrize("make", [Graph, Untraceable], ids=["graph", "untraceable"])
def test_activation_campaign_dependent_and_eager(make: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = make().eval()
    x = torch.randn(30, 6) if make is Graph else torch.randn(12, 8)
    independent = make is not Graph
    faults = sample_activation_faults(model, (x,), 60, seed=3, error=inject.BitFlip(bit=30))
    kw = {"independent_samples": independent}
    crit = ["top1", "dev>0.1"]
    fast = vulnerability.run_campaign(model, x, faults, crit, **kw)
    slow = vulnerability.run_campaign(model, x, faults, crit, engine="naive", **kw)
    assert fast.manifest["engine"] == "fast"
    _same(fast, slow)
    assert fast.failed["top1"].any()


class Residual(nn.Module):
    """Conv, batch norm, ReLU, max-pool, a residual add and a mean: the ops a fault's row
    crosses in a ResNet (a fault the ReLU or the pool swallows leaves the pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, 1, 1), nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.conv2, self.conv3 = nn.Conv2d(8, 8, 3, 1, 1), nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        y = torch.relu(self.conv2(x) + self.conv3(x)).mean((2, 3))
        return self.fc(y.view(y.size(0), -1))  # a size read from the rows


class Mixing(Residual):
    """Samples are not independent (batch statistics): the stacked pass must notice."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(torch.relu(self.bn1(self.conv1(x))))
        h = h - h.mean(0)
        return self.fc(torch.relu(self.conv2(h)).mean((2, 3)))


def _faults(model: nn.Module, x: torch.Tensor) -> list:
    faults = list(sample_activation_faults(model, (x,), 80, seed=4))
    return faults + list(sample_activation_faults(model, (x,), 40, seed=5, error="bitflip"))


def _model(make: type[nn.Module]) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = make().eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
    return model, torch.randn(6, 3, 8, 8)


def test_stacked_rows_equal_hook_path() -> None:
    from stalwart.vulnerability.activation_engine import hooked

    model, x = _model(Residual)
    faults = _faults(model, x)
    eng = vulnerability.engine.FastEngine(model, (x,))
    fast, ref = eng.run(faults), hooked(eng, faults, independent=True)
    rows, k = torch.tensor([f.sample for f in faults]), torch.arange(len(faults))
    own, want = fast[k, rows], ref[k, rows]
    assert torch.allclose(own, want, rtol=1e-5, atol=1e-6, equal_nan=True)
    golden_rows = (own == eng.golden[rows]).all(1)
    assert golden_rows.any() and not golden_rows.all()  # some masked, some not
    others = torch.ones(fast.shape[:2], dtype=torch.bool)
    others[k, rows] = False
    assert torch.equal(fast[others], eng.golden.expand_as(fast)[others])


def test_stacked_pass_refuses_a_graph_that_mixes_samples() -> None:
    from stalwart.vulnerability.activation_engine import _module_node
    from stalwart.vulnerability.stacked import Start, run_stacked

    model, x = _model(Mixing)
    eng = vulnerability.engine.FastEngine(model, (x,))
    node = _module_node(eng, "conv1")  # its rows reach the batch mean
    start = Start(node, [0], [1], [5], [torch.tensor(0x3F800000, dtype=torch.int32)])
    out = eng.golden.unsqueeze(0).clone()
    assert not run_stacked(eng, {node: start}, out)
    assert torch.equal(out[0], eng.golden)  # nothing written
    x_ok = _model(Residual)
    eng = vulnerability.engine.FastEngine(*x_ok[:1], (x_ok[1],))
    node = _module_node(eng, "conv2")
    assert run_stacked(eng, {node: Start(node, [0], [1], [5], start.words)}, out)


class Pooled(Graph):
    """A graph model whose readout sums over nodes: the row walk must stop there."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.adj @ self.lin2(F.relu(self.adj @ self.lin1(x)))
        return h + h.sum(0)


@pytest.mark.parametrize("make", [Graph, Pooled], ids=["rows", "readout"])
def test_graph_row_walk_equals_hook_path(make: type[nn.Module]) -> None:
    from stalwart.vulnerability.activation_engine import _module_node, hooked
    from stalwart.vulnerability.sparse_rows import Rows, propagate_rows

    torch.manual_seed(0)
    model, x = make().eval(), torch.randn(30, 6)
    faults = list(sample_activation_faults(model, (x,), 60, seed=3))
    eng = vulnerability.engine.FastEngine(model, (x,))
    fast, ref = eng.run(faults, independent=False), hooked(eng, faults, independent=False)
    scale = fast.abs().nan_to_num(0, 0, 0).amax(-1) + ref.abs().nan_to_num(0, 0, 0).amax(-1)
    err = (fast - ref).abs().nan_to_num(0, 0, 0).amax(-1)  # rounding, per node's row
    assert torch.equal(fast.isfinite(), ref.isfinite())
    assert (err <= 1e-6 * scale + 1e-7).all(), (err / scale).max()
    node = _module_node(eng, "lin1")
    val = eng.env[node][3:4].clone()
    val[0, 2] += 1.0
    walked = propagate_rows(eng, Rows(node, torch.zeros(1, dtype=torch.long),
                                      torch.tensor([3]), val), 1)  # fmt: skip
    if make is Pooled:
        assert walked is None  # the sum over nodes is not row-wise: dense suffix
    else:
        out, stopped = walked
        changed = (out[0] != eng.golden).any(1)
        assert not stopped.any()
        assert 0 < int(changed.sum()) < len(x)  # the change reached a neighbourhood only


class UntraceableMixing(Untraceable):
    """Untraceable and mixing samples (a batch mean): gathered rows must not be trusted."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if h.dim() == 2:
            h = F.relu(h - h.mean(0))
        return self.fc2(h)


@pytest.mark.parametrize("make", [Untraceable, UntraceableMixing], ids=["rows", "mixing"])
def test_untraceable_rows_skip_the_prefix_and_equal_the_hook_path(
    make: type[nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    from stalwart.vulnerability.activation_engine import hooked

    torch.manual_seed(0)
    model, x = make().eval(), torch.randn(12, 8)
    eng = vulnerability.engine.FastEngine(model, (x,))
    assert not eng.traced and eng.eager is not None  # its golden run done
    calls, real = [], nn.Linear.forward  # fc1's own forward (a stub replaces it per module)

    def counted(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        calls.extend([1] if m is model.fc1 else [])
        return real(m, x)

    monkeypatch.setattr(nn.Linear, "forward", counted)
    fast, ref = [], []
    for target, seed in (("fc2", 6), ("fc1", 7)):
        faults = list(sample_activation_faults(model, (x,), 30, seed=seed, modules=[target]))
        before = len(calls)
        fast.append(eng.run(faults))
        ran = len(calls) - before
        ref.append(hooked(eng, faults, independent=True))
        rows, k = torch.tensor([f.sample for f in faults]), torch.arange(len(faults))
        others = torch.ones(fast[-1].shape[:2], dtype=torch.bool)
        others[k, rows] = False
        assert torch.equal(fast[-1][others], eng.golden.expand_as(fast[-1])[others])
        if make is Untraceable:  # one pass of the faults' rows; fc1 is stubbed for fc2's
            assert ran == (0 if target == "fc2" else 1)
            assert torch.allclose(fast[-1], ref[-1], rtol=1e-5, atol=1e-6, equal_nan=True)
        else:  # the fault-free rows moved with the gathered batch: the hook path decides
            assert torch.equal(fast[-1].nan_to_num(), ref[-1].nan_to_num())
    faults = sample_activation_faults(model, (x,), 60, seed=8)
    kw = {"independent_samples": True}
    got = vulnerability.run_campaign(model, x, faults, ["top1", "dev>0.1"], **kw)
    if make is Untraceable:
        slow = vulnerability.run_campaign(
            model, x, faults, ["top1", "dev>0.1"], engine="naive", **kw
        )
        _same(got, slow)


class Folded(nn.Module):
    """Untraceable, and fc1 sees two rows per input: its output's rows are not samples."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 16), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x.reshape(-1, 4))
        if h.dim() == 2:
            h = F.relu(h)
        return self.fc2(h.reshape(len(x), -1))


def test_a_module_whose_rows_are_not_samples_is_refused_or_run_as_dependent() -> None:
    torch.manual_seed(0)
    model, x = Folded().eval(), torch.randn(6, 8)
    faults = sample_activation_faults(model, (x,), 30, seed=9, modules=["fc1"])
    assert max(f.sample for f in faults) >= len(x)  # rows of fc1's output, not inputs
    for engine in ("fast", "naive"):
        with pytest.raises(ConfigError, match="independent_samples=False"):
            vulnerability.run_campaign(model, x, faults, "top1", engine=engine)
    kw = {"independent_samples": False}
    crit = ["top1", "dev>0.1"]
    fast = vulnerability.run_campaign(model, x, faults, crit, **kw)
    _same(fast, vulnerability.run_campaign(model, x, faults, crit, engine="naive", **kw))


def test_untraceable_row_passes_are_capped_by_memory() -> None:
    from stalwart.vulnerability.activation_engine import hooked

    torch.manual_seed(0)
    model, x = Untraceable().eval(), torch.randn(12, 8)
    per_row = vulnerability.engine.FastEngine(model, (x,)).eager.act_bytes // len(x)
    budget = 5 * per_row  # a pass: 3 faults + 2 golden rows
    eng = vulnerability.engine.FastEngine(model, (x,), pass_bytes=budget)
    faults = list(sample_activation_faults(model, (x,), 30, seed=6, modules=["fc2"]))
    passes = []
    model.register_forward_pre_hook(lambda *_: passes.append(1))
    fast = eng.run(faults)
    assert len(passes) >= 10  # 30 faults, 3 a pass
    ref = hooked(eng, faults, independent=True)
    assert torch.allclose(fast, ref, rtol=1e-5, atol=1e-6, equal_nan=True)


class FixedBatch(Untraceable):
    """Untraceable and refuses any batch but its own: the gathered rows cannot run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(x) != 12:
            raise ValueError(f"this model takes batches of 12, not {len(x)}")
        return super().forward(x)


def test_untraceable_model_that_refuses_the_gathered_batch_keeps_the_hook_path() -> None:
    from stalwart.vulnerability.activation_engine import hooked

    torch.manual_seed(0)
    model, x = FixedBatch().eval(), torch.randn(12, 8)
    faults = list(sample_activation_faults(model, (x,), 30, seed=6, modules=["fc2"]))
    eng = vulnerability.engine.FastEngine(model, (x,))
    assert torch.equal(eng.run(faults), hooked(eng, faults, independent=True))
