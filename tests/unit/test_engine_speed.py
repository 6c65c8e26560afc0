"""The fast engine's shortcuts (channel-wise propagation past batch norm, residual adds,
pooling, means and a graph's adjacency; activation faults on the traced graph; device
handling) give the naive loop's outcome on every trial."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stalwart import inject, vulnerability
from stalwart.errors import UnsupportedValueError
from stalwart.vulnerability import sample_activation_faults, sample_faults
from stalwart.vulnerability.activation_engine import pack_samples
from stalwart.vulnerability.engine import FastEngine, edited_words

EXPSIGN = inject.BitFlip(bits=list(range(23, 32)))


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny convolutions on a shared, busy machine: one thread avoids OpenMP contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class TinyResNet(nn.Module):
    """Stem, max pool, one residual block with batch norm, mean over space, head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn0(self.stem(x))))
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)) + x)
        return self.fc(y.mean((2, 3)))


class TinyGCN(nn.Module):
    def __init__(self, n: int = 40) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        adj = (torch.rand(n, n, generator=g) < 0.1).float() + torch.eye(n)
        self.register_buffer("adj", adj / adj.sum(1, keepdim=True))
        self.features = nn.Identity()
        self.lin1 = nn.Linear(6, 8)
        self.lin2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.adj @ self.lin1(self.features(x)))
        return self.adj @ self.lin2(h)


def _resnet() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyResNet()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.1, 0.1)
    return model.eval(), torch.randn(6, 3, 8, 8)


def _same(a: vulnerability.CampaignResult, b: vulnerability.CampaignResult) -> None:
    for c in a.criteria:
        assert np.array_equal(a.failed[c], b.failed[c]), c


@pytest.mark.parametrize("error", [EXPSIGN, None], ids=["expsign", "uniform"])
def test_resnet_block_weight_faults_match_naive(error: inject.BitFlip | None) -> None:
    model, x = _resnet()
    faults = sample_faults(model, 40, per_tensor=True, seed=2, error=error, targets="*.weight")
    crit = ["top1", "dev>0.01"]
    fast = vulnerability.run_campaign(model, x, faults, crit)
    slow = vulnerability.run_campaign(model, x, faults, crit, engine="naive")
    _same(fast, slow)
    assert 0 < fast.failed["top1"].sum() < len(faults)


def test_propagation_reaches_past_norm_residual_and_mean() -> None:
    model, x = _resnet()
    eng = FastEngine(model, (x,))
    faults = [inject.Fault("conv2.weight", i, 1 << 31) for i in range(0, 500, 50)]
    out = eng.run(faults)
    for f, o in zip(faults, out, strict=True):
        with inject.apply_faults(model, [f]), torch.no_grad():
            ref = model(x)
        torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-5)


def _graph_campaign_matches_naive(model: torch.nn.Module, x: torch.Tensor, faults) -> None:
    """One graph (not independent samples): the fast campaign equals the naive loop."""
    kw = {"independent_samples": False}
    fast = vulnerability.run_campaign(model, x, faults, "top1", **kw)
    slow = vulnerability.run_campaign(model, x, faults, "top1", engine="naive", **kw)
    _same(fast, slow)


@pytest.mark.parametrize("error", [EXPSIGN, None], ids=["expsign", "uniform"])
def test_graph_adjacency_products_match_naive(error: inject.BitFlip | None) -> None:
    torch.manual_seed(1)
    model = TinyGCN().eval()
    x = torch.randn(40, 6)
    faults = sample_faults(model, 60, per_tensor=True, seed=3, error=error, targets="lin*")
    _graph_campaign_matches_naive(model, x, faults)


