"""Campaign throughput on real models: stalwart's engine vs PyTorchFI 0.6 vs a naive loop.

    nice -n 10 .venv/bin/python bench/pvf_models_bench.py [--faults 200] [--repeats 3]
        [--models resnet18,bert,dlrm,gcn] [--quick] [--device cpu|cuda] [--clock wall|cpu]
        [--cold]

Per model, on one fault list per variant, contenders interleaved in every repeat (medians):

* ``weight/expsign``: single-bit weight faults in the exponent and sign bits (fp32 bits
  23..31), ``weight/uniform``: a uniform bit; targets are the Linear/Conv2d weights
  (PyTorchFI's injectable layers). PyTorchFI: ``declare_weight_fi`` with the bit-flipped
  value (it deep-copies the model per call), one forward per fault.
* ``act/expsign``, ``act/uniform``: single-bit faults in Linear/Conv2d outputs. PyTorchFI:
  ``declare_neuron_fi`` with the bit-flipped golden value, one fault per batch element per
  forward (its best configuration: B trials per pass; one per pass for the graph model).
* ``quant``: the model with ``quantize_dynamic`` int8 Linear layers, faults in the stored
  int8 weights, engine vs naive; its ratio to the float ``weight/uniform`` engine speed.

Contenders: ``engine`` is ``FastEngine.run`` per chunk with the campaign's recheck rule
(trials that rounding could decide, or with NaN/Inf, re-run naively), on any device;
``campaign`` is ``run_campaign`` (CPU; activation faults on the same engine path);
``naive`` one full forward per fault. The engine keeps its fx trace per model, so only a
contender's first call traces; ``--cold`` drops it before every call.

Every contender's outcome per trial (the model's criterion: top-1, or the click decision
for DLRM) must equal the naive loop's; the bench counts the trials checked and fails loudly
on a mismatch. ResNet-18 is defined here (torchvision's wheel for this torch is a CUDA
build that fails to import on the CPU torch); the transformer is a ``transformers`` BERT
built from a config (no downloads). One thread; ``--device cuda`` runs on a GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from stalwart import inject, models, vulnerability
from stalwart.vulnerability import tracing
from stalwart.vulnerability.activation_engine import hooked
from stalwart.vulnerability.judging import judge

EXPSIGN = inject.BitFlip(bits=list(range(23, 32)))
BATCH = {"resnet18": 8}
"""Images per ResNet-18 input batch (the GPU bench raises it)."""
CLOCK = {"now": time.perf_counter}
"""Wall clock, or this process's CPU time (``--clock cpu``: one thread, so CPU time is the
work done, less disturbed than wall time by other processes on a shared, loaded box)."""
COLD = {"on": False}
"""``--cold``: the kept fx trace is dropped before every contender call."""


class Block(nn.Module):
    """ResNet basic block (definition order = call order, as PyTorchFI counts layers)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """torchvision's resnet18 layout (7x7 stem, 4 stages of 2 basic blocks), 10 classes."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.pool = nn.MaxPool2d(3, 2, 1)
        blocks, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [Block(cin, cout, stride), Block(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = self.layers(x).mean((2, 3))
        return self.fc(x)


class Logits(nn.Module):
    """A ``transformers`` model that returns its logits tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids).logits


def build(name: str) -> tuple[nn.Module, tuple[Any, ...], str, bool]:
    """(model in eval mode, inputs, criterion, independent samples)."""
    torch.manual_seed(0)
    if name == "resnet18":
        model = ResNet18()
        for m in model.modules():  # non-trivial batch-norm statistics
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
        return model.eval(), (torch.randn(BATCH[name], 3, 32, 32),), "top1", True
    if name == "bert":
        from transformers import BertConfig, BertForSequenceClassification

        cfg = BertConfig(
            vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=256, max_position_embeddings=64, num_labels=4,
        )  # fmt: skip
        model = Logits(BertForSequenceClassification(cfg))
        return model.eval(), (torch.randint(1, 1000, (8, 32)),), "top1", True
    ref = models.load(name)
    inputs = tuple(a[:64] for a in ref.inputs) if name == "dlrm" else tuple(ref.inputs)
    crit = "decision" if name == "dlrm" else "top1"
    return ref.model, inputs, crit, name != "gcn"


