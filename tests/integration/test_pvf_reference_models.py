"""Every reference model: the fast engine's outcomes equal the naive loop's on one fault
list (closed forms, embedding rows, message passing, attention), with several criteria."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stalwart import models, vulnerability


@pytest.mark.parametrize("name", ["dlrm", "gcn", "transformer", "mlp"])
def test_fast_equals_naive(name: str) -> None:
    ref = models.load(name)
    n = 256 if name == "dlrm" else None
    inputs = tuple(t[:n] for t in ref.inputs) if n and name != "gcn" else ref.inputs
    labels = ref.labels[:n] if n else ref.labels
    faults = vulnerability.sample_faults(ref.model, 6, per_tensor=True, seed=5)
    crit = list(ref.criteria)
    fast = vulnerability.run_campaign(
        ref.model, inputs, faults, crit, labels=labels, independent_samples=ref.independent_samples
    )
    naive = vulnerability.run_campaign(
        ref.model, inputs, faults, crit, labels=labels, engine="naive"
    )
    assert fast.manifest["engine"] == "fast"
    for c in fast.criteria:
        assert np.array_equal(fast.failed[c], naive.failed[c]), c
    assert torch.equal(ref.model(*inputs), ref.model(*inputs))  # model left clean
