"""GPU campaigns: the fast engine vs the naive loop vs PyTorchFI on CUDA, same fault lists.

    .venv/bin/python bench/pvf_gpu_bench.py [--faults 500] [--repeats 3] [--out FILE]

Runs ``bench/pvf_models_bench.py``'s measurement with ``--device cuda`` (ResNet-18 with a
batch of 32 images, BERT, DLRM, GCN; weight and activation faults in the exponent/sign
bits and at uniform bits): trials/s per contender, medians of ``--repeats`` interleaved
runs, and the count of trials whose outcome was checked equal to the naive loop's (the
script exits 1 on any mismatch). Sized to finish in under five minutes on one GPU. Without
a CUDA device it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

VARIANTS = ("weight/expsign", "weight/uniform", "act/expsign", "act/uniform")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--faults", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="resnet18,bert,dlrm,gcn")
    ap.add_argument("--out", default="bench/results/pvf_gpu_bench.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: skipping the GPU campaign bench (run it on a GPU machine)")
        return 0
    import pvf_models_bench as models_bench

    models_bench.BATCH["resnet18"] = 32
    t0, rows = time.perf_counter(), []
    for name in a.models.split(","):
        for v in VARIANTS:
            kind, bits = v.split("/")
            row = models_bench.measure(name, kind, bits, a.faults, a.repeats, "cuda")
            rows.append(row)
            tps = {k: round(x, 1) for k, x in row["trials_per_s"].items()}
            print(name, v, tps, "mismatches", row["mismatches"], flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=1, default=float))
    bad = [r for r in rows if any(r["mismatches"].values())]
    checked = sum(r["checked"] for r in rows)
    print(f"{torch.cuda.get_device_name()}: identical outcomes on {checked} contender-trials,")
    print(f"{len(bad)} variant(s) with mismatches, {time.perf_counter() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
