"""Do PVF estimates hit the truth, and do their intervals cover it as often as they claim?

    nice -n 10 .venv/bin/python bench/pvf_coverage_bench.py [--seeds 400] [--pvf-seeds 20]

A tiny MLP (4-5-3, three of four input features zero, so most weight flips are masked) is
enumerated: every bit of every parameter flipped once, judged by ``dev>0.05`` on the naive
engine. That gives the true PVF of every tensor, layer, bit field and of the model. Then:

* ``estimate`` over sampled fault lists (uniform, and stratified ``per_tensor`` as ``pvf``'s
  by-layer rounds draw them), each trial's outcome looked up in the enumeration, ``--seeds``
  times: mean estimate against the truth, and how often the 95% interval covers it (overall
  and the worst group);
* ``pvf(by="layer")`` end to end, ``--pvf-seeds`` times: the same for each layer.

Coverage near 0.95 is calibrated; a mean off the truth is bias. Run it on two trees (``PYTHONPATH``)
to compare them; results go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import nn

from stalwart.inject import Fault
from stalwart.inject.bits import layout_of
from stalwart.vulnerability import (
    CampaignResult,
    FaultList,
    FixedTrials,
    PVFOptions,
    estimate,
    pvf,
    run_campaign,
    sample_faults,
)

C = "dev>0.05"


def every_fault(model: nn.Module) -> FaultList:
    faults, population = [], {}
    for name, p in model.named_parameters():
        bits = layout_of(p.dtype).bits
        population[name] = p.numel() * bits
        faults += [Fault(name, i, 1 << b) for i in range(p.numel()) for b in range(bits)]
    return FaultList(faults, 0, "bitflip", population)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=400)
    ap.add_argument("--pvf-seeds", type=int, default=20)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).eval()
    x = torch.randn(6, 4)
    x[:, 1:] = 0
    every = every_fault(model)
    failed = run_campaign(model, x, every, C, engine="naive").failed[C]
    outcome = {(f.target, f.index, f.mask): bool(v) for f, v in zip(every, failed, strict=True)}
    targets = np.array([f.target for f in every])
    lay = layout_of(torch.float32)
    fields = np.array([lay.field(int(f.bits[0])) for f in every])
    truth_all = float(failed.mean())

    def looked_up(faults: FaultList) -> CampaignResult:
        got = np.array([outcome[(f.target, f.index, f.mask)] for f in faults])
        none = np.zeros(len(faults), bool)
        attrs = faults.attributes(model)
        return CampaignResult(faults, [C], {C: got}, {C: got.astype(float)}, none, none, attrs, {})

    def truth(by: str, group: str) -> float:
        if by == "tensor":
            return float(failed[targets == group].mean())
        if by == "field":
            return float(failed[fields == group].mean())
        return truth_all

    print(f"true model PVF {truth_all:.4f} over {len(every)} faults")
    for by, n, per_tensor in (("all", 60, False), ("all", 60, True), ("field", 60, True),
                              ("field", 300, False), ("tensor", 40, True)):  # fmt: skip
        covered: dict[str, list[int]] = {}
        overall, means = 0, []
        for s in range(a.seeds):
            faults = sample_faults(model, n, seed=1000 + s, per_tensor=per_tensor)
            rep = estimate(looked_up(faults), by)
            for g in rep.rows:
                c = covered.setdefault(g.group, [0, 0])
                c[0] += g.low <= truth(by, g.group) <= g.high
                c[1] += 1
            p, lo, hi = rep.overall[C]
            means.append(p)
            overall += lo <= truth_all <= hi
        worst = min(k / m for k, m in covered.values())
        print(f"estimate by={by:6} n={n:3} per_tensor={per_tensor!s:5}: model mean "
              f"{np.mean(means):.4f} (truth {truth_all:.4f}), model coverage "
              f"{overall / a.seeds:.3f}, worst group coverage {worst:.3f}")  # fmt: skip

    layers = {L: float(failed[np.char.startswith(targets.astype(str), L + ".")].mean())
              for L in ("0", "2")}  # fmt: skip
    est: dict[str, list[float]] = {L: [] for L in layers}
    cover = dict.fromkeys(layers, 0)
    for seed in range(a.pvf_seeds):
        rep = pvf(model, x, C, PVFOptions(by="layer", stop=FixedTrials(2000), seed=seed))
        for g in rep.rows:
            est[g.group].append(g.pvf)
            cover[g.group] += g.low <= layers[g.group] <= g.high
    for L, t in layers.items():
        print(f"pvf by=layer, layer {L}: mean {np.mean(est[L]):.4f} (sd {np.std(est[L]):.4f}), "
              f"truth {t:.4f}, 95% interval covered {cover[L]}/{a.pvf_seeds}")  # fmt: skip


if __name__ == "__main__":
    main()