def test_sparse_adjacency_keeps_non_finite_faults_dense() -> None:
    """A mostly-zero adjacency multiplies finite changes in sparse form; a fault that made
    an Inf meets the dense product (0 * inf is NaN there, as in the naive loop)."""
    from stalwart.vulnerability.kernels import _sparse, left_matmul

    torch.manual_seed(1)
    model, n = TinyGCN(60).eval(), 60
    g = torch.Generator().manual_seed(1)
    adj = (torch.rand(n, n, generator=g) < 0.03).float() + torch.eye(n)
    model.adj.copy_(adj / adj.sum(1, keepdim=True))
    assert _sparse(model.adj) is not None
    v = torch.randn(3, n, 2)
    v[1, 0, 0] = torch.inf
    got = left_matmul(model.adj, v)
    assert torch.equal(got[1].isnan(), (model.adj @ v[1]).isnan())
    torch.testing.assert_close(got[0], model.adj @ v[0])
    x = torch.randn(n, 6)
    faults = sample_faults(model, 60, per_tensor=True, seed=3, error=EXPSIGN, targets="lin*")
    _graph_campaign_matches_naive(model, x, faults)


def test_change_masked_after_the_faulty_layer_skips_the_rest() -> None:
    """A channel ReLU zeroes before and after the fault is bit-identical to the golden one:
    the fault's output is golden without running the layers after it."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    with torch.no_grad():
        model[0].bias[0] = -1e3  # channel 0 is negative for every input, faulty or not
    x = torch.randn(20, 6)
    eng = FastEngine(model, (x,))
    faults = [inject.Fault("0.weight", i, 1 << 20) for i in range(6)]  # row 0: channel 0
    eng.suffix_run = None  # type: ignore[assignment]  # must not be reached
    out = eng.run(faults)
    assert torch.equal(out, eng.golden.expand_as(out))
    ref = vulnerability.engine.NaiveEngine(model, (x,)).run(faults)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def _hook_outputs(model: nn.Module, args: tuple, faults: vulnerability.FaultList) -> torch.Tensor:
    outs = []
    for f in faults:
        with torch.no_grad(), inject.activation_faults(model, [f]):
            outs.append(model(*args))
    return torch.stack(outs)


@pytest.mark.parametrize("independent", [True, False])
def test_activation_faults_on_the_graph_match_hooks(independent: bool) -> None:
    model, x = _resnet()
    if not independent:
        model, x = TinyGCN().eval(), torch.randn(40, 6)
    faults = sample_activation_faults(model, (x,), 80, seed=4, error=EXPSIGN)
    faults.faults.append(inject.Fault(faults[0].target, 3, 0, "set", "activation", 1))  # masked
    eng = FastEngine(model, (x,))
    fast = eng.run(list(faults), independent=independent)
    ref = _hook_outputs(model, (x,), faults)
    finite = torch.isfinite(ref).reshape(len(ref), -1).all(1)
    torch.testing.assert_close(fast[finite], ref[finite], rtol=1e-4, atol=1e-5)
    assert torch.equal(fast[-1], eng.golden)
    c = vulnerability.criterion("top1")
    margin = c.margin(eng.golden, fast).reshape(len(fast), -1).amin(1)
    sure = finite & (margin > 1e-5)
    assert torch.equal(c.judge(eng.golden, fast)[sure], c.judge(eng.golden, ref)[sure])


def test_pack_samples_never_puts_one_sample_twice() -> None:
    assert pack_samples([0, 1, 0, 2, 1, 0], True) == [[0, 1, 3], [2, 4], [5]]
    assert pack_samples([0, 1], False) == [[0], [1]]


def test_edited_words_apply_each_fault_op() -> None:
    raw = torch.tensor([0b1010, 0b1010, 0b1010, 0b1010], dtype=torch.int32)
    faults = [
        inject.Fault("t", 0, 0b0001, "xor"),
        inject.Fault("t", 1, 0b0101, "set"),
        inject.Fault("t", 2, 0b0010, "clear"),
        inject.Fault("t", 3, 7, "assign"),
    ]
    new = edited_words(raw, torch.arange(4), faults, inject.bits.layout_of(torch.float32))
    assert new.tolist() == [0b1011, 0b1111, 0b1000, 7]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_runs_on_cuda_and_matches_cpu_naive() -> None:
    model, x = _resnet()
    faults = sample_faults(model, 30, per_tensor=True, seed=5, error=EXPSIGN, targets="*.weight")
    slow = vulnerability.engine.NaiveEngine(model, (x,)).run(list(faults))
    eng = FastEngine(model.cuda(), (x.cuda(),))
    by_target: dict[str, list[int]] = {}
    for i, f in enumerate(faults):
        by_target.setdefault(f.target, []).append(i)
    for idx in by_target.values():
        out = eng.run([faults[i] for i in idx])
        assert out.device.type == "cuda"
        ref = slow[idx]
        finite = torch.isfinite(ref).reshape(len(ref), -1).all(1)
        torch.testing.assert_close(out.cpu()[finite], ref[finite], rtol=1e-3, atol=1e-4)


class Branchy(nn.Module):
    """Control flow on a tensor's value: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin0 = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.lin1 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin0(x))
        if h.sum() > 0:
            h = self.norm(h)
        return self.head(torch.tanh(self.lin1(h)))


