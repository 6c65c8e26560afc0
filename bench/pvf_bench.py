"""Benchmark of fault-injection campaigns, PVF reports and protections (docs/benchmarks.md).

    .venv/bin/python bench/pvf_bench.py [--faults 300] [--repeats 3] [--quick]

1. Throughput on weight faults (trials/s), same fault list, same outcomes: stalwart's fast
   engine vs the naive in-place loop, the copy-flip-forward loop and PyTorchFI 0.6
   (``declare_weight_fi`` with the bit-flipped value), on the digits CNN and a 4-layer MLP.
2. PVF by bit and by layer with 95 % Wilson intervals for every reference model, timed.
3. Protections on a replayed fault list and under bit-error rates (digits CNN, DLRM):
   clipping bounds and ABFT thresholds are calibrated on a held-out half of the inputs
   (``--calibration-fraction``) and every protection is scored on the other, disjoint half;
   selective bit protection is measured with a simulated SECDED code (``--protect-only``
   runs this part alone).
One thread (shared machines make multi-threaded timings noisy); medians of --repeats runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from stalwart import models, protect, vulnerability
from stalwart.protect.evaluate import split_inputs


def pytorchfi_loop(
    model: nn.Module, x: torch.Tensor, faults: vulnerability.FaultList
) -> np.ndarray:
    """One fault per declare_weight_fi (deep copy inside PyTorchFI), one forward each
    (``pvf_models_bench.pfi_weight``, judged by top-1 with NaN/Inf as a failure)."""
    from pvf_models_bench import pfi_weight

    logging.getLogger().setLevel(logging.WARNING)
    top1 = vulnerability.criterion("top1")
    with torch.no_grad():
        golden = model(x)
    return pfi_weight(model, (x,), faults, lambda out: top1.judge(golden, out))


def throughput(name: str, n: int, repeats: int) -> dict:
    ref = models.load(name)
    model, x = ref.model, ref.inputs[0]
    faults = vulnerability.sample_faults(model, n, targets="*.weight", seed=0)
    runs: dict[str, list[float]] = {}
    outcomes: dict[str, np.ndarray] = {}
    for _ in range(repeats):
        for engine in ("fast", "naive", "copy", "pytorchfi"):
            t0 = time.perf_counter()
            if engine == "pytorchfi":
                outcomes[engine] = pytorchfi_loop(model, x, faults)
            else:
                res = vulnerability.run_campaign(model, x, faults, "top1", engine=engine)
                outcomes[engine] = res.failed["top1"]
            runs.setdefault(engine, []).append(len(faults) / (time.perf_counter() - t0))
    same = all(np.array_equal(outcomes["fast"], o) for o in outcomes.values())
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "model": name,
        "faults": n,
        "inputs": int(x.shape[0]),
        "trials_per_s": med,
        "speedup_vs_pytorchfi": med["fast"] / med["pytorchfi"],
        "speedup_vs_naive": med["fast"] / med["naive"],
        "outcomes_identical": same,
        "failures": int(outcomes["fast"].sum()),
    }


def pvf_tables(trials: int) -> list[dict]:
    out = []
    for name in models.available():
        ref = models.load(name)
        labels = ref.labels
        row: dict = {"model": name, "quality": ref.quality, "metric": ref.metric}
        for by in ("bit", "layer"):
            t0 = time.perf_counter()
            opts = vulnerability.PVFOptions(by=by, stop=vulnerability.FixedTrials(trials), seed=0)
            rep = vulnerability.pvf(
                ref.model, ref.inputs, list(ref.criteria[:2]), opts, labels=labels
            )
            row[f"by_{by}_s"] = time.perf_counter() - t0
            row[f"by_{by}"] = [
                dict(
                    group=r.group,
                    criterion=r.criterion,
                    trials=r.trials,
                    pvf=r.pvf,
                    low=r.low,
                    high=r.high,
                )
                for r in rep.rows
            ]
            row[f"overall_{by}"] = rep.overall
        out.append(row)
    return out


def protections(n: int, fraction: float = 0.5) -> list[dict]:
    """Replayed faults and BER sweeps, calibrated and scored on disjoint inputs."""
    out = []
    for name in ("digits-cnn", "dlrm"):
        ref = models.load(name)
        split = split_inputs(ref.inputs, ref.labels, fraction, seed=0)
        scored = dataclasses.replace(ref, inputs=split.evaluation, labels=split.labels)
        scored.quality = scored.evaluate()
        ps = [
            protect.ActivationClipping(ref.model, split.calibration),
            protect.ABFT(ref.model, split.calibration),
            protect.SelectiveBitProtection(),
            protect.ParameterScrubber(ref.model),
        ]
        faults = vulnerability.sample_faults(ref.model, n, seed=1)
        res = protect.evaluate(
            ref.model, scored.inputs, faults, ps, ref.criteria[0], labels=scored.labels
        )
        sweep = protect.ber_sweep(ref.model, scored.evaluate, [1e-5, 1e-4, 1e-3], ps, repeats=3)
        sbp = ps[2]
        out.append(
            {
                "model": name,
                "criterion": ref.criteria[0],
                "clean": scored.quality,
                "calibration_samples": len(split.calibration_index),
                "evaluation_samples": len(split.evaluation_index),
                "sbp_codewords": {"corrected": sbp.corrected, "uncorrectable": sbp.uncorrectable},
                "results": [r.__dict__ for r in res],
                "ber": {
                    k: {str(r): statistics.mean(v) for r, v in d.items()} for k, d in sweep.items()
                },
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--faults", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--protect-only", action="store_true", help="run part 3 only")
    ap.add_argument("--calibration-fraction", type=float, default=0.5)
    ap.add_argument("--out", type=Path, default=Path("bench/results/pvf_bench.json"))
    a = ap.parse_args()
    if a.quick:
        a.faults, a.repeats, a.trials = 40, 1, 200
    torch.set_num_threads(1)
    full = not a.protect_only
    result = {
        "throughput": [throughput(m, a.faults, a.repeats) for m in ("digits-cnn", "mlp")]
        if full
        else [],
        "pvf": pvf_tables(a.trials) if full else [],
        "protect": protections(a.faults, a.calibration_fraction),
        "torch": torch.__version__,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1, default=float))
    for t in result["throughput"]:
        print(json.dumps({k: v for k, v in t.items()}, default=float))
    for p in result["pvf"]:
        print(
            p["model"],
            f"quality={p['quality']:.4f}",
            f"by_bit {p['by_bit_s']:.1f}s",
            f"by_layer {p['by_layer_s']:.1f}s",
            "overall",
            p["overall_bit"],
        )
    for p in result["protect"]:
        print(
            p["model"],
            f"calibrated on {p['calibration_samples']} inputs, scored on "
            f"{p['evaluation_samples']} (disjoint); clean {p['clean']:.4f}; "
            f"SBP codewords {p['sbp_codewords']}",
        )
        for r in p["results"]:
            print(
                p["model"],
                r["name"],
                r["failures"],
                "/",
                r["baseline_failures"],
                f"recovered={r['recovered']:.2f} overhead={r['overhead']:+.2f}",
                r["cost"],
                r["method"],
            )
        print(p["model"], "ber", p["ber"])


if __name__ == "__main__":
    main()