def layer_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


class Fixed(nn.Module):
    """PyTorchFI needs ``model(x)`` with one float tensor: run the fixed inputs instead."""

    def __init__(self, model: nn.Module, inputs: tuple[Any, ...]) -> None:
        super().__init__()
        self.m, self.inputs = model, inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(*self.inputs)


def flipped(value: torch.Tensor, mask: int) -> float:
    raw = value.detach().reshape(1).clone().view(torch.int32)
    raw ^= inject.bits.signed_mask(mask, inject.bits.layout_of(torch.float32))
    return float(raw.view(torch.float32)[0])


def pfi_weight(model, inputs, faults, judge) -> np.ndarray:
    """One ``declare_weight_fi`` (a deep copy inside PyTorchFI) and one forward per fault."""
    from pytorchfi.core import fault_injection

    wrapped = Fixed(model, inputs)
    layers = layer_names(wrapped)
    dev = next(model.parameters()).device
    pfi = fault_injection(wrapped, 1, input_shape=[1], layer_types=[nn.Conv2d, nn.Linear],
                          use_cuda=dev.type == "cuda")  # fmt: skip
    params = dict(wrapped.named_parameters())
    failed = np.zeros(len(faults), bool)
    for i, f in enumerate(faults):
        w = params["m." + f.target]
        idx = [*np.unravel_index(f.index, tuple(w.shape)), None, None][:4]
        faulty = pfi.declare_weight_fi(
            layer_num=[layers.index("m." + f.target.rpartition(".")[0])],
            k=[int(idx[0])], dim1=[int(idx[1])],
            dim2=[None if idx[2] is None else int(idx[2])],
            dim3=[None if idx[3] is None else int(idx[3])],
            value=[flipped(w.reshape(-1)[f.index], f.mask)],
        )  # fmt: skip
        with torch.no_grad():
            out = faulty(None)
        failed[i] = bool(judge(out.unsqueeze(0)).any())
    return failed


def golden_acts(model: nn.Module, inputs: tuple[Any, ...], names: set[str]) -> dict:
    outs, order, hs = {}, [], []

    def grab(n: str) -> Callable[..., None]:
        def hook(_m: nn.Module, _a: Any, o: torch.Tensor) -> None:
            order.append(n)
            outs.setdefault(n, o.detach().clone())

        return hook

    for n, m in model.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            hs.append(m.register_forward_hook(grab(n)))
    with torch.no_grad():
        model(*inputs)
    for h in hs:
        h.remove()
    return {"out": {n: outs[n] for n in names}, "order": order}


def packs(faults: vulnerability.FaultList, independent: bool) -> list[list[int]]:
    """Trials grouped so no batch element carries two faults (one per pack if dependent)."""
    out: list[tuple[set[int], list[int]]] = []
    for i, f in enumerate(faults):
        for seen, members in out if independent else []:
            if f.sample not in seen:
                seen.add(f.sample)
                members.append(i)
                break
        else:
            out.append(({f.sample}, [i]))
    return [m for _, m in out]


def pfi_neuron(model, inputs, faults, judge, independent) -> np.ndarray:
    """``declare_neuron_fi`` with up to B faults (distinct batch elements) per forward."""
    from pytorchfi.core import fault_injection

    wrapped = Fixed(model, inputs)
    gold = golden_acts(wrapped, (None,), {"m." + f.target for f in faults})
    b = len(next(iter(gold["out"].values())))
    dev = next(model.parameters()).device
    pfi = fault_injection(wrapped, b, input_shape=[1], layer_types=[nn.Conv2d, nn.Linear],
                          use_cuda=dev.type == "cuda")  # fmt: skip
    failed = np.zeros(len(faults), bool)
    for pack in packs(faults, independent):
        kw: dict[str, list] = {
            k: [] for k in ("batch", "layer_num", "dim1", "dim2", "dim3", "value")
        }
        for i in pack:
            f = faults[i]
            g = gold["out"]["m." + f.target][f.sample]
            idx = [*np.unravel_index(f.index, tuple(g.shape)), None, None][:3]
            kw["batch"].append(f.sample)
            kw["layer_num"].append(gold["order"].index("m." + f.target))
            for d, v in zip(("dim1", "dim2", "dim3"), idx, strict=True):
                kw[d].append(None if v is None else int(v))
            kw["value"].append(flipped(g.reshape(-1)[f.index], f.mask))
        faulty = pfi.declare_neuron_fi(**kw)
        with torch.no_grad():
            fails = judge(faulty(None).unsqueeze(0))[0]
        for i in pack:
            failed[i] = bool(fails[faults[i].sample] if independent else fails.any())
    return failed