@pytest.mark.parametrize("error", [EXPSIGN, None], ids=["expsign", "uniform"])
def test_untraceable_model_runs_the_eager_engine_with_naive_outcomes(
    error: inject.BitFlip | None,
) -> None:
    torch.manual_seed(2)
    model, x = Branchy().eval(), torch.randn(30, 6)
    eng = FastEngine(model, (x,))
    assert eng.eager is not None
    assert eng.eager.prefix("lin1") == ["lin0", "norm"]  # run once, before lin1 starts
    faults = sample_faults(model, 40, per_tensor=True, seed=6, error=error)
    crit = ["top1", "dev>0.01"]
    fast = vulnerability.run_campaign(model, x, faults, crit)
    slow = vulnerability.run_campaign(model, x, faults, crit, engine="naive")
    _same(fast, slow)
    with pytest.raises(UnsupportedValueError, match="cannot trace"):
        FastEngine(model, (x,), eager=False)


@pytest.mark.parametrize("module", ["engine", "delta", "activation_engine", "eager_engine"])
def test_engine_tensors_follow_the_model_device(module: str) -> None:
    """Without a GPU here, check the source: every tensor the engine makes is put on the
    device of the tensor it works with, and nothing leaves for NumPy on the hot path."""
    import importlib
    import inspect
    import re

    src = inspect.getsource(importlib.import_module(f"stalwart.vulnerability.{module}"))
    made = re.findall(r"torch\.(?:tensor|arange|empty|zeros|ones|full)\((.*)", src)
    assert made, module
    for line in made:
        assert "device=" in line or ".to(dev)" in line, f"{module}: {line}"
    assert ".numpy()" not in src


def test_quantized_targets_match_naive_and_leave_the_model_exact() -> None:
    torch.manual_seed(3)
    float_model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 5)).eval()
    model = torch.ao.quantization.quantize_dynamic(float_model, {nn.Linear}, dtype=torch.qint8)
    model.eval()
    x = torch.randn(40, 12)
    before = [m._weight_bias()[0].int_repr().clone() for m in (model[0], model[2])]
    faults = sample_faults(model, 30, per_tensor=True, seed=7)  # values, scale, zero point
    fast = vulnerability.run_campaign(model, x, faults, ["top1", "dev>0.01"])
    slow = vulnerability.run_campaign(model, x, faults, ["top1", "dev>0.01"], engine="naive")
    _same(fast, slow)
    after = [m._weight_bias()[0].int_repr() for m in (model[0], model[2])]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_untraceable_quantized_model_matches_naive() -> None:
    torch.manual_seed(4)
    model = torch.ao.quantization.quantize_dynamic(Branchy().eval(), {nn.Linear}, torch.qint8)
    model.eval()
    x = torch.randn(30, 6)
    assert FastEngine(model, (x,)).eager is not None
    faults = sample_faults(model, 20, per_tensor=True, seed=8, targets="lin*")
    fast = vulnerability.run_campaign(model, x, faults, ["top1", "dev>0.01"])
    slow = vulnerability.run_campaign(model, x, faults, ["top1", "dev>0.01"], engine="naive")
    _same(fast, slow)


class Scale(nn.Module):
    """Reads another module's weight directly (kept in a list: not a submodule)."""

    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self.other = [other]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.other[0].weight.sum()


