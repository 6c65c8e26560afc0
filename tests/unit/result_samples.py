"""Small real results of every kind that renders in notebooks, with hostile names.

Shared by ``test_repr_html.py`` and ``test_frames.py``: a diagnosis and a KPI localisation
over a log whose attribute column and values carry HTML, a PVF report and a campaign over a
model whose submodule is named ``<script>…``, protection results, and a checkpoint diff and
inspection whose tensor names carry HTML.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from stalwart import Checkpointer, CheckpointOptions, protect, vulnerability
from stalwart.checkpoint.tools.diff import DiffReport, diff_steps
from stalwart.checkpoint.tools.inspection import Inspection, inspect_manifest
from stalwart.diagnose import DiagnoseOptions, Diagnosis, analyze, localize
from stalwart.protect.evaluate import ProtectionResults

HOSTILE = "<script>alert('x')</script>"
"""A name that would run as script if it reached the page unescaped."""


def hostile_log(rows: int = 4000, seed: int = 0) -> pa.Table:
    """Failures concentrated on one value of a column named ``HOSTILE``."""
    rng = np.random.default_rng(seed)
    evil = rng.integers(0, 4, rows)
    other = rng.integers(0, 3, rows)
    failed = rng.random(rows) < np.where(evil == 0, 0.5, 0.02)
    return pa.table(
        {
            HOSTILE: [f"<b>v{v}</b>" for v in evil],
            "zone": [f"z{v}" for v in other],
            "failed": failed,
        }
    )


def diagnosis() -> Diagnosis:
    return analyze(hostile_log(), "failed", options=DiagnoseOptions(min_lift=1.2))


def kpi_diagnosis() -> Diagnosis:
    rng = np.random.default_rng(1)
    leaves = [(f"{HOSTILE}r{r}", f"h{h}") for r in range(4) for h in range(6)]
    expected = rng.integers(80, 120, len(leaves)).astype(float)
    actual = expected.copy()
    actual[[i for i, (r, _) in enumerate(leaves) if r.endswith("r2")]] *= 0.3  # one region drops
    table = pa.table(
        {
            "region": [r for r, _ in leaves],
            "host": [h for _, h in leaves],
            "actual": actual,
            "expected": expected,
        }
    )
    return localize(table, actual="actual", expected="expected")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.add_module(HOSTILE, nn.Linear(6, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, HOSTILE)(x)


def campaign() -> tuple[nn.Module, torch.Tensor, vulnerability.CampaignResult]:
    model = _Net().eval()
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(0))
    faults = vulnerability.sample_faults(model, 60, seed=0)
    return model, x, vulnerability.run_campaign(model, x, faults, ["top1", "dev>0.05"])


def pvf_report() -> vulnerability.PVFReport:
    return vulnerability.estimate(campaign()[2], "tensor")


def protection_results() -> ProtectionResults:
    model, x, _ = campaign()
    faults = vulnerability.sample_faults(model, 30, seed=1)
    sbp = protect.SelectiveBitProtection(("sign", "exponent"))
    return protect.evaluate(model, (x,), faults, [sbp], repeats=1)


def checkpoint_results(root: Path) -> tuple[DiffReport, Inspection, Checkpointer]:
    """Two steps of a state with hostile tensor names and values: (diff, inspection, ckpt)."""
    opts = CheckpointOptions(chunk_bytes=4096, io_threads=2)
    state = {HOSTILE: torch.ones(8, 8), "b": torch.zeros(5), "note": "<img src=x onerror=1>"}
    ck = Checkpointer(root, opts)
    ck.save(1, state)
    state2 = {HOSTILE: torch.ones(8, 8) * 2, "c": torch.arange(3.0), "note": HOSTILE}
    ck.save(2, state2, metadata={HOSTILE: HOSTILE})
    return diff_steps(ck, 1, 2), inspect_manifest(ck.manifest(2)), ck