def _chunks(
    faults: vulnerability.FaultList, eng: vulnerability.engine.FastEngine
) -> list[list[int]]:
    by: dict[tuple[str, str], list[int]] = {}
    for i, f in enumerate(faults):
        by.setdefault((f.kind, f.target if f.kind == "param" else ""), []).append(i)
    out = []
    for (kind, target), idx in by.items():
        size = eng.chunk_size(target) if kind == "param" else 256
        out += [idx[s : s + size] for s in range(0, len(idx), size)]
    return out


def engine_judged(model, inputs, faults, crit, indep) -> np.ndarray:
    """``FastEngine.run`` per chunk, every trial whose judgement rounding could decide (or
    with a NaN/Inf output) re-run naively: the campaign's protocol, on any device, for
    weight and activation faults alike."""
    c = [vulnerability.criterion(crit)]
    eng = vulnerability.engine.FastEngine(model, inputs)
    naive = vulnerability.engine.NaiveEngine(model, inputs, golden=eng.golden)
    failed = np.zeros(len(faults), bool)
    for idx in _chunks(faults, eng):
        chunk = [faults[i] for i in idx]
        out = eng.run(chunk, independent=indep)
        fails, margin = judge(c, eng.golden, out)  # as the campaign judges
        bad = ~torch.isfinite(out.reshape(len(out), -1)).all(1) | (margin < 1e-5)
        redo = bad.nonzero().flatten().tolist()
        if redo:
            again = [chunk[i] for i in redo]
            act = chunk[0].kind == "activation"  # re-run packed, as the campaign does
            out[redo] = hooked(eng, again, indep) if act else naive.run(again)
            fails, _ = judge(c, eng.golden, out)
        failed[idx] = fails[c[0].name].reshape(len(out), -1).any(1).cpu().numpy()
    return failed


def naive_judged(model, inputs, faults, crit) -> np.ndarray:
    """One fault, one full forward (flip in place, or hooks for activations)."""
    c = vulnerability.criterion(crit)
    naive = vulnerability.engine.NaiveEngine(model, inputs)
    failed = np.zeros(len(faults), bool)
    for i, f in enumerate(faults):
        if f.kind == "activation":
            with torch.no_grad(), inject.activation_faults(model, [f]):
                out = model(*inputs).unsqueeze(0)
        else:
            out = naive.run([f])
        failed[i] = bool(c.judge(naive.golden, out).any())
    return failed


def variant(name: str, kind: str, bits: str, n: int) -> tuple[Any, ...]:
    model, inputs, crit, indep = build(name)
    error = EXPSIGN if bits == "expsign" else None
    if kind == "quant":
        model = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
        qlinear = [torch.ao.nn.quantized.dynamic.Linear]
        faults = vulnerability.sample_faults(
            model.eval(), n, targets="*.weight", module_types=qlinear, seed=1
        )
    elif kind == "weight":
        faults = vulnerability.sample_faults(
            model, n, targets="*.weight", module_types=[nn.Linear, nn.Conv2d], seed=1, error=error
        )
    else:
        mods = layer_names(model)
        faults = vulnerability.sample_activation_faults(
            model, inputs, n, modules=mods, seed=1, error=error
        )
    return model.eval(), inputs, crit, indep, faults