class Peeking(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin0 = nn.Linear(6, 8)
        self.head = nn.Linear(8, 4)
        self.scale = Scale(self.head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.scale(torch.relu(self.lin0(x)))
        if h.sum() > 0:  # untraceable
            h = h + 1
        return self.head(h)


def test_eager_engine_falls_back_when_an_earlier_module_reads_the_weight() -> None:
    torch.manual_seed(5)
    model, x = Peeking().eval(), torch.randn(30, 6)
    faults = sample_faults(model, 30, seed=9, error=EXPSIGN, targets="*.weight")
    eng = FastEngine(model, (x,))
    for target in ("lin0.weight", "head.weight"):
        eng.run([f for f in faults if f.target == target])
    assert eng.eager is not None
    assert eng.eager.checked == {"lin0.weight": True, "head.weight": False}
    assert "lin0.weight" in eng.eager.confined  # no naive check needed
    assert "head.weight" not in eng.eager.confined  # Scale reads it outside head
    fast = vulnerability.run_campaign(model, x, faults, ["top1", "dev>0.01"])
    slow = vulnerability.run_campaign(model, x, faults, ["top1", "dev>0.01"], engine="naive")
    _same(fast, slow)


class PeekingData(Peeking):
    """Reads the head's weight through ``.data`` (another tensor, the same storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale.forward = lambda x: x * self.head.weight.data.sum()  # type: ignore[method-assign]


def test_eager_engine_sees_reads_through_views_of_a_weight() -> None:
    torch.manual_seed(5)
    model, x = PeekingData().eval(), torch.randn(30, 6)
    eng = FastEngine(model, (x,))
    assert eng.eager is not None
    assert "lin0.weight" in eng.eager.confined
    assert "head.weight" not in eng.eager.confined
    faults = sample_faults(model, 20, seed=9, error=EXPSIGN, targets="head.weight")
    fast = vulnerability.run_campaign(model, x, faults, ["top1", "dev>0.01"])
    slow = vulnerability.run_campaign(model, x, faults, ["top1", "dev>0.01"], engine="naive")
    _same(fast, slow)


class PixelNet(nn.Module):
    """Convolutions down to one pixel: a stride-2 3x3 on 2x2 and a padded 3x3 on 1x1 (most
    of their taps meet only padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(3, 6, 3, 2, 1)
        self.conv1 = nn.Conv2d(6, 6, 3, 2, 1)
        self.conv2 = nn.Conv2d(6, 6, 3, 1, 1, bias=False)
        self.fc = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(torch.relu(self.conv0(x))))
        return self.fc(torch.relu(self.conv2(h)).flatten(1))


@pytest.mark.parametrize("error", [EXPSIGN, None], ids=["expsign", "uniform"])
def test_one_pixel_convolutions_match_naive(error: inject.BitFlip | None) -> None:
    from stalwart.vulnerability.kernels import tiny_convs

    torch.manual_seed(4)
    model, x = PixelNet().eval(), torch.randn(10, 3, 4, 4)
    eng = FastEngine(model, (x,))
    pixel = tiny_convs(eng.nodes, eng.modules, eng.env)
    assert sorted(pixel) == ["conv1", "conv2"]
    for n in eng.nodes:
        if str(n.target) in pixel:
            torch.testing.assert_close(pixel[str(n.target)](eng.env[n.args[0]]), eng.env[n])
    faults = sample_faults(model, 60, per_tensor=True, seed=4, error=error, targets="conv0.*")
    crit = ["top1", "dev>0.01"]
    fast = vulnerability.run_campaign(model, x, faults, crit)
    slow = vulnerability.run_campaign(model, x, faults, crit, engine="naive")
    _same(fast, slow)
    acts = sample_activation_faults(model, (x,), 80, modules=["conv0"], seed=4, error=error)
    _same(  # the stacked activation rows run through the one-pixel kernels too
        vulnerability.run_campaign(model, x, acts, crit),
        vulnerability.run_campaign(model, x, acts, crit, engine="naive"),
    )


def _shifted(self: TinyResNet, x: torch.Tensor) -> torch.Tensor:
    return TinyResNet.forward(self, x) + self.shift


def test_trace_is_kept_per_model_until_its_structure_or_code_changes() -> None:
    import gc
    import weakref

    model, x = _resnet()
    first = FastEngine(model, (x,))
    again = FastEngine(model, (x,), golden=first.golden)
    assert again.gm is first.gm  # a second engine (round, fault list) does not trace
    model.fc = nn.Linear(8, 5).eval()  # a replaced module: traced anew, on its weights
    fresh = FastEngine(model, (x,))
    assert fresh.gm is not first.gm and torch.equal(fresh.golden, model(x))
    model.shift = torch.zeros(5)  # a plain tensor attribute the graph reads (get_attr) ...
    model.__class__ = type("Shifted", (TinyResNet,), {"forward": _shifted})  # new code
    shifted = FastEngine(model, (x,))
    assert shifted.gm is not fresh.gm and torch.equal(shifted.golden, model(x))
    model.shift = torch.full((5,), 3.0)  # ... replaced: the kept trace reads the old one
    changed = FastEngine(model, (x,))  # its output differs from eager: traced again
    assert changed.gm is not shifted.gm and torch.equal(changed.golden, model(x))
    faults = sample_faults(model, 40, targets="*.weight", seed=3, error=EXPSIGN)
    _same(
        vulnerability.run_campaign(model, x, faults),
        vulnerability.run_campaign(model, x, faults, engine="naive"),
    )
    ref = weakref.ref(model)
    del model, first, again, fresh, shifted, changed
    gc.collect()
    assert ref() is None  # the kept trace does not keep the model alive


class _InPlace(nn.Module):
    """A module called twice, and an in-place module on a value the graph computes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act, self.head = nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.lin(x) * 2.0)
        return self.head(self.lin(h) - 0.1)


class _AddInPlace(nn.Module):
    """``out += x`` on a module's output after the head read it: fx records an ``add``
    nobody uses, while the eager run edits the output its hook kept."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.head = nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(self.lin(x))
        y = self.head(out)
        out += x
        return y


def test_golden_values_come_from_the_eager_pass_where_the_calls_line_up() -> None:
    from stalwart.vulnerability import tracing

    model, x = _resnet()
    gm = tracing.trace(model)
    calls = tracing._eager_calls(gm, model, (x,))
    calls.pop(None)
    kept, full = tracing._walk(gm, (x,), calls), tracing._walk(gm, (x,), None)
    assert kept is not None and full is not None
    assert all(torch.equal(kept[n], full[n]) for n in full if isinstance(full[n], torch.Tensor))
    torch.manual_seed(0)
    odd, y = _InPlace().eval(), torch.randn(8, 6)
    gm = tracing.trace(odd)
    calls = tracing._eager_calls(gm, odd, (y,))
    calls.pop(None)
    assert tracing._walk(gm, (y,), calls) is None  # act's input changed in place: full walk
    eng = FastEngine(odd, (y,))
    assert torch.equal(eng.golden, odd(y))
    faults = sample_faults(odd, 60, seed=4, error=EXPSIGN)
    before = {k: v.clone() for k, v in odd.state_dict().items()}
    _same(
        vulnerability.run_campaign(odd, y, faults, "dev>0.01"),
        vulnerability.run_campaign(odd, y, faults, "dev>0.01", engine="naive"),
    )
    after = odd.state_dict()  # the naive loop's in-place flips were all undone
    assert all(torch.equal(before[k].view(torch.int32), after[k].view(torch.int32)) for k in before)
    add = _AddInPlace().eval()
    gm = tracing.trace(add)
    assert not tracing._unchanged(tracing._eager_calls(gm, add, (y,)))  # bn's output edited
    eng, full = FastEngine(add, (y,)), tracing._walk(gm, (y,), None)
    assert full is not None and all(torch.equal(eng.env[n], full[n]) for n in eng.nodes[:-1])
    faults = sample_faults(add, 60, seed=5, error=EXPSIGN, targets="head.weight")
    _same(
        vulnerability.run_campaign(add, y, faults, "dev>0.01"),
        vulnerability.run_campaign(add, y, faults, "dev>0.01", engine="naive"),
    )