def contenders(model, inputs, crit, indep, faults, kind, device) -> dict[str, Callable[[], Any]]:
    c = vulnerability.criterion(crit)
    with torch.no_grad():
        golden = model(*inputs)
    judge = lambda out: c.judge(golden, out)  # noqa: E731
    out: dict[str, Callable[[], Any]] = {
        "engine": lambda: engine_judged(model, inputs, faults, crit, indep),
        "naive": lambda: naive_judged(model, inputs, faults, crit),
    }
    if device == "cpu":  # the campaign API (its result arrays are NumPy, filled on CPU)
        out["campaign"] = lambda: vulnerability.run_campaign(
            model, inputs, faults, crit, independent_samples=indep
        ).failed[c.name]
    if kind == "act":
        out["pytorchfi"] = lambda: pfi_neuron(model, inputs, faults, judge, indep)
    elif kind == "weight":
        out["pytorchfi"] = lambda: pfi_weight(model, inputs, faults, judge)
    return out


def measure(name: str, kind: str, bits: str, n: int, repeats: int, device: str) -> dict:
    model, inputs, crit, indep, faults = variant(name, kind, bits, n)
    if device != "cpu":
        model = model.to(device)
        inputs = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in inputs)
    runs: dict[str, list[float]] = {}
    outcomes: dict[str, np.ndarray] = {}
    fns = contenders(model, inputs, crit, indep, faults, kind, device)
    for _ in range(repeats):
        for who, fn in fns.items():
            if COLD["on"]:
                tracing.forget()  # every contender call traces the model again
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = CLOCK["now"]()
            got = fn()
            if device == "cuda":
                torch.cuda.synchronize()
            runs.setdefault(who, []).append(len(faults) / (CLOCK["now"]() - t0))
            if who in outcomes and not np.array_equal(outcomes[who], got):
                raise SystemExit(f"{name} {kind}/{bits}: {who} is not deterministic")
            outcomes[who] = got
    ref = outcomes["naive"]
    mism = {k: int((v != ref).sum()) for k, v in outcomes.items()}
    med = {k: statistics.median(v) for k, v in runs.items()}
    rng = {k: (min(v), max(v)) for k, v in runs.items()}
    row = {"model": name, "faults": f"{kind}/{bits}", "n": len(faults), "trials_per_s": med,
           "range": rng, "failures": int(ref.sum()), "mismatches": mism,
           "checked": len(faults) * (len(outcomes) - 1)}  # fmt: skip
    for who in ("pytorchfi", "naive"):
        if who in med:
            row[f"engine_vs_{who}"] = med["engine"] / med[who]
            if "campaign" in med:
                row[f"campaign_vs_{who}"] = med["campaign"] / med[who]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--faults", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="resnet18,bert,dlrm,gcn")
    ap.add_argument(
        "--variants", default="weight/expsign,weight/uniform,act/expsign,act/uniform,quant/uniform"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=8, help="ResNet-18 images per input")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--cold", action="store_true", help="no kept fx trace between calls")
    ap.add_argument("--out", default="bench/results/pvf_models_bench.json")
    a = ap.parse_args()
    if a.quick:
        a.faults, a.repeats = 40, 1
    BATCH["resnet18"] = a.batch
    COLD["on"] = a.cold
    if a.clock == "cpu":
        if a.device != "cpu":
            raise SystemExit("--clock cpu measures CPU runs only; use --clock wall on a GPU")
        CLOCK["now"] = time.process_time
    torch.set_num_threads(1)
    logging.getLogger().setLevel(logging.ERROR)
    rows = []
    for name in a.models.split(","):
        for v in a.variants.split(","):
            kind, bits = v.split("/")
            if kind == "quant" and name in ("resnet18", "gcn"):
                continue  # quantize_dynamic covers Linear layers: DLRM and BERT
            row = measure(name, kind, bits, a.faults, a.repeats, a.device)
            rows.append(row)
            print(json.dumps(row, default=lambda x: round(x, 2)), flush=True)
    bad = [r for r in rows if any(r["mismatches"].values())]
    from pathlib import Path

    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=1, default=float))
    print(f"identical outcomes on {sum(r['checked'] for r in rows)} contender-trials;"
          f" {len(bad)} variant(s) with mismatches")  # fmt: skip
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
